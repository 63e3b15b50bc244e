"""Training step time while a >= 1 GB sharded checkpoint is saved: no save, a blocking save, and
``save_sharded_checkpoint(..., blocking=False)``, in one process, measured side by side.

    python -m benchmarks.async_save [--hidden 3072] [--layers 9] [--steps 12]

One gloo rank, torch with one compute thread (the writer thread gets the other core of this
2-core machine). Rounds interleave, for each of two archive writers (xla_fsdp's, whose zip CRC-32s
are computed by zlib outside the GIL, and torch's zip writer computing them itself, holding the GIL): a
few steps with no save, a blocking save (the training that stops for it), and an async save with
steps running meanwhile. Reports medians over the rounds: the step with no save, the blocking
save, the step during an async save and its ratio to the no-save step, the async save's duration
and the time its call blocks, and the process's resident memory at its peak during an async save
above the level just before it (the host copy of the shards). Writes
benchmarks/results/async_save.json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import xla_fsdp
from .report import write_result
from xla_fsdp.checkpoints import rank_writer

HERE = os.path.dirname(os.path.abspath(__file__))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


class PeakRss:
    """Samples the resident set every 5 ms in a thread while active."""

    def __init__(self):
        self.peak, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_mib())
            time.sleep(0.005)

    def __enter__(self):
        self.peak = _rss_mib()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


WRITERS = {"xla_fsdp": "zip CRC-32 by zlib, outside the GIL", "torch": "zip CRC-32 by torch, holding the GIL"}


def _use_writer(name: str, original=rank_writer.PthStreamWriter) -> None:
    """torch's zip writer computing the CRC-32s itself is what xla_fsdp's falls back to: select it so."""
    rank_writer.PthStreamWriter = original if name == "xla_fsdp" else functools.partial(original,
                                                                                         crc_outside_gil=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4, help="rounds per writer, interleaved")
    p.add_argument("--steps", type=int, default=3, help="steps with no save per round")
    p.add_argument("--out", default=os.path.join(HERE, "results", "async_save"))
    args = p.parse_args()
    torch.set_num_threads(1)
    runs = {w: {"no_save": [], "blocking": [], "during": [], "async_s": [], "call_s": [], "rss_rise": []}
            for w in WRITERS}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        torch.manual_seed(0)
        model = xla_fsdp.XlaFullyShardedDataParallel(
            nn.Sequential(*[nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(args.batch, args.hidden)

        def step() -> float:
            start = time.perf_counter()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - start

        for _ in range(3):
            step()
        start = time.perf_counter()
        warm = xla_fsdp.save_sharded_checkpoint(model, opt, os.path.join(tmp, "warm"), blocking=False)
        first_call_s = time.perf_counter() - start
        ckpt_bytes = os.path.getsize(warm.wait())  # the first async save allocates the host buffers later ones reuse
        for _ in range(args.rounds):
            for writer, r in runs.items():
                _use_writer(writer)
                r["no_save"] += [step() for _ in range(args.steps)]
                start = time.perf_counter()
                xla_fsdp.save_sharded_checkpoint(model, opt, os.path.join(tmp, "blocking"))
                r["blocking"].append(time.perf_counter() - start)
                step()
                before = _rss_mib()
                with PeakRss() as rss:
                    start = time.perf_counter()
                    pending = xla_fsdp.save_sharded_checkpoint(model, opt, os.path.join(tmp, "async"), blocking=False)
                    r["call_s"].append(time.perf_counter() - start)
                    while not pending.done():
                        r["during"].append(step())
                    pending.wait()
                    r["async_s"].append(time.perf_counter() - start)
                r["rss_rise"].append(rss.peak - before)
        _use_writer("xla_fsdp")
        dist.destroy_process_group()
    med = statistics.median
    result = {"date": datetime.date.today().isoformat(), "checkpoint_bytes": ckpt_bytes,
              "params": sum(p.numel() for p in model.parameters()), "rounds": args.rounds,
              "first_async_call_s": first_call_s, "writers": {}}
    for writer, r in runs.items():
        base = med(r["no_save"])
        result["writers"][writer] = {
            "median_step_s_no_save": base, "median_blocking_save_s": med(r["blocking"]),
            "median_async_call_s": med(r["call_s"]), "median_async_save_s": med(r["async_s"]),
            "steps_during_async_saves": len(r["during"]), "median_step_s_during_async_save": med(r["during"]),
            "ratio_during_async_to_no_save": med(r["during"]) / base, "max_rss_rise_mib": max(r["rss_rise"]),
            "samples": r}
    gib = ckpt_bytes / 2 ** 30
    lines = [
        f"# Async save ({result['date']}): {gib:.2f} GiB checkpoint, {result['params'] / 1e6:.1f} M parameters "
        "+ AdamW, 1 gloo rank, 1 compute thread, this 2-core machine",
        "",
        f"Medians over {args.rounds} interleaved rounds per writer. The first async save allocates the host "
        f"buffers later saves reuse: its call blocked {first_call_s:.2f} s.",
        "",
        "| writer | step, no save | blocking save | async call blocks | async save lasts | step during async save "
        "| ratio | peak RSS rise (async) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for writer, w in result["writers"].items():
        lines.append(
            f"| {writer} ({WRITERS[writer]}) | {w['median_step_s_no_save'] * 1e3:.0f} ms "
            f"| {w['median_blocking_save_s']:.2f} s | {w['median_async_call_s']:.2f} s "
            f"| {w['median_async_save_s']:.2f} s | {w['median_step_s_during_async_save'] * 1e3:.0f} ms "
            f"({w['steps_during_async_saves']} steps) | {w['ratio_during_async_to_no_save']:.2f}x "
            f"| +{w['max_rss_rise_mib']:.0f} MiB |")
    write_result(args.out, result, lines)


if __name__ == "__main__":
    main()
