"""What this machine's CPU kernels can run, probed once per process.

PyTorch's CPU kernels come from oneDNN, which picks its implementation by the instruction sets the
CPU has (and ``ONEDNN_MAX_CPU_ISA`` allows). A few of them exist only on newer CPUs: on an AVX2-only
x86-64 CPU (no AVX-512), ``nn.LSTM`` under ``torch.autocast("cpu", torch.bfloat16)`` raises "could not
create a primitive descriptor for the LSTM forward propagation primitive" in plain PyTorch (2.9 and
2.14), with no FSDP anywhere. A test program that needs such a kernel is not applicable on that
machine: the suite decides that from these probes, made once, and reports it (docs/testing.md).
XLA devices compile their own kernels and do not depend on these.

``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` make a newer CPU dispatch as an AVX2-only one.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Dict, Optional

import torch


def _lstm_under_bf16_autocast() -> None:
    lstm = torch.nn.LSTM(8, 8, batch_first=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lstm(torch.randn(3, 1, 8))[0]
    out.float().sum().backward()


#: kernel name -> a probe that runs it forward and backward on small shapes (raises where it cannot)
PROBES: Dict[str, Callable[[], None]] = {
    "nn.LSTM under CPU bf16 autocast": _lstm_under_bf16_autocast,
}


@functools.lru_cache(maxsize=None)
def missing(kernel: str) -> Optional[str]:
    """Why this machine cannot run ``kernel`` (the probe's error, first sentence), or None where it can.
    The probe leaves the caller's random state as it found it."""
    try:
        with torch.random.fork_rng(devices=[]):
            PROBES[kernel]()
    except RuntimeError as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0].split('. ')[0]}"
    return None


def cpu_description() -> str:
    """The CPU capability ATen dispatches to and oneDNN's limit, for reports."""
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return f"ATen CPU capability {torch.backends.cpu.get_cpu_capability()}" + (
        f", ONEDNN_MAX_CPU_ISA={limit}" if limit else "")
