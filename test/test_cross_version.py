"""The road off torch_xla, and back: a run trained with xla_fsdp on XLA:CPU devices (torch
2.9 + torch_xla) continues on the newest torch with no torch_xla, under xla_fsdp's torch transport at
another world size and under upstream ``fully_shard`` (FSDP2) through ``xla_fsdp.convert --to dcp``;
FSDP2's checkpoint comes back through ``--from dcp`` and continues on XLA:CPU again. Every leg equals
the same model trained without interruption, unsharded, in one process (losses and parameters within
1e-5: the frameworks sum gradients in different orders).

The legs run in the two environments ``make test`` builds, as subprocesses of their interpreters
(``XLA_FSDP_XLA_PYTHON``, ``XLA_FSDP_NEWEST_PYTHON``; default ``.venv`` and ``.venv-newest``), so
the test runs once, in the newest environment's suite (``make test-newest``)."""
import os
import subprocess
import sys

import pytest
import torch

import harness
from conftest import ENVIRONMENTS, HAS_TORCH_XLA
from xla_fsdp.convert import main as convert_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEGS = os.path.join(ROOT, "test", "cross_version_legs.py")
NAME = "zero3_nested_adamw"  # the default layout: one shard per parameter
K = 5  # steps per leg
TOL = 1e-5
XLA_PYTHON, NEWEST_PYTHON = ENVIRONMENTS["xla-env"], ENVIRONMENTS["newest-env"]

pytestmark = [
    pytest.mark.skipif(HAS_TORCH_XLA, reason="runs once, in the newest environment's suite (make test-newest), "
                                             "which calls the torch_xla environment for its XLA legs"),
    pytest.mark.skipif(not os.path.exists(XLA_PYTHON), reason=f"needs the torch_xla environment's interpreter "
                                                              f"({XLA_PYTHON}; make install builds it)"),
]


def _leg(python: str, kind: str, world_size: int, start: int, out: str, load=None, save=None) -> dict:
    cmd = [python, LEGS, kind, "--name", NAME, "--world_size", str(world_size), "--start", str(start),
           "--steps", str(K), "--out", out]
    cmd += ["--load", load] if load else []
    cmd += ["--save", save] if save else []
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "PYTHONPATH")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


def _check(leg: dict, reference: dict, steps: slice, what: str) -> None:
    want = reference["losses"][steps]
    worst_loss = max(abs(a - b) for a, b in zip(leg["losses"], want))
    worst_param = max((leg["full"][k].float() - v.float()).abs().max().item()
                      for k, v in reference["state_dict"].items())
    print(f"{what} (torch {leg['torch']}): losses within {worst_loss:.2e}, parameters within {worst_param:.2e}")
    assert worst_loss <= TOL and worst_param <= TOL, (what, leg["losses"], want)


def test_an_xla_run_continues_on_the_newest_torch_and_comes_back(tmp_path):
    """XLA:CPU x2 (torch 2.9) steps 0-5 -> (a) xla_fsdp on 4 gloo ranks (newest torch) steps 5-10,
    (b) DCP -> FSDP2 on 4 gloo ranks steps 5-10 -> DCP -> XLA:CPU x2 again, steps 10-15."""
    assert sys.executable != XLA_PYTHON
    p = lambda name: str(tmp_path / name)  # noqa: E731
    ref5, ref10, ref15 = (harness.train_reference(NAME, 2, steps=s, per_rank=4) for s in (K, 2 * K, 3 * K))

    first = _leg(XLA_PYTHON, "xla", 2, 0, p("xla0.pt"), save=p("xla_step5"))
    _check(first, ref5, slice(0, K), "XLA:CPU x2, steps 0-5")

    # (a) the same rank files, read by xla_fsdp's torch transport at 4 ranks on the newest torch
    ours = _leg(NEWEST_PYTHON, "gloo", 4, K, p("gloo5.pt"), load=p("xla_step5"))
    _check(ours, ref10, slice(K, 2 * K), "xla_fsdp on 4 gloo ranks, steps 5-10")

    # (b) through DCP to upstream FSDP2 at 4 ranks, which saves with DCP ...
    assert convert_cli(["--to", "dcp", "--ckpt_prefix", p("xla_step5"), "--out", p("dcp_step5")]) == 0
    theirs = _leg(NEWEST_PYTHON, "fsdp2", 4, K, p("fsdp2_5.pt"), load=p("dcp_step5"), save=p("dcp_step10"))
    _check(theirs, ref10, slice(K, 2 * K), "FSDP2 on 4 gloo ranks, steps 5-10")

    # ... and back: FSDP2's checkpoint as rank files for 2 XLA:CPU devices, on torch 2.9
    assert convert_cli(["--from", "dcp", "--ckpt_dir", p("dcp_step10"), "--world_size", "2",
                        "--out_prefix", p("back_step10")]) == 0
    back = _leg(XLA_PYTHON, "xla", 2, 2 * K, p("xla10.pt"), load=p("back_step10"))
    _check(back, ref15, slice(2 * K, 3 * K), "XLA:CPU x2 again, steps 10-15")
