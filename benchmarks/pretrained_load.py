"""Pretrained weights in at size (issue 67): a model of >= 1 B parameters saved as sharded safetensors (as
``save_pretrained`` writes them) is loaded at world size 4 on gloo, three ways side by side in one run:

- ``xla_fsdp``: the model built on the meta device, wrapped (one unit per layer), ``load_pretrained``:
  each rank reads only the rows of its own shards;
- ``full_copy``: today's way: every rank builds the whole model on the host, loads the files into it
  (``load_state_dict`` file by file, as ``from_pretrained`` reads a sharded folder), then wraps it;
- ``fsdp2_broadcast``: PyTorch's FSDP2: ``fully_shard`` on the meta device, ``to_empty``, and
  ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)`` with rank 0 holding the
  full state dict (read file by file);

and a plain sequential read of the same files in one process, the bound on time. Per rank: the peak
resident memory added (VmHWM reset after the imports, minus the resident memory then) and the wall time
of building plus loading; the slowest rank's time and the largest rank's memory are the figures.

    python -m benchmarks.pretrained_load [--hidden 4096] [--layers 64] [--dtype bfloat16]

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
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from .report import write_result

HERE = os.path.dirname(os.path.abspath(__file__))
WAYS = ("xla_fsdp", "full_copy", "fsdp2_broadcast")


def _kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


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
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the resident memory now
    before = _kib("VmRSS")
    start = time.perf_counter()
    if way == "xla_fsdp":
        with torch.device("meta"):
            model = _model(args.hidden, args.layers, dtype)
        model = xla_fsdp.XlaFullyShardedDataParallel(
            model, auto_wrap_policy=lambda module, recurse, **kw: recurse or isinstance(module, nn.Linear),
            param_init_fn=lambda m: m.to_empty(device="cpu", recurse=False), **_storage(dtype))
        loading = time.perf_counter()
        xla_fsdp.load_pretrained(model, folder)
    elif way == "full_copy":  # the whole model's storage (no init: from_pretrained skips it too), then every file
        with torch.device("meta"):
            model = _model(args.hidden, args.layers, dtype)
        model.to_empty(device="cpu")
        loading = time.perf_counter()
        for path in _files(folder):
            model.load_state_dict(safetensors.torch.load_file(path), strict=False)
        model = xla_fsdp.XlaFullyShardedDataParallel(
            model, auto_wrap_policy=lambda module, recurse, **kw: recurse or isinstance(module, nn.Linear),
            **_storage(dtype))
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
    own = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
              for p in model.parameters())
    probe = next(iter(model.parameters()))
    torch.save({"seconds": seconds, "load_seconds": loaded, "rise_bytes": (peak - before) * 1024, "own_bytes": own,
                "probe": float((probe.to_local() if hasattr(probe, "to_local") else probe).detach().float().sum())},
               os.path.join(out, f"{way}-{rank}.pt"))
    dist.destroy_process_group()


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
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    params = args.hidden * args.hidden * args.layers
    largest = args.hidden * args.hidden * dtype.itemsize
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "pretrained")
        os.makedirs(folder)
        model_bytes = _save(folder, args.hidden, args.layers, dtype, per_file=max(1, args.layers // 8))
        runs: Dict[str, List[Dict[str, Any]]] = {w: [] for w in WAYS}
        plain: List[float] = []
        for r in range(args.rounds):
            order = WAYS if r % 2 == 0 else WAYS[::-1]
            plain.append(_plain_read(folder))
            for way in order:
                out = os.path.join(tmp, f"out-{way}-{r}")
                os.makedirs(out)
                mp.spawn(_rank, args=(args.world_size, f"file://{out}/pg", way, args, folder, out),
                         nprocs=args.world_size)
                ranks = [torch.load(os.path.join(out, f"{way}-{k}.pt"), weights_only=True)
                         for k in range(args.world_size)]
                runs[way].append({"seconds": max(x["seconds"] for x in ranks),
                                  "load_seconds": max(x["load_seconds"] for x in ranks),
                                  "rise_bytes": max(x["rise_bytes"] for x in ranks),
                                  "own_bytes": max(x["own_bytes"] for x in ranks)})
    bound = 1.25 * model_bytes / args.world_size + largest
    plain_s = statistics.median(plain)
    rows = []
    for way in WAYS:
        seconds = statistics.median(x["seconds"] for x in runs[way])
        load_s = statistics.median(x["load_seconds"] for x in runs[way])
        rise = statistics.median(x["rise_bytes"] for x in runs[way])
        rows.append({"way": way, "seconds": seconds, "over_plain_read": seconds / plain_s, "load_seconds": load_s,
                     "load_over_plain_read": load_s / plain_s, "rise_bytes": rise,
                     "rise_over_bound": rise / bound, "rounds": runs[way]})
    result = {"date": datetime.date.today().isoformat(), "parameters": params, "dtype": args.dtype,
              "model_bytes": model_bytes, "world_size": args.world_size, "largest_tensor_bytes": largest,
              "memory_bound_bytes": bound, "plain_read_seconds": plain_s, "plain_reads": plain, "ways": rows}
    gib = 2 ** 30
    lines = [f"# Pretrained weights in ({result['date']}): {params / 1e9:.2f} B parameters ({args.dtype}, "
             f"{model_bytes / gib:.2f} GiB in {len(_files_count(args))} safetensors files), {args.world_size} gloo "
             "ranks", "",
             f"Plain sequential read of the files, one process: {plain_s:.1f} s. Memory bound per rank: 1.25 x "
             f"model / world size + largest tensor = {bound / gib:.2f} GiB.", "",
             "| way | build + load (slowest rank) | / plain read | the load alone | / plain read "
             "| peak RSS added (largest rank) | / bound |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['way']} | {row['seconds']:.1f} s | {row['over_plain_read']:.2f} | "
                     f"{row['load_seconds']:.1f} s | {row['load_over_plain_read']:.2f} | "
                     f"{row['rise_bytes'] / gib:.2f} GiB | {row['rise_over_bound']:.2f} |")
    lines += ["", f"Medians of {args.rounds} rounds (the ways in reversed order every other round); the files are "
              "in the page cache for every way alike (written just before)."]
    write_result(args.out, result, lines)


def _files_count(args) -> range:
    return range(0, args.layers, max(1, args.layers // 8))


if __name__ == "__main__":
    main()
