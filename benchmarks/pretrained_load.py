"""Pretrained weights in at size: a model of >= 1 B parameters saved as sharded safetensors (as
``save_pretrained`` writes them) is loaded at world size 4 on gloo, three ways, and on 4 XLA:CPU devices
(threads of one process), two ways, side by side in one run:

- ``xla_fsdp``: the model built on the meta device, wrapped (one unit per layer), ``load_pretrained``:
  each rank reads only the rows of its own shards;
- ``full_copy``: today's way: every rank builds the whole model on the host, loads the files into it
  (``load_state_dict`` file by file, as ``from_pretrained`` reads a sharded folder), then wraps it;
- ``fsdp2_broadcast``: PyTorch's FSDP2: ``fully_shard`` on the meta device, ``to_empty``, and
  ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`` with rank 0 holding the
  full state dict (read file by file);

and a plain sequential read of the same files in one process, the bound on time. Per rank: the peak
resident memory added (VmHWM reset after the imports, minus the resident memory then; what torch imports
on its first meta-device module counts as an import) and the wall time
of building plus loading; the slowest rank's time and the largest rank's memory are the figures. On XLA:CPU
the 4 ranks share one process (and the device buffers are host memory): its rise divided by 4 is the
per-rank figure. Every way must end with the same values (a checksum of each rank's first shard).

    python -m benchmarks.pretrained_load [--hidden 4096] [--layers 64] [--dtype bfloat16]

Run it with the torch_xla environment's python (``.venv``); ``--no_xla`` leaves the XLA:CPU ways out.

Writes benchmarks/results/pretrained_load.json and .md. Target: added memory per rank at most
1.25 x (model bytes / world size) + the largest tensor; time at most 1.5 x the plain read.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import threading
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from .report import write_result

HERE = os.path.dirname(os.path.abspath(__file__))
GLOO_WAYS = ("xla_fsdp", "full_copy", "fsdp2_broadcast")
XLA_WAYS = ("xla_fsdp_on_xla", "full_copy_on_xla")


def _kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _warm_up() -> None:
    """What torch imports on the first module built on the meta device (sympy: 0.8 s on torch 2.9), before
    the clock starts for every way alike: a program pays it once, whatever it loads."""
    with torch.device("meta"):
        nn.Linear(2, 2)


def _model(hidden: int, layers: int, dtype: torch.dtype) -> nn.Module:
    return nn.Sequential(*[nn.Linear(hidden, hidden, bias=False, dtype=dtype) for _ in range(layers)])


def _save(folder: str, hidden: int, layers: int, dtype: torch.dtype, per_file: int) -> int:
    """Random weights in files of ``per_file`` layers and their index, one tensor in memory at a time."""
    from safetensors.torch import save_file
    weight_map, total = {}, 0
    files = [list(range(i, min(layers, i + per_file))) for i in range(0, layers, per_file)]
    g = torch.Generator().manual_seed(0)
    for n, members in enumerate(files):
        name = f"model-{n + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = {f"{i}.weight": (torch.rand(hidden, hidden, generator=g) - 0.5).to(dtype) for i in members}
        save_file(tensors, os.path.join(folder, name))
        weight_map.update({k: name for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def _files(folder: str) -> List[str]:
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        return [os.path.join(folder, n) for n in sorted(set(json.load(f)["weight_map"].values()))]


def _rank(rank: int, world_size: int, init: str, way: str, args, folder: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    import safetensors.torch

    import xla_fsdp
    dtype = getattr(torch, args.dtype)
    _warm_up()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the resident memory now
    before = _kib("VmRSS")
    start = time.perf_counter()
    if way == "xla_fsdp":
        model, loading = _sharded_load(args, dtype, folder)
    elif way == "full_copy":
        model, loading = _host_copy(args, dtype, folder)
        model = xla_fsdp.XlaFullyShardedDataParallel(model, **_wrapping(dtype))
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import fully_shard
        with torch.device("meta"):
            model = _model(args.hidden, args.layers, dtype)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        loading = time.perf_counter()
        full: Dict[str, torch.Tensor] = {}
        if rank == 0:
            for path in _files(folder):
                full.update(safetensors.torch.load_file(path))
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full
    loaded = time.perf_counter() - loading  # the load itself (xla_fsdp, FSDP2: after sharding on meta)
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = _kib("VmHWM")
    torch.save(dict(_owned(model), seconds=seconds, load_seconds=loaded, rise_bytes=(peak - before) * 1024),
               os.path.join(out, f"{way}-{rank}.pt"))
    dist.destroy_process_group()


def _owned(model: nn.Module) -> Dict[str, Any]:
    """This rank's parameter bytes and a checksum of its first shard (every way must load the same)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return {"own_bytes": sum(t.numel() * t.element_size() for t in local),
            "probe": float(local[0].detach().cpu().float().sum())}


