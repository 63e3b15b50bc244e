"""Host time per step on XLA: the CPU time spent tracing one training step (forward, backward,
optimizer step: the Python and IR work a TPU waits on when the device is fast, pytorch/xla#5280),
from the step's start to its sync. On XLA autograd runs backward in a thread of its own for the
device, so a step's host time is the rank thread's CPU time plus that thread's during backward
(``measure.BackwardThreadTime``); the backward part is also shown on its own.

    python -m benchmarks.host_time [--world_size 2] [--rounds 3] [--workload transformer] [--quick]

Contenders: xla_fsdp's wrapper (its default per-parameter layout), xla_fsdp's ``fully_shard``,
torch_xla's XlaFSDP (per-parameter) at ``--world_size`` XLA:CPU devices, and the unwrapped model at
one device. Each run is a fresh process (``benchmarks.worker``); the contenders of a round run back to
back, their order reversed every other round. A run's figure is the median over its measured steps of
the slowest rank thread's host time; the pooled figure is the median of the rounds'. Ratios are taken
per round (same round, side by side) and pooled as their median. Writes
benchmarks/results/host_time.json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
from typing import Any, Dict, List, Optional

from .report import write_result
from .run import run_one
from .workloads import FULL, QUICK

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = "torchxla_fsdp_perparam"
OURS = ("xla_fsdp_xla_perparam", "xla_fsdp_fully_shard")
PLAIN = "xla_plain"


def host_seconds(run: Dict[str, Any], key: str = "host_times") -> Optional[float]:
    """Median over measured steps of the slowest rank's host time (``key``: or its backward part);
    None for a failed run. A step whose backward thread could not be timed on some rank is left out."""
    if run["error"] or not run["ranks"]:
        return None
    per_step = [max(steps) for steps in zip(*(r.get(key, r["host_times"]) for r in run["ranks"]))
                if None not in steps]
    return statistics.median(per_step) if per_step else None


def measure(world_size: int, rounds: int, workload, warmup: int, steps: int) -> Dict[str, Any]:
    plan = [(PLAIN, 1), (PEER, world_size)] + [(name, world_size) for name in OURS]
    figures: Dict[str, List[Optional[float]]] = {name: [] for name, _ in plan}
    ops: Dict[str, List[float]] = {name: [] for name, _ in plan}
    backward: Dict[str, List[Optional[float]]] = {name: [] for name, _ in plan}
    errors: List[str] = []
    for r in range(rounds):
        for name, ws in plan if r % 2 == 0 else plan[::-1]:
            run = run_one(name, ws, workload, warmup, steps, 1800)
            figures[name].append(host_seconds(run))
            backward[name].append(host_seconds(run, "backward_host_times"))
            if not run["error"] and run["ranks"] and "xla_ops_per_step" in run["ranks"][0]:
                ops[name].append(run["ranks"][0]["xla_ops_per_step"] / ws)  # the process's, per rank thread
            if run["error"]:
                errors.append(f"{name} ws{ws} round {r}: {run['error']}")
    return {"figures": figures, "backward": backward, "ops": ops, "errors": errors}


def _ratios(a: List[Optional[float]], b: List[Optional[float]]) -> List[float]:
    return [x / y for x, y in zip(a, b) if x is not None and y]


def _median(values: List[Optional[float]]) -> Optional[float]:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f}"


def table(figures: Dict[str, List[Optional[float]]], world_size: int,
          backward: Optional[Dict[str, List[Optional[float]]]] = None,
          ops: Optional[Dict[str, List[float]]] = None) -> List[str]:
    lines = ["| contender | devices | host s/step, pooled (each round) | of which backward's thread, pooled "
             "| / torch_xla XlaFSDP, pooled (each round) | ATen ops traced per rank per step |",
             "|---|---|---|---|---|---|"]
    for name, values in figures.items():
        ratios = _ratios(values, figures[PEER])
        per_round = ", ".join(_seconds(v) for v in values)
        ratio = f"{statistics.median(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)})" if ratios else "-"
        devices = 1 if name == PLAIN else world_size
        back = _seconds(_median(backward[name])) if backward and name in backward else "-"
        traced = f"{_median(ops[name]):.0f}" if ops and ops.get(name) else "-"
        lines.append(f"| {name} | {devices} | {_seconds(_median(values))} ({per_round}) | {back} | {ratio} "
                     f"| {traced} |")
    return lines


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a run of XLA contenders side by side (this benchmark's and ``against_commit``'s)."""
    p.add_argument("--world_size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workload", default="transformer")
    p.add_argument("--quick", action="store_true", help="the quick workload shapes")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p)
    p.add_argument("--out", default=os.path.join(HERE, "results", "host_time"))
    args = p.parse_args(argv)
    workload = (QUICK if args.quick else FULL)[args.workload]
    result = measure(args.world_size, args.rounds, workload, args.warmup, args.steps)
    lines = [f"# Host time per step on XLA, {datetime.date.today()}", "",
             f"Workload {args.workload}{' (quick shapes)' if args.quick else ''}; {args.warmup} warm-up and "
             f"{args.steps} measured steps per run, {args.rounds} rounds. Host time: a rank thread's CPU time "
             "(`time.thread_time`) from the step's start to its sync, plus autograd's device thread's during "
             "backward (XLA runs backward there); per run the median over steps of the slowest rank's. Ratios "
             "are per round, pooled as their median. ATen ops traced: the ops torch_xla counted (`xla::*` counters) "
             "over the measured steps, per rank thread and step (a count: no timing noise).", ""]
    lines += table(result["figures"], args.world_size, result["backward"], result["ops"])
    if result["errors"]:
        lines += ["", "Errors:"] + [f"- {e}" for e in result["errors"]]
    write_result(args.out, dict(result, workload=args.workload, quick=args.quick, world_size=args.world_size,
                                warmup=args.warmup, steps=args.steps), lines)


if __name__ == "__main__":
    main()
