"""Memory of resuming at another world size: a >= 1 GB checkpoint (parameters + AdamW)
saved for 4 ranks is loaded by 2 gloo ranks with ``load_sharded_checkpoint``, which reshards while
loading; each rank's resident memory is measured around the load.

    python -m benchmarks.load_memory [--hidden 4096] [--layers 6]

Per rank: the bytes of its own state (parameter shards + optimizer state), the largest original
tensor, and how far its resident memory rose during the load above the level before it (peak RSS
via /proc's VmHWM, reset just before the load; memory-mapped pages of the rank files that the
rank read count too). Writes benchmarks/results/load_memory.json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import xla_fsdp
from .report import write_result
from xla_fsdp.checkpoints import rank_path

HERE = os.path.dirname(os.path.abspath(__file__))


def _kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _model(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])


def _train_and_save(rank: int, world_size: int, init: str, args, prefix: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    model = xla_fsdp.XlaFullyShardedDataParallel(_model(args.hidden, args.layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, args.hidden)).sum().backward()
    opt.step()
    xla_fsdp.save_sharded_checkpoint(model, opt, prefix)
    dist.destroy_process_group()


def _load(rank: int, world_size: int, init: str, args, prefix: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    model = xla_fsdp.XlaFullyShardedDataParallel(_model(args.hidden, args.layers), flatten_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, args.hidden)).sum().backward()
    opt.step()  # the optimizer state exists, as in a run that resumes mid-training
    opt.zero_grad(set_to_none=True)
    own = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _kib("VmRSS")
    xla_fsdp.load_sharded_checkpoint(model, opt, prefix)
    peak = _kib("VmHWM")
    torch.save({"own_bytes": own, "rss_before_kib": before, "peak_kib": peak}, os.path.join(out, f"{rank}.pt"))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--save_ranks", type=int, default=4)
    p.add_argument("--load_ranks", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "results", "load_memory"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "ckpt")
        mp.spawn(_train_and_save, args=(args.save_ranks, f"file://{tmp}/pg_save", args, prefix),
                 nprocs=args.save_ranks)
        ckpt_bytes = sum(os.path.getsize(rank_path(prefix, r, args.save_ranks)) for r in range(args.save_ranks))
        mp.spawn(_load, args=(args.load_ranks, f"file://{tmp}/pg_load", args, prefix, tmp), nprocs=args.load_ranks)
        ranks = [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=True) for r in range(args.load_ranks)]
    largest = args.hidden * args.hidden * 4
    rows = []
    for r, m in enumerate(ranks):
        rise = (m["peak_kib"] - m["rss_before_kib"]) * 1024
        rows.append({"rank": r, "own_state_bytes": m["own_bytes"], "largest_tensor_bytes": largest,
                     "rss_rise_bytes": rise, "rise_over_own_plus_largest": rise / (m["own_bytes"] + largest)})
    result = {"date": datetime.date.today().isoformat(), "checkpoint_bytes": ckpt_bytes,
              "saved_world_size": args.save_ranks, "loaded_world_size": args.load_ranks, "ranks": rows}
    mib = 2 ** 20
    lines = [f"# Load-time resizing memory ({result['date']}): {ckpt_bytes / 2 ** 30:.2f} GiB checkpoint "
             f"(parameters + AdamW) saved by {args.save_ranks} ranks, loaded by {args.load_ranks} gloo ranks "
             "(flat units: another wrapping too)", "",
             "| rank | own state (shards + optimizer) | largest tensor | RSS rise during the load "
             "| rise / (own + largest) |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['rank']} | {row['own_state_bytes'] / mib:.0f} MiB | {largest / mib:.0f} MiB | "
                     f"{row['rss_rise_bytes'] / mib:.0f} MiB | {row['rise_over_own_plus_largest']:.2f} |")
    write_result(args.out, result, lines)


if __name__ == "__main__":
    main()