# The XLA:CPU ways' device threads (in the process torch_xla.launch starts) meet on the host and share results.
_MEET = threading.Barrier(int(os.environ.get("CPU_NUM_DEVICES", "1")))
_SHARED: Dict[str, Any] = {"ranks": {}}


def _xla_main(way: str, args, folder: str, out: str) -> None:
    import xla_fsdp
    xla_fsdp.launch(_xla_rank, args=(way, args, folder, out))


def _xla_rank(index: int, way: str, args, folder: str, out: str) -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    import xla_fsdp
    rank, dtype = xr.global_ordinal(), getattr(torch, args.dtype)
    torch.set_num_threads(1)
    _warm_up()
    meet, shared = _MEET, _SHARED
    meet.wait()
    if rank == 0:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        shared["before"] = _kib("VmRSS")
    meet.wait()
    start = time.perf_counter()
    if way == "xla_fsdp_on_xla":
        model, loading = _sharded_load(args, dtype, folder)
    else:  # every rank thread: the whole model on the host, every file, then wrap (the shards go to the device)
        model, loading = _host_copy(args, dtype, folder)
        model = xla_fsdp.XlaFullyShardedDataParallel(model, **_wrapping(dtype))
    torch_xla.sync()
    xm.wait_device_ops()
    loaded = time.perf_counter() - loading
    meet.wait()
    seconds = time.perf_counter() - start
    if rank == 0:
        shared["rise_bytes"] = (_kib("VmHWM") - shared["before"]) * 1024
    shared["ranks"][rank] = dict(_owned(model), seconds=seconds, load_seconds=loaded)
    meet.wait()
    if rank == 0:
        rise = shared["rise_bytes"] / args.world_size
        torch.save([dict(shared["ranks"][r], rise_bytes=rise) for r in range(args.world_size)],
                   os.path.join(out, f"{way}.pt"))


def _sharded_load(args, dtype: torch.dtype, folder: str) -> Tuple[nn.Module, float]:
    """xla_fsdp's way: the model on the meta device, wrapped with storage only, then each rank's rows."""
    import xla_fsdp
    with torch.device("meta"):
        model = _model(args.hidden, args.layers, dtype)
    model = xla_fsdp.XlaFullyShardedDataParallel(model, param_init_fn=xla_fsdp.storage_only, **_wrapping(dtype))
    loading = time.perf_counter()
    xla_fsdp.load_pretrained(model, folder)
    return model, loading


def _host_copy(args, dtype: torch.dtype, folder: str) -> Tuple[nn.Module, float]:
    """Today's way: the whole model's storage on the host (no init: from_pretrained skips it too), then
    every file into it; returns the model and when the loading began."""
    import safetensors.torch
    with torch.device("meta"):
        model = _model(args.hidden, args.layers, dtype)
    model.to_empty(device="cpu")
    loading = time.perf_counter()
    for path in _files(folder):
        model.load_state_dict(safetensors.torch.load_file(path), strict=False)
    return model, loading


def _wrapping(dtype: torch.dtype) -> Dict[str, Any]:
    """One unit per layer, parameters kept in the files' dtype."""
    return {"auto_wrap_policy": lambda module, recurse, **kw: recurse or isinstance(module, nn.Linear),
            **_storage(dtype)}


def _storage(dtype: torch.dtype) -> Dict[str, Any]:
    """Parameters kept in the files' dtype (bf16 master parameters: the wrapper's param_storage_dtype)."""
    return {} if dtype == torch.float32 else {"param_storage_dtype": dtype}


