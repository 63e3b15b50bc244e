"""Peak memory of consolidating a >= 1 GB sharded checkpoint: xla_fsdp's streaming CLI against
torch_xla's own consolidate_sharded_model_checkpoints (which loads every rank file at once).

    python -m benchmarks.consolidation_memory [--total_mb 1200] [--world_size 4] [--tensor_mb 50]

Writes benchmarks/results/consolidation.json and .md (the date is inside). Each contender runs in its own
process; peak RSS is that process's ru_maxrss, and the baseline is the RSS of the same process
right after importing torch (reported separately, so the figures above it are the algorithm's).
Peak is the process's VmHWM (reset at exec, unlike ru_maxrss which a child inherits).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from xla_fsdp.checkpoints.files import rank_path
from xla_fsdp.checkpoints.rank_writer import RankFileWriter
from xla_fsdp.sharding import FlatLayout, flatten_and_pad, shard_of

HERE = os.path.dirname(os.path.abspath(__file__))

_MEM = r"""
def _kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
"""

NAIVE = _MEM + r"""
import sys, torch
from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints
base = _kib("VmRSS")
consolidate_sharded_model_checkpoints(sys.argv[1], ckpt_suffix="_rank-*.pth", save_path=sys.argv[1] + "_naive.pth")
print(base, _kib("VmHWM"))
"""

STREAM = _MEM + r"""
import sys, torch
from xla_fsdp.consolidate_sharded_ckpts import main
base = _kib("VmRSS")
assert main(["--ckpt_prefix", sys.argv[1], "--save_path", sys.argv[1] + "_stream.pth"]) == 0
print(base, _kib("VmHWM"))
"""


def make_checkpoint(directory: str, total_mb: int, world_size: int, tensor_mb: int) -> dict:
    """Rank files of a synthetic model (``total_mb`` of fp32 tensors, one tensor per unit)."""
    n_tensors = max(1, total_mb // tensor_mb)
    numel = tensor_mb * 1024 * 1024 // 4
    prefix = os.path.join(directory, "big")
    g = torch.Generator().manual_seed(0)
    tensors = {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n_tensors)}
    for rank in range(world_size):
        model, layout, shard_info = {}, {}, {}
        for name, t in tensors.items():
            lay = FlatLayout(((numel,),), world_size, 1)
            key = f"_fsdp_shard_FSDP_SHARD_SEPARATOR_{name.replace('.', '_')}"
            model[key] = shard_of(flatten_and_pad([t], lay), rank, world_size).clone()
            layout[key] = {"mode": "param", "names": [name], "shapes": [[numel]], "aliases": {},
                           "padded_numel": lay.padded_numel, "shard_shape": [lay.shard_numel], "requires_grad": True}
            shard_info[key] = {"_orig_name": name, "_orig_size": [numel]}  # what torch_xla's reader needs
        md = {
            "shard_info": {"": shard_info},
            "flatten_info": {},
            "buffer_info": {},
            "world_size": world_size,
            "rank": rank,
            "version": 1,
            "layout": layout,
            "shard_size_multiple": 1,
            "run_id": "bench",
        }
        writer = RankFileWriter(rank_path(prefix, rank, world_size))  # the package's rank-file writer
        for key, value in model.items():
            writer.add_model(key, value)
        writer.write(md)
        writer.commit()
    files = [rank_path(prefix, r, world_size) for r in range(world_size)]
    return {"prefix": prefix, "total_bytes": sum(os.path.getsize(f) for f in files),
            "largest_shard_file": max(os.path.getsize(f) for f in files), "largest_tensor": numel * 4,
            "tensors": n_tensors}


def run(script: str, prefix: str) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script, prefix], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(HERE), "PJRT_DEVICE": "CPU"})
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    base, peak = map(int, proc.stdout.strip().splitlines()[-1].split())
    return {"seconds": time.perf_counter() - start, "baseline_kib": base, "children_peak_kib": peak}


def measure(total_mb: int = 1200, world_size: int = 4, tensor_mb: int = 50) -> dict:
    """Both contenders on one synthetic checkpoint; seconds and peak RSS of each."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as d:
        info = make_checkpoint(d, total_mb, world_size, tensor_mb)
        stream = run(STREAM, info["prefix"])
        naive = run(NAIVE, info["prefix"])
        a = torch.load(info["prefix"] + "_stream.pth", mmap=True, weights_only=True)["model"]
        b = torch.load(info["prefix"] + "_naive.pth", mmap=True, weights_only=True)["model"]
        assert all(torch.equal(a[k], b[k][: a[k].numel()]) for k in a)
    mib = 1024 * 1024
    bound = info["largest_shard_file"] + 2 * info["largest_tensor"]
    rows = {
        "xla_fsdp streaming CLI": {
            "seconds": stream["seconds"],
            "peak_rss_mib": stream["children_peak_kib"] / 1024,
            "above_baseline_mib": (stream["children_peak_kib"] - stream["baseline_kib"]) / 1024,
        },
        "torch_xla consolidate_sharded_model_checkpoints": {
            "seconds": naive["seconds"],
            "peak_rss_mib": naive["children_peak_kib"] / 1024,
            "above_baseline_mib": (naive["children_peak_kib"] - naive["baseline_kib"]) / 1024,
        },
    }
    return {"date": datetime.date.today().isoformat(), "checkpoint_total_mib": info["total_bytes"] / mib,
            "world_size": world_size, "tensors": info["tensors"],
            "largest_shard_file_mib": info["largest_shard_file"] / mib,
            "largest_tensor_mib": info["largest_tensor"] / mib, "bound_mib": bound / mib,
            "torch_import_baseline_mib": stream["baseline_kib"] / 1024, "contenders": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--total_mb", type=int, default=1200)
    p.add_argument("--world_size", type=int, default=4)
    p.add_argument("--tensor_mb", type=int, default=50)
    p.add_argument("--out_dir", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    result = measure(args.total_mb, args.world_size, args.tensor_mb)
    rows = result["contenders"]
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, "consolidation")  # the current result; older ones in git history
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"# Consolidation memory ({result['date']})", "",
             f"Checkpoint: {result['checkpoint_total_mib']:.0f} MiB in {args.world_size} rank files, "
             f"{result['tensors']} tensors of {result['largest_tensor_mib']:.0f} MiB. Bound (largest shard file + 2 x "
             f"largest tensor): {result['bound_mib']:.0f} MiB. Baseline RSS after `import torch`: "
             f"{result['torch_import_baseline_mib']:.0f} MiB.", "",
             "| contender | seconds | peak RSS MiB | above baseline MiB | within bound |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['seconds']:.1f} | {r['peak_rss_mib']:.0f} | {r['above_baseline_mib']:.0f} | "
                     f"{'yes' if r['above_baseline_mib'] <= result['bound_mib'] else 'no'} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
