"""Host offload: what stays on the device, and what offloading costs per step.

    python -m benchmarks.offload [--rounds 3] [--steps 10] [--layers 8] [--hidden 1024]

An MLP of ``--layers`` Linear(hidden, hidden) units, AdamW, 2 ranks, each contender with and
without offload, rounds interleaved (every contender once per round, in a fresh process). Device-
resident bytes per rank are counted from the live device tensors between steps (every tensor the
garbage collector sees on the XLA device: parameters, gradients, optimizer state and anything
else); on gloo the "device" is the CPU, so only the step-time cost is compared there, against
PyTorch FSDP2's ``CPUOffloadPolicy`` (FSDP1's ``CPUOffload`` needs CUDA). ``+bf16``: master weights
kept in bf16 (``param_storage_dtype``). Writes benchmarks/results/offload.json and .md.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from .report import write_result

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORLD = 2
# PyTorch FSDP1's CPUOffload needs CUDA (on CPU it fails: "Found no NVIDIA driver"); FSDP2's
# CPUOffloadPolicy(pin_memory=False) runs on a CPU mesh, so it is the gloo reference.
CONTENDERS = ["xla_fsdp_xla", "xla_fsdp_xla+offload", "xla_fsdp_xla+offload+bf16", "xla_fsdp", "xla_fsdp+offload",
              "fsdp2", "fsdp2+offload"]


def _model(args):
    import torch
    import torch.nn as nn
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    return nn.Sequential(*layers)


def _wrap(name: str, model, transport: str):
    import torch
    import torch.nn as nn
    offload = "+offload" in name
    if name.startswith("fsdp1"):
        from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                        cpu_offload=CPUOffload(offload_params=offload), device_id=torch.device("cpu"),
                                        use_orig_params=False)
    if name.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh, offload_policy=policy)
        return fully_shard(model, mesh=mesh, offload_policy=policy)
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    from xla_fsdp.wrap import lambda_auto_wrap_policy
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear))
    storage = torch.bfloat16 if "+bf16" in name else None  # master weights kept in bf16, when asked
    return FSDP(model, auto_wrap_policy=policy, cpu_offload=offload, param_storage_dtype=storage, transport=transport)


def device_bytes(device) -> int:
    """Bytes of every live tensor on this rank's XLA device (parameters, gradients, optimizer
    state, anything else), counted once every rank has finished its steps."""
    import torch
    import torch_xla.core.xla_model as xm
    xm.rendezvous("offload benchmark: count")
    gc.collect()
    seen, kinds = set(), collections.Counter()
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device == device and id(obj) not in seen:
                seen.add(id(obj))
                # bytes from the sizes, which follow the device data (numel() can lag after an in-place
                # replace: a freed parameter's 1-element placeholder still reports its full numel)
                size = list(obj.size())
                kinds[f"{type(obj).__name__}{size} {obj.dtype}"] += math.prod(size) * obj.element_size()
        except Exception:  # objects that fail isinstance checks or device queries mid-collection
            continue
    xm.rendezvous("offload benchmark: counted")
    return sum(kinds.values()), dict(kinds)


def _train(rank: int, name: str, args, device, sync, out: str) -> None:
    import torch
    model = _wrap(name, _model(args).to(device), "xla" if device.type == "xla" else "torch")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.hidden, generator=g).to(device)
        start = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    del x
    on_device, kinds = device_bytes(device) if device.type == "xla" else (None, None)
    def local(t):  # FSDP2's DTensors: this rank's part
        return getattr(t, "_local_tensor", t)
    state = list(model.parameters()) + [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    host = sum(local(t).numel() * local(t).element_size() for t in state if t.device.type == "cpu")
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_times": times, "device_bytes": on_device, "device_tensors": kinds,
                       "host_state_bytes": host}, f)


def _gloo_rank(rank: int, name: str, args, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    _train(rank, name, args, torch.device("cpu"), lambda: None, out)
    dist.destroy_process_group()


def _xla_rank(index: int, name: str, args, out: str) -> None:
    import torch_xla
    import torch_xla.runtime as xr

    import xla_fsdp
    _train(xr.global_ordinal(), name, args, torch_xla.device(), xla_fsdp.sync, out)


def worker(name: str, args, out: str) -> None:
    if name.split("+")[0].endswith("_xla"):
        os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(WORLD))
        import xla_fsdp
        xla_fsdp.launch(_xla_rank, args=(name, args, out))
        return
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gloo_rank, args=(name, args, f"file://{tmp}/pg", out), nprocs=WORLD)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker_out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(HERE, "results", "offload"))
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args, args.worker_out)
        return
    names = args.contenders.split(",")
    runs = {n: [] for n in names}
    errors = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names:
                out = os.path.join(tmp, f"{name}-{r}.json")
                cmd = [sys.executable, "-m", "benchmarks.offload", "--worker", name, "--worker_out", out,
                       *[f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "layers", "hidden", "batch")]]
                env = dict(os.environ, OMP_NUM_THREADS="1")
                env.pop("PJRT_DEVICE", None)
                done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
                if done.returncode != 0 or not os.path.exists(out):
                    errors[name] = (done.stdout + done.stderr).strip().splitlines()[-1:]
                    continue
                runs[name].append(json.load(open(out)))
                print(f"round {r} {name}: median {statistics.median(runs[name][-1]['step_times']) * 1e3:.1f} ms",
                      flush=True)
    params = args.layers * (args.hidden * args.hidden + args.hidden)
    rows = []
    for name in names:
        if not runs[name]:
            rows.append({"contender": name, "error": errors.get(name)})
            continue
        times = [t for run in runs[name] for t in run["step_times"]]
        rows.append({"contender": name, "median_step_s": statistics.median(times), "step_times": times,
                     "device_bytes": runs[name][-1]["device_bytes"],
                     "device_tensors": runs[name][-1]["device_tensors"],
                     "host_state_bytes": runs[name][-1]["host_state_bytes"], "rounds": len(runs[name])})
    by = {row["contender"]: row for row in rows}
    for row in rows:
        base = by.get(row["contender"].split("+")[0])
        if "+" in row["contender"] and base and "median_step_s" in base and "median_step_s" in row:
            row["offload_step_ratio"] = row["median_step_s"] / base["median_step_s"]
    result = {"date": datetime.date.today().isoformat(), "world_size": WORLD, "params": params,
              "rounds": args.rounds, "steps_per_round": args.steps, "rows": rows}
    mib = 2 ** 20
    ideal = 4 * params * 4 / WORLD  # fp32 parameters + gradients + AdamW's two moments, sharded
    lines = [f"# Host offload ({result['date']}): {params / 1e6:.1f} M parameters ({args.layers} x Linear("
             f"{args.hidden}, {args.hidden})), AdamW, {WORLD} ranks, {args.rounds} interleaved rounds of "
             f"{args.steps} steps, medians", "",
             f"Sharded fp32 state without offload: {ideal / mib:.1f} MiB per rank (parameters, gradients, "
             "2 AdamW moments).", "",
             "| contender | median step | offload cost (x same without) | device-resident bytes per rank "
             "(live XLA tensors between steps; freed parameters keep a 1-element placeholder) "
             "| state on the host per rank |",
             "|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['contender']} | failed: {row['error']} | | | |")
            continue
        b = row["device_bytes"]
        dev = "n/a (CPU is the device)" if b is None else f"{b / mib:.2f} MiB" if b >= mib else f"{b} bytes"
        ratio = f"{row['offload_step_ratio']:.2f}x" if "offload_step_ratio" in row else ""
        lines.append(f"| {row['contender']} | {row['median_step_s'] * 1e3:.1f} ms | {ratio} | {dev} | "
                     f"{row['host_state_bytes'] / mib:.1f} MiB |")
    write_result(args.out, result, lines)


if __name__ == "__main__":
    main()