def _plain_read(folder: str) -> float:
    from safetensors import safe_open
    start = time.perf_counter()
    for path in _files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                f.get_tensor(name).clone()  # get_tensor maps the file lazily: the copy reads every page
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--world_size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=os.path.join(HERE, "results", "pretrained_load"))
    p.add_argument("--no_xla", action="store_true", help="leave out the XLA:CPU ways (no torch_xla needed)")
    p.add_argument("--xla_way", default=None, help=argparse.SUPPRESS)  # this process runs one XLA:CPU way
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.xla_way:
        return _xla_main(args.xla_way, args, args.folder, args.out)
    ways = GLOO_WAYS if args.no_xla else GLOO_WAYS + XLA_WAYS
    dtype = getattr(torch, args.dtype)
    params = args.hidden * args.hidden * args.layers
    largest = args.hidden * args.hidden * dtype.itemsize
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "pretrained")
        os.makedirs(folder)
        model_bytes = _save(folder, args.hidden, args.layers, dtype, per_file=max(1, args.layers // 8))
        runs: Dict[str, List[Dict[str, Any]]] = {w: [] for w in ways}
        plain: List[float] = []
        probes = set()
        for r in range(args.rounds):
            order = ways if r % 2 == 0 else ways[::-1]
            plain.append(_plain_read(folder))
            for way in order:
                out = os.path.join(tmp, f"out-{way}-{r}")
                os.makedirs(out)
                if way in XLA_WAYS:
                    _run_xla(way, args, folder, out)
                    ranks = torch.load(os.path.join(out, f"{way}.pt"), weights_only=True)
                else:
                    mp.spawn(_rank, args=(args.world_size, f"file://{out}/pg", way, args, folder, out),
                             nprocs=args.world_size)
                    ranks = [torch.load(os.path.join(out, f"{way}-{k}.pt"), weights_only=True)
                             for k in range(args.world_size)]
                probes.add(tuple(x["probe"] for x in ranks))
                runs[way].append({"seconds": max(x["seconds"] for x in ranks),
                                  "load_seconds": max(x["load_seconds"] for x in ranks),
                                  "rise_bytes": max(x["rise_bytes"] for x in ranks),
                                  "own_bytes": max(x["own_bytes"] for x in ranks)})
    if len(probes) != 1:
        raise SystemExit(f"the ways loaded different values (first-shard checksums per rank): {probes}")
    bound = 1.25 * model_bytes / args.world_size + largest
    plain_s = statistics.median(plain)
    rows = []
    for way in ways:
        seconds = statistics.median(x["seconds"] for x in runs[way])
        load_s = statistics.median(x["load_seconds"] for x in runs[way])
        rise = statistics.median(x["rise_bytes"] for x in runs[way])
        rows.append({"way": way, "seconds": seconds, "over_plain_read": seconds / plain_s, "load_seconds": load_s,
                     "load_over_plain_read": load_s / plain_s, "rise_bytes": rise,
                     "rise_over_bound": rise / bound, "transport": "xla" if way in XLA_WAYS else "gloo",
                     "rounds": runs[way]})
    result = {"date": datetime.date.today().isoformat(), "parameters": params, "dtype": args.dtype,
              "model_bytes": model_bytes, "world_size": args.world_size, "largest_tensor_bytes": largest,
              "memory_bound_bytes": bound, "plain_read_seconds": plain_s, "plain_reads": plain, "ways": rows}
    gib = 2 ** 30
    lines = [f"# Pretrained weights in ({result['date']}): {params / 1e9:.2f} B parameters ({args.dtype}, "
             f"{model_bytes / gib:.2f} GiB in {len(_files_count(args))} safetensors files), world size "
             f"{args.world_size}: gloo ranks (processes) and XLA:CPU devices (threads of one process)", "",
             f"Plain sequential read of the files, one process: {plain_s:.1f} s. Memory bound per rank: 1.25 x "
             f"model / world size + largest tensor = {bound / gib:.2f} GiB.", "",
             "| way | transport | build + load (slowest rank) | / plain read | the load alone | / plain read "
             "| peak RSS added per rank | / bound |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['way']} | {row['transport']} | {row['seconds']:.1f} s | {row['over_plain_read']:.2f} | "
                     f"{row['load_seconds']:.1f} s | {row['load_over_plain_read']:.2f} | "
                     f"{row['rise_bytes'] / gib:.2f} GiB | {row['rise_over_bound']:.2f} |")
    lines += ["", f"Medians of {args.rounds} rounds (the ways in reversed order every other round); the files are "
              "in the page cache for every way alike (written just before). Per rank: on gloo the largest rank's "
              "rise; on XLA:CPU the process's rise / world size (its device buffers are host memory).",
              "Every way loaded the same values (first-shard checksums per rank)."]
    write_result(args.out, result, lines)


def _run_xla(way: str, args, folder: str, out: str) -> None:
    """One XLA:CPU way in its own process (a PJRT client per process), its device threads the ranks."""
    import subprocess
    import sys
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(args.world_size))
    cmd = [sys.executable, "-m", "benchmarks.pretrained_load", "--xla_way", way, "--folder", folder, "--out", out,
           "--hidden", str(args.hidden), "--layers", str(args.layers), "--dtype", args.dtype,
           "--world_size", str(args.world_size)]
    subprocess.run(cmd, env=env, check=True, cwd=os.path.dirname(HERE))


def _files_count(args) -> range:
    return range(0, args.layers, max(1, args.layers // 8))


if __name__ == "__main__":
    main()
