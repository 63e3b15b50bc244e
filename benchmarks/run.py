"""The benchmark suite: xla_fsdp against every peer, side by side, in one run.

    python -m benchmarks.run [--quick] [--skip_scale] [--rounds N] [--workloads transformer,resnet18]

Every measurement runs in a fresh process (:mod:`benchmarks.worker`). The contenders of one workload
and world size run back to back, in alternating rounds (ours first, then peers first, ...) so slow
drifts of this shared machine hit all of them alike; a figure is the median over every measured
step of every round (step time = slowest rank). The world-size-1 overhead targets come from
:mod:`benchmarks.overhead` (every world-size-1 contender in one process, steps interleaved), whose
ratios do not swing with the machine's drift.
Writes ``benchmarks/results/suite[-quick].json`` (``--name`` for another stem), a Markdown table
(``.md``) and a chart (``.png``);
see :mod:`benchmarks.report`.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from tqdm import tqdm

from . import report
from .workloads import FULL, QUICK

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (contender, world sizes); ours first in each group, its peers after. xla_plain
# at ws > 1 is the no-communication floor: the plain model on every device, no collectives.
PLAN = [
    ("unwrapped", [1]), ("xla_fsdp", [1, 2, 4]), ("ddp", [2, 4]), ("fsdp1", [2, 4]), ("fsdp2", [2, 4]),
    ("xla_plain", [1, 2, 4]), ("xla_fsdp_xla", [1, 2, 4]), ("torchxla_fsdp", [1, 2, 4]),
    ("xla_fsdp_spmd", [2, 4]), ("torchxla_spmd", [2, 4]),
    # the default layout of both XLA FSDPs (flatten_parameters=False); world size 1 is in the interleaved run
    ("xla_fsdp_xla_perparam", [2, 4]), ("torchxla_fsdp_perparam", [2, 4]),
    ("xla_fsdp_fully_shard", [2, 4]),  # FSDP2's API on XLA
]

# Interleaved world-size-1 rounds per workload: a few percent of overhead against a step-to-step
# spread of +-20% on this shared machine needs more rounds than the main table's 5 steps.
WS1_STEPS = {"transformer": 12, "resnet18": 30}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(contender: str, ws: int, workload, warmup: int, steps: int, timeout: int,
            root: str = ROOT, spec_extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One measurement in a fresh process; returns per-rank results or the failure. ``root``: the
    checkout whose package and benchmark worker run (another commit's, for a same-run comparison);
    ``spec_extra``: the worker's options (``phases``, ``cache_dir``)."""
    spec = {"contender": contender, "ws": ws, "workload": workload.describe(), "warmup": warmup,
            "steps": steps, "port": _free_port(), **(spec_extra or {})}
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=root)
    for key in ("PJRT_DEVICE", "CPU_NUM_DEVICES"):
        env.pop(key, None)
    with tempfile.TemporaryDirectory() as out:
        t0 = time.time()
        try:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", json.dumps(spec), out], env=env,
                                  cwd=root, capture_output=True, text=True, timeout=timeout)
            error = None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout} s"
        ranks = []
        for name in sorted(os.listdir(out)):
            with open(os.path.join(out, name)) as f:
                ranks.append(json.load(f))
    expected = 1 if contender in ("unwrapped", "torchxla_spmd", "xla_fsdp_spmd") else ws
    if error is None and len(ranks) != expected:
        error = f"{len(ranks)} of {expected} rank results written"
    return {"ranks": ranks, "error": error, "wall_s": time.time() - t0}


def run_overhead(transport: str, workload, warmup: int, steps: int, timeout: int) -> Dict[str, Any]:
    """The world-size-1 contenders, steps interleaved in one fresh process (:mod:`benchmarks.overhead`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=ROOT)
    for key in ("PJRT_DEVICE", "CPU_NUM_DEVICES"):
        env.pop(key, None)
    argv = [sys.executable, "-m", "benchmarks.overhead", transport, json.dumps(workload.describe()),
            str(warmup), str(steps)]
    try:
        proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"}
    return {"contenders": json.loads(proc.stdout.strip().splitlines()[-1])}


def summarize(contender: str, ws: int, runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Merge rounds: median over all measured steps of the per-step slowest rank."""
    ok = [r for r in runs if r["error"] is None]
    row: Dict[str, Any] = {"contender": contender, "ws": ws, "rounds": len(runs), "ok_rounds": len(ok)}
    if not ok:
        row["error"] = runs[-1]["error"] if runs else "not run"
        return row
    step_times = [max(t) for r in ok for t in zip(*[rank["times"] for rank in r["ranks"]])]
    ranks = ok[-1]["ranks"]
    # the most any rank's process held, per round; the row's figure is the median over rounds,
    # since one process's peak moves by ~200 MiB from run to run (compiles, allocator)
    peaks = [max(rank["peak_rss_mib"] for rank in r["ranks"]) for r in ok]
    param_bytes = ranks[0]["param_bytes"]
    coll = [rank["collective_bytes_per_step"] for rank in ranks]
    row.update({
        "median_step_s": statistics.median(step_times), "step_times": step_times,
        "losses": [statistics.fmean(x) for x in zip(*[rank["losses"] for rank in ranks])],
        "state_bytes_max": max(rank["state_bytes"] for rank in ranks),
        "param_bytes": param_bytes,
        "peak_rss_mib_rounds": peaks,
        "peak_rss_mib_max": statistics.median(peaks),
        "collective_bytes_per_step": max(coll) if all(c is not None for c in coll) else None,
        # XLA compilations after the second step, the most any round saw (one process: rank 0 counts all).
        # device-to-host copies per step (XLA): one per rank for loss.item(); a host-exchanged collective adds more
        "host_transfers_per_step": max(rank.get("host_transfers_per_step", 0) for rank in ranks),
        "new_compiles_after_step2": max(r["ranks"][0]["compiles_end"] - r["ranks"][0]["compiles_step2"] for r in ok),
    })
    return row


