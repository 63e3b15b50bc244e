"""World-size-1 overhead over the unwrapped model, every contender's steps interleaved in one process.

    python -m benchmarks.overhead TRANSPORT WORKLOAD_JSON WARMUP STEPS   (prints one JSON line)

At world size 1 an FSDP has nothing to exchange, so its cost over the plain model is a few percent,
while this shared machine's speed drifts by tens of percent between processes a minute apart (the
separate-process rows of the main table). Here the contenders (same seed, same batches) train side
by side, one step each in turn, and each figure is the median of its per-round ratios to the plain
model's step of the same round: a drift hits every member of a round alike. xla_fsdp runs in both
layouts, per-parameter (the default) and flat; the peer is PyTorch FSDP1 (which switches itself to
NO_SHARD at one rank) on gloo and torch_xla's FSDP (flat, the main table's settings) on XLA:CPU.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn as nn

from . import contenders
from .workloads import Workload, batch, build_model, loss_fn, make_optimizer

PLAIN = "unwrapped"


def _step(model: nn.Module, opt, w: Workload, step: int, device, sync: Callable) -> Tuple[float, float]:
    x, y = batch(w, step, 0, w.batch)
    t0 = time.perf_counter()
    x, y = x.to(device), y.to(device)
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    sync()
    value = loss.item()
    return time.perf_counter() - t0, value


def interleave(models: Dict[str, nn.Module], w: Workload, warmup: int, steps: int, device,
               sync: Callable) -> Dict[str, Any]:
    """One step of every model per round (the order rotates every round); per-step times and losses."""
    names = list(models)
    opts = {n: make_optimizer(w, m.parameters()) for n, m in models.items()}
    times: Dict[str, List[float]] = {n: [] for n in names}
    losses: Dict[str, List[float]] = {n: [] for n in names}
    for step in range(warmup + steps):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            t, loss = _step(models[name], opts[name], w, step, device, sync)
            losses[name].append(loss)
            if step >= warmup:
                times[name].append(t)
    out: Dict[str, Any] = {}
    for name in names:
        ratios = [t / p for t, p in zip(times[name], times[PLAIN])]
        out[name] = {"times": times[name], "median_step_s": statistics.median(times[name]),
                     "ratio_to_plain": statistics.median(ratios), "losses": losses[name],
                     "max_loss_diff_to_plain": max(abs(a - b) for a, b in zip(losses[name], losses[PLAIN]))}
    return out


def _gloo(w: Workload, warmup: int, steps: int) -> Dict[str, Any]:
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        models = {PLAIN: build_model(w),
                  "xla_fsdp": contenders.wrap_gloo("xla_fsdp", build_model(w), w, 1, flatten_parameters=False),
                  "xla_fsdp flat": contenders.wrap_gloo("xla_fsdp", build_model(w), w, 1),
                  "fsdp1": contenders.wrap_gloo("fsdp1", build_model(w), w, 1)}
        return interleave(models, w, warmup, steps, torch.device("cpu"), lambda: None)
    finally:
        dist.destroy_process_group()


def _xla(w: Workload, warmup: int, steps: int) -> Dict[str, Any]:
    os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    import xla_fsdp  # XLA:CPU environment defaults before the runtime starts
    import torch_xla
    device = torch_xla.device()  # one device in this process: no launcher needed
    models = {PLAIN: contenders.wrap_xla("xla_plain", build_model(w), w, device),
              "xla_fsdp": contenders.wrap_xla("xla_fsdp_xla", build_model(w), w, device, flatten_parameters=False),
              "xla_fsdp flat": contenders.wrap_xla("xla_fsdp_xla", build_model(w), w, device),
              "torchxla_fsdp": contenders.wrap_xla("torchxla_fsdp", build_model(w), w, device)}
    return interleave(models, w, warmup, steps, device, xla_fsdp.sync)


def measure(transport: str, w: Workload, warmup: int, steps: int) -> Dict[str, Any]:
    torch.set_num_threads(1)
    return _gloo(w, warmup, steps) if transport == "gloo" else _xla(w, warmup, steps)


def main(argv=None) -> None:
    transport, workload, warmup, steps = (argv or sys.argv[1:])[:4]
    print(json.dumps(measure(transport, Workload(**json.loads(workload)), int(warmup), int(steps))))


if __name__ == "__main__":
    main()
