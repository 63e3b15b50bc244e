"""This checkout against another commit, side by side in one run: step time, host time and the
step's device bytes of xla_fsdp's XLA contenders, so a change that should leave them alone (a
restructure) is shown to.

    python -m benchmarks.against_commit --commit REV [--rounds 3] [--world_size 2] [--workload transformer]

The other commit's files are exported (``git archive``) to a temporary folder, with this checkout's
``benchmarks/`` in place of its own: both sides are measured by the same code, and only the package
differs. Each run imports the package of its own checkout (:func:`benchmarks.run.run_one`'s ``root``).
Per round every contender runs from both checkouts back to back, the order reversed every other
round. Per run: the median over measured steps of the slowest rank's step time, and of its host time
(``benchmarks.host_time``); ratios (this / the other) are taken per round and pooled as their median.
Device bytes (``benchmarks.step_buffers``) are deterministic: measured once per checkout. Writes
benchmarks/results/against_<rev>.json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import tarfile
import tempfile
from typing import Any, Dict, List, Optional

from . import contenders as contenders_module
from . import step_buffers
from .host_time import add_run_arguments, host_seconds
from .report import write_result
from .run import ROOT, run_one
from .workloads import FULL, QUICK

HERE = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = ("xla_fsdp_xla_perparam", "xla_fsdp_fully_shard")


def _transports(contenders: List[str]) -> str:
    """Where the contenders run: gloo processes, XLA:CPU device threads, or both."""
    gloo = [c in contenders_module.GLOO for c in contenders]
    return "gloo ranks" if all(gloo) else "XLA:CPU devices" if not any(gloo) else "gloo ranks and XLA:CPU devices"


def step_seconds(run: Dict[str, Any]) -> Optional[float]:
    """Median over measured steps of the slowest rank's step time; None for a failed run."""
    if run["error"] or not run["ranks"]:
        return None
    return statistics.median(max(steps) for steps in zip(*(r["times"] for r in run["ranks"])))


def ops_per_rank(run: Dict[str, Any], world_size: int) -> Optional[float]:
    """ATen ops traced per rank per measured step (the process's count over its device threads); None
    for a failed run."""
    if run["error"] or not run["ranks"] or run["ranks"][0].get("xla_ops_per_step") is None:
        return None
    return run["ranks"][0]["xla_ops_per_step"] / world_size


def export(rev: str, folder: str, measure_from: str = HERE) -> str:
    """The files of commit ``rev`` of this repository, written under ``folder``, with the benchmark
    code of ``measure_from`` (this checkout's: the measure) in place of the commit's."""
    os.makedirs(folder, exist_ok=True)
    archive = os.path.join(folder, "rev.tar")
    subprocess.run(["git", "archive", "--format=tar", "-o", archive, rev], cwd=ROOT, check=True)
    target = os.path.join(folder, "checkout")
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    shutil.rmtree(os.path.join(target, "benchmarks"), ignore_errors=True)
    shutil.copytree(measure_from, os.path.join(target, "benchmarks"),
                    ignore=shutil.ignore_patterns("results", "__pycache__"))
    return target


def measure(other: str, contenders: List[str], world_size: int, rounds: int, workload, warmup: int,
            steps: int) -> Dict[str, Any]:
    roots = {"this": ROOT, "other": other}
    figures: Dict[str, Dict[str, Dict[str, List[Optional[float]]]]] = {
        c: {side: {"step": [], "host": [], "ops": []} for side in roots} for c in contenders}
    errors: List[str] = []
    for r in range(rounds):
        sides = list(roots) if r % 2 == 0 else list(roots)[::-1]
        for contender in contenders:
            for side in sides:
                run = run_one(contender, world_size, workload, warmup, steps, 1800, root=roots[side])
                figures[contender][side]["step"].append(step_seconds(run))
                figures[contender][side]["host"].append(host_seconds(run))
                figures[contender][side]["ops"].append(ops_per_rank(run, world_size))
                if run["error"]:
                    errors.append(f"{contender} ({side}) round {r}: {run['error']}")
    return {"figures": figures, "errors": errors}