def side_by_side(names: List[str], plan: List[tuple], world_sizes: List[int]) -> List[tuple]:
    """(workload, contender, world size) jobs, those compared with each other adjacent: grouped by
    workload and world size, so a ratio's two step times are taken minutes apart, not an hour."""
    return [(wl, c, ws) for wl in names for ws in sorted(world_sizes) for c, wss in plan if ws in wss]


def _reversed_within_groups(jobs: List[tuple]) -> List[tuple]:
    """The same groups in the same order, each group's contenders in reverse: over two rounds no
    contender always runs first (warmer or colder machine) within its group."""
    groups = itertools.groupby(jobs, key=lambda job: (job[0], job[2]))
    return [job for _, group in groups for job in reversed(list(group))]


def run_suite(args) -> Dict[str, Any]:
    workloads = QUICK if args.quick else FULL
    names = (args.workloads or ("transformer" if args.quick else "transformer,resnet18")).split(",")
    warmup, steps = (2, 5) if args.quick else (3, 5)
    rounds = args.rounds or (1 if args.quick else 2)
    world_sizes = args.world_sizes or ([1, 2] if args.quick else [1, 2, 4])
    plan = []
    for c, wss in PLAN:
        if args.contenders and c not in args.contenders.split(","):
            continue
        plan.append((c, [w for w in wss if w in world_sizes]))
    jobs = side_by_side(names, plan, world_sizes)
    results: Dict[tuple, List] = {}
    bar = tqdm(total=len(jobs) * rounds, desc="benchmarks", unit="run")
    for r in range(rounds):  # alternate: every contender once per round
        for wl, c, ws in (jobs if r % 2 == 0 else _reversed_within_groups(jobs)):
            bar.set_postfix_str(f"{wl} {c} ws{ws}")
            results.setdefault((wl, c, ws), []).append(
                run_one(c, ws, workloads[wl], warmup, steps, args.timeout))
            bar.update()
    bar.close()
    out: Dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "quick": args.quick, "warmup": warmup, "steps": steps,
        "rounds": rounds, "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "workloads": {wl: workloads[wl].describe() for wl in names}, "rows": {},
    }
    for wl in names:
        out["rows"][wl] = [summarize(c, ws, results[(wl, c, ws)]) for c, wss in plan for ws in wss]
    if 1 in world_sizes and not args.contenders:
        out["ws1_interleaved"] = {wl: {t: run_overhead(t, workloads[wl], warmup,
                                                        2 * steps if args.quick else WS1_STEPS[wl], args.timeout)
                                       for t in ("gloo", "xla")} for wl in names}
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small transformer, world sizes 1 and 2, one round, no scale probe: under 5 minutes")
    parser.add_argument("--workloads", default="", help="default: transformer,resnet18 (quick: transformer)")
    parser.add_argument("--contenders", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--world_sizes", default="", type=lambda s: [int(x) for x in s.split(",")] if s else [],
                        help="default 1,2,4 (quick: 1,2)")
    parser.add_argument("--rounds", type=int, default=0, help="alternating rounds (default 2, quick 1)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per measurement")
    parser.add_argument("--skip_scale", action="store_true", help="skip the largest-model probe")
    parser.add_argument("--skip_consolidation", action="store_true")
    parser.add_argument("--out_dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="", help="file stem of the results (default: suite, or suite-quick); "
                                                   "e.g. resnet18-xla-5rounds for a focused run")
    args = parser.parse_args(argv)
    data = run_suite(args)
    if not args.skip_consolidation:
        from .consolidation_memory import measure as consolidation
        data["consolidation"] = consolidation(total_mb=1200, world_size=4, tensor_mb=50)
    if not args.skip_scale and not args.quick:
        from .scale import probe_all
        data["scale"] = probe_all()
    os.makedirs(args.out_dir, exist_ok=True)
    # One current result per run kind: older figures live in git history, not beside the current ones.
    stem = os.path.join(args.out_dir, args.name or ("suite-quick" if args.quick else "suite"))
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    report.write(data, stem)
    print(open(stem + ".md").read())
    print(f"wrote {stem}.json, {stem}.md, {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
