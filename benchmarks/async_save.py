"""Training step time while a >= 1 GB sharded checkpoint is saved: no save, a blocking save, and
``save_sharded_checkpoint(..., blocking=False)`` (issue 25), in one process, measured side by side.

    python -m benchmarks.async_save [--hidden 3072] [--layers 9] [--steps 12]

One gloo rank, torch with one compute thread (the writer thread gets the other core of this
2-core machine). Reports the median step time with no save, the wall time of a blocking save (the
training that stops for it), the median step time while an async save runs and its ratio to the
no-save median, the async save's duration, and the process's resident memory: its peak during the
async save above the level just before it (the host copy of the shards). Writes
benchmarks/results/async_save.json and .md.
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

import torch
import torch.distributed as dist
import torch.nn as nn

import xla_fsdp

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=12, help="steps measured with no save")
    p.add_argument("--out", default=os.path.join(HERE, "results", "async_save"))
    args = p.parse_args()
    torch.set_num_threads(1)
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
        no_save = [step() for _ in range(args.steps)]
        start = time.perf_counter()
        path = xla_fsdp.save_sharded_checkpoint(model, opt, os.path.join(tmp, "blocking"))
        blocking_s = time.perf_counter() - start
        ckpt_bytes = os.path.getsize(path)
        os.unlink(path)
        start = time.perf_counter()
        warm = xla_fsdp.save_sharded_checkpoint(model, opt, os.path.join(tmp, "warm"), blocking=False)
        first_call_s = time.perf_counter() - start
        os.unlink(warm.wait())  # the first async save allocates the host buffers that later saves reuse
        step()
        before = _rss_mib()
        during = []
        with PeakRss() as rss:
            start = time.perf_counter()
            pending = xla_fsdp.save_sharded_checkpoint(model, opt, os.path.join(tmp, "async"), blocking=False)
            call_s = time.perf_counter() - start
            while not pending.done():
                during.append(step())
            pending.wait()
            async_s = time.perf_counter() - start
        after = [step() for _ in range(args.steps)]
        dist.destroy_process_group()
    base = statistics.median(no_save + after)
    result = {
        "date": datetime.date.today().isoformat(),
        "checkpoint_bytes": ckpt_bytes,
        "params": sum(p.numel() for p in model.parameters()),
        "median_step_s_no_save": base,
        "blocking_save_s": blocking_s,
        "blocking_save_in_steps": blocking_s / base,
        "first_async_call_s": first_call_s,
        "async_call_s": call_s,
        "async_save_s": async_s,
        "steps_during_async_save": len(during),
        "median_step_s_during_async_save": statistics.median(during) if during else None,
        "ratio_during_async_to_no_save": statistics.median(during) / base if during else None,
        "rss_mib_before_async_save": before,
        "peak_rss_mib_during_async_save": rss.peak,
        "host_copy_mib": rss.peak - before,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    gib = ckpt_bytes / 2 ** 30
    lines = [
        f"# Async save ({result['date']}): {gib:.2f} GiB checkpoint, {result['params'] / 1e6:.1f} M parameters "
        "+ AdamW, 1 gloo rank, 1 compute thread, this 2-core machine",
        "",
        "| measure | value |",
        "|---|---|",
        f"| median step, no save | {base * 1e3:.0f} ms |",
        f"| blocking save (training stopped) | {blocking_s:.2f} s = {blocking_s / base:.1f} steps |",
        f"| async: time the call blocks training (copy into the host buffers) | {call_s:.2f} s "
        f"(the first async save, which allocates them: {first_call_s:.2f} s) |",
        f"| async: save duration in the background | {async_s:.2f} s ({len(during)} steps ran meanwhile) |",
        "| median step during the async save | "
        + (f"{result['median_step_s_during_async_save'] * 1e3:.0f} ms = "
           f"{result['ratio_during_async_to_no_save']:.2f}x no save |" if during else "- |"),
        f"| resident memory before / peak during the async save | {before:.0f} / {rss.peak:.0f} MiB "
        f"(+{rss.peak - before:.0f} MiB: the host copy) |",
    ]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
