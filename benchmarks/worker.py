"""Runs one contender at one world size and writes each rank's measurements as JSON.

    python -m benchmarks.worker SPEC_JSON OUT_DIR

Launched by :mod:`benchmarks.run` in a fresh process per measurement, so no contender inherits
another's memory, threads or XLA runtime. gloo contenders spawn their ranks with
``torch.multiprocessing``; XLA contenders use ``torch_xla.launch`` (one thread per XLA:CPU device).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Callable, Dict

import torch

from . import contenders, measure
from .workloads import Workload, batch, build_model, loss_fn, make_optimizer

_BUILD_LOCK = threading.Lock()


def train_loop(model, opt, w: Workload, spec: Dict[str, Any], rank: int, device, sync: Callable,
               barrier: Callable, shard_batch: Callable = lambda t: t, per_rank: int = 0) -> Dict[str, Any]:
    per_rank = per_rank or w.batch
    warmup, steps = spec["warmup"], spec["steps"]
    times, host_times, backward_host_times, losses = [], [], [], []
    compiles_step2 = transfers_start = ops_start = 0
    phase_marks = []
    for step in range(warmup + steps):
        if step == 2:  # the target: no new XLA compilation after the second step
            compiles_step2 = measure.xla_compiles()
        if step == warmup:
            measure.reset_collective_bytes(device)
            transfers_start = measure.xla_transfers_to_host()
        x, y = batch(w, step, rank, per_rank)
        contenders.new_step()
        barrier()
        if step == warmup:
            ops_start = measure.xla_ops_traced()
        t0, h0 = time.perf_counter(), time.thread_time()
        x, y = shard_batch(x.to(device)), shard_batch(y.to(device))
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        backward_clock = measure.BackwardThreadTime(loss)
        loss.backward()
        if spec.get("phases"):  # forward + backward (with the collectives) and the optimizer step as two graphs
            sync()
            phase_marks.append(len(measure.xla_compile_seconds()))
        opt.step()
        # the CPU time tracing the step (pytorch/xla#5280): this rank thread's, and autograd's thread's
        # for backward where that is another thread (XLA)
        caller = time.thread_time() - h0
        backward_host_times.append(backward_clock.seconds)
        host_times.append(None if backward_clock.seconds is None else caller + backward_clock.seconds)
        sync()
        value = loss.item()
        times.append(time.perf_counter() - t0)
        losses.append(value)
        phase_marks.append(len(measure.xla_compile_seconds()))
    barrier()  # every rank's steps traced
    compiles_end = measure.xla_compiles()
    barrier()  # XLA:CPU device threads share the counter: every rank reads it before any goes on
    return {
        "rank": rank, "times": times[warmup:], "host_times": host_times[warmup:],
        "backward_host_times": backward_host_times[warmup:], "losses": losses,
        "state_bytes": measure.state_bytes(model, opt),
        "peak_rss_mib": measure.peak_rss_mib(), "collective_bytes_per_step": measure.collective_bytes(device) / steps,
        "all_gathers_per_step": measure.all_gather_calls(device) / steps,
        "compiles_step2": compiles_step2, "compiles_end": compiles_end,
        # every rank thread's device-to-host copies per measured step (XLA): loss.item() makes one per rank
        "host_transfers_per_step": (measure.xla_transfers_to_host() - transfers_start) / steps,
        # every rank thread's ATen ops traced on XLA per measured step (the process's)
        "xla_ops_per_step": (measure.xla_ops_traced() - ops_start) / steps,
        "param_bytes": spec["param_bytes"],
        # every XLA compilation of the process, in order, and where each step's phases ended in that list
        "compile_seconds": measure.xla_compile_seconds(), "phase_marks": phase_marks, "all_times": times,
    }


def _write(out_dir: str, rank: int, result: Dict[str, Any]) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


# ----------------------------------------------------------------------------- gloo
def _gloo_rank(rank: int, spec: Dict[str, Any], out_dir: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    ws, w = spec["ws"], Workload(**spec["workload"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=ws)
    try:
        measure.install_collective_counters()
        model = contenders.wrap_gloo(spec["contender"], build_model(w), w, ws)
        opt = make_optimizer(w, model.parameters())
        result = train_loop(model, opt, w, spec, rank, torch.device("cpu"), lambda: None, dist.barrier)
        if spec["contender"] == "ddp":
            result["collective_bytes_per_step"] = None  # all-reduced by DDP's C++ reducer: not visible
        _write(out_dir, rank, result)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- XLA threads
def _xla_rank(index: int, spec: Dict[str, Any], out_dir: str) -> None:
    import torch_xla
    import torch_xla.runtime as xr
    import xla_fsdp
    from xla_fsdp.collectives.xla import install_safe_sync
    torch.set_num_threads(1)
    install_safe_sync()  # the multi-device recipe (lock + wait outside the GIL) for every XLA contender
    w, rank, device = Workload(**spec["workload"]), xr.global_ordinal(), torch_xla.device()
    measure.install_collective_counters()
    with _BUILD_LOCK:  # the rank threads share the CPU RNG
        model = build_model(w)
    model = contenders.wrap_xla(spec["contender"], model, w, device)
    opt = make_optimizer(w, model.parameters())
    barrier = _barrier(spec["ws"])
    barrier()
    _write(out_dir, rank, train_loop(model, opt, w, spec, rank, device, xla_fsdp.sync, barrier))


_BARRIERS: Dict[int, threading.Barrier] = {}


def _barrier(ws: int) -> Callable:
    with _BUILD_LOCK:
        return _BARRIERS.setdefault(ws, threading.Barrier(ws)).wait


def _spmd(spec: Dict[str, Any], out_dir: str) -> None:
    import torch_xla
    import torch_xla.runtime as xr
    xr.use_spmd()
    torch.set_num_threads(1)
    w, ws = Workload(**spec["workload"]), spec["ws"]
    measure.install_collective_counters()
    model, shard_batch = contenders.wrap_spmd(build_model(w), w, ws, spec["contender"])
    opt = make_optimizer(w, model.parameters())
    # One program for the global batch: every rank's samples, sharded over the mesh.
    result = train_loop(model, opt, w, spec, 0, torch_xla.device(), torch_xla.sync, lambda: None,
                        shard_batch=shard_batch, per_rank=w.batch * ws)
    result["collective_bytes_per_step"] = None  # inserted by the SPMD partitioner: not visible
    _write(out_dir, 0, result)


def main(argv=None) -> None:
    spec_json, out_dir = (argv or sys.argv[1:])[:2]
    spec = json.loads(spec_json)
    w = Workload(**spec["workload"])
    spec["param_bytes"] = sum(p.numel() * 4 for p in build_model(w).parameters())
    name, ws = spec["contender"], spec["ws"]
    if name in contenders.GLOO:
        if name == "unwrapped":
            torch.set_num_threads(1)
            model = build_model(w)
            opt = make_optimizer(w, model.parameters())
            # ws ranks' samples in one process: the ws1 baseline sees the same data as rank 0.
            _write(out_dir, 0, train_loop(model, opt, w, spec, 0, torch.device("cpu"), lambda: None, lambda: None))
            return
        import torch.multiprocessing as mp
        mp.spawn(_gloo_rank, args=(spec, out_dir), nprocs=ws)
    elif name in contenders.XLA_THREADS:
        os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(ws))
        if spec.get("cache_dir"):  # torch_xla's persistent compilation cache, before the runtime starts
            import torch_xla.runtime as xr
            xr.initialize_cache(spec["cache_dir"], readonly=False)
        import xla_fsdp  # torch_xla.launch with what several XLA:CPU devices need (torch_xla's FSDP too)
        xla_fsdp.launch(_xla_rank, args=(spec, out_dir))
    elif name in contenders.SPMD:
        os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(ws))
        import xla_fsdp
        xla_fsdp.enable_xla_cpu_devices()  # the same XLA:CPU environment as the other XLA contenders
        _spmd(spec, out_dir)
    else:
        raise SystemExit(f"unknown contender {name!r}; one of {contenders.ALL}")


if __name__ == "__main__":
    main()