def device_bytes(other: str, contenders: List[str], world_size: int, workload: str,
                 workloads: Dict) -> Dict[str, Dict[str, Optional[int]]]:
    return {c: {side: step_buffers.measure(c, world_size, workload, workloads, root=root)["step_bytes_per_device"]
                for side, root in (("this", ROOT), ("other", other))} for c in contenders}


def _ratio_cell(this: List[Optional[float]], other: List[Optional[float]]) -> str:
    ratios = [a / b for a, b in zip(this, other) if a is not None and b]
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)})"


def _ops_cell(ops: List[Optional[float]]) -> str:
    known = [x for x in ops if x is not None]
    return f"{statistics.median(known):.0f}" if known else "-"


def table(result: Dict[str, Any], rev: str) -> List[str]:
    lines = [f"| contender | step s, this / {rev} (median of rounds) | step ratio, pooled (each round) "
             f"| host s, this / {rev} | host ratio, pooled (each round) | device MiB, this / {rev} "
             f"| ATen ops traced per rank and step, this / {rev} |",
             "|---|---|---|---|---|---|---|"]
    for contender, sides in result["figures"].items():
        med = {side: {k: statistics.median([v for v in vals if v is not None] or [float("nan")])
                      for k, vals in kinds.items()} for side, kinds in sides.items()}
        nbytes = result["device_bytes"].get(contender, {})
        mib = " / ".join("-" if nbytes.get(s) is None else f"{nbytes[s] / 2**20:.2f}" for s in ("this", "other"))
        lines.append(f"| {contender} | {med['this']['step']:.4f} / {med['other']['step']:.4f} "
                     f"| {_ratio_cell(sides['this']['step'], sides['other']['step'])} "
                     f"| {med['this']['host']:.4f} / {med['other']['host']:.4f} "
                     f"| {_ratio_cell(sides['this']['host'], sides['other']['host'])} | {mib} "
                     f"| {_ops_cell(sides['this'].get('ops', []))} / {_ops_cell(sides['other'].get('ops', []))} |")
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commit", required=True, help="the commit to compare with (a revision git knows)")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    add_run_arguments(p)
    p.add_argument("--out", default="", help="default: benchmarks/results/against_<commit>")
    args = p.parse_args(argv)
    workloads = QUICK if args.quick else FULL
    contenders = args.contenders.split(",")
    rev = subprocess.run(["git", "rev-parse", "--short", args.commit], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as folder:
        other = export(rev, folder)
        result = measure(other, contenders, args.world_size, args.rounds, workloads[args.workload], args.warmup,
                         args.steps)
        result["device_bytes"] = device_bytes(other, contenders, args.world_size, args.workload, workloads)
    this = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    lines = [f"# This checkout ({this}) against {rev}, {datetime.date.today()}", "",
             f"Workload {args.workload}{' (quick shapes)' if args.quick else ''}, world size {args.world_size} "
             f"({_transports(contenders)}); "
             f"{args.warmup} warm-up and {args.steps} measured steps per run, {args.rounds} rounds, both checkouts "
             "back to back in each round. Per run the median over steps of the slowest rank's step time and host "
             "time; ratios (this / the other) per round, pooled as their median. Device MiB: the compiled "
             "step's buffer assignment per device (deterministic). ATen ops: what torch_xla traced per rank and "
             "step (median of rounds).", ""]
    lines += table(result, rev)
    if result["errors"]:
        lines += ["", "Errors:"] + [f"- {e}" for e in result["errors"]]
    write_result(args.out or os.path.join(HERE, "results", f"against_{rev}"),
                 dict(result, this=this, other=rev, workload=args.workload, quick=args.quick,
                      world_size=args.world_size, warmup=args.warmup, steps=args.steps), lines)


if __name__ == "__main__":
    main()
