"""XLA compile time against depth, side by side: the first steps of a transformer (d_model 128) on 2
XLA:CPU devices (the unwrapped model also on 1, scanned and not), for the unwrapped model, torch_xla's
XlaFSDP, torch_xla's SPMD FSDPv2 with and without ``scan_layers``, and xla_fsdp's wrapper and
``fully_shard``, each in a fresh process per depth.

    python -m benchmarks.compile_time [--depths 2 4 8 16 32] [--steps 4] [--phases] [--cache]

Per contender and depth: the seconds and the number of XLA compilations of the process over the first
``--steps`` steps (torch_xla's CompileTime metric, every device thread's), the first step's time and the
last step's (steady: no compilation left). The exponent ``k`` of compile seconds ~ depth**k is fitted per
contender by least squares on the logs. ``--phases`` syncs between backward and the optimizer's step, so
that the forward and backward (with the collectives) and the optimizer step compile as separate graphs:
their compile seconds are reported apart. ``--cache`` runs xla_fsdp's wrapper twice at the middle depth
with torch_xla's persistent compilation cache in one folder (``torch_xla.runtime.initialize_cache``) and
reports what the second run compiled and whether its losses are the first's. Writes
benchmarks/results/compile_time.json, .md and .png (seconds against depth, log-log).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import tempfile
from typing import Any, Dict, List, Optional

from .report import write_result
from .run import run_one
from .workloads import Workload

HERE = os.path.dirname(os.path.abspath(__file__))

#: label -> (the worker's contender, scanned, devices). scan_layers on 2 XLA:CPU device threads fails in
#: backward (dynamo's compile metrics are per process: "Metric(s) {'is_forward'} have already been set"),
#: so the unwrapped model runs scanned and unscanned on one device
CONTENDERS = {
    "unwrapped (1 device)": ("xla_plain", False, 1),
    "unwrapped, scan_layers (1 device)": ("xla_plain", True, 1),
    "unwrapped": ("xla_plain", False, 2),
    "torch_xla XlaFSDP": ("torchxla_fsdp_perparam", False, 2),
    "torch_xla FSDPv2 (SPMD)": ("torchxla_spmd", False, 2),
    "torch_xla FSDPv2, scan_layers (root only)": ("torchxla_spmd", True, 2),
    "xla_fsdp wrapper": ("xla_fsdp_xla_perparam", False, 2),
    "xla_fsdp fully_shard": ("xla_fsdp_fully_shard", False, 2),
}


def workload(depth: int, scan: bool) -> Workload:
    return Workload("transformer", "lm", batch=2, d_model=128, layers=depth, heads=4, vocab=1024, seq=64, scan=scan)


def measure_one(contender: str, depth: int, scan: bool, devices: int, steps: int, phases: bool, timeout: int,
                cache_dir: Optional[str] = None) -> Dict[str, Any]:
    extra = {"phases": phases, **({"cache_dir": cache_dir} if cache_dir else {})}
    out = run_one(contender, devices, workload(depth, scan), 0, steps, timeout, spec_extra=extra)
    if out["error"] is not None:
        return {"error": out["error"].strip().splitlines()[-1][:300]}
    r0 = out["ranks"][0]
    compiles = r0["compile_seconds"]
    row: Dict[str, Any] = {"compile_s": sum(compiles), "graphs": len(compiles), "first_step_s": r0["times"][0],
                           "steady_step_s": r0["times"][-1], "losses": r0["losses"], "process_s": out["wall_s"]}
    if phases:  # marks: after each step's backward, after each step
        marks = [0] + r0["phase_marks"]
        row["backward_compile_s"] = sum(sum(compiles[marks[2 * i]:marks[2 * i + 1]]) for i in range(steps))
        row["optimizer_compile_s"] = sum(sum(compiles[marks[2 * i + 1]:marks[2 * i + 2]]) for i in range(steps))
    return row


def exponent(points: Dict[int, Dict[str, Any]]) -> Optional[float]:
    xs = [(math.log(d), math.log(r["compile_s"])) for d, r in points.items() if "compile_s" in r and r["compile_s"] > 0]
    if len(xs) < 2:
        return None
    return statistics.linear_regression([x for x, _ in xs], [y for _, y in xs]).slope


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--phases", action="store_true", help="forward+backward and the optimizer as two graphs")
    p.add_argument("--cache", action="store_true", help="also the persistent cache, twice at the middle depth")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default=os.path.join(HERE, "results", "compile_time"))
    args = p.parse_args(argv)
    rows: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for depth in args.depths:  # depth by depth: every contender's figure at a depth taken close in time
        for label in args.contenders:
            contender, scan, devices = CONTENDERS[label]
            rows.setdefault(label, {})[depth] = r = measure_one(contender, depth, scan, devices, args.steps,
                                                                args.phases, args.timeout)
            print(f"{label} depth {depth}: {r.get('compile_s', r.get('error'))}", flush=True)
    result: Dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "devices": 2, "steps": args.steps, "phases": args.phases,
        "workload": workload(args.depths[0], False).describe(), "rows": {k: {str(d): r for d, r in v.items()}
                                                                         for k, v in rows.items()},
        "exponents": {label: exponent(v) for label, v in rows.items()}}
    if args.cache:
        depth = args.depths[len(args.depths) // 2]
        with tempfile.TemporaryDirectory() as cache:
            runs = [measure_one(CONTENDERS["xla_fsdp wrapper"][0], depth, False, 2, args.steps, False, args.timeout,
                                cache_dir=cache) for _ in range(2)]
        result["cache"] = {"depth": depth, "runs": runs,
                           "same_losses": all("losses" in r for r in runs) and runs[0]["losses"] == runs[1]["losses"]}
    write_result(args.out, result, _table(result, args.depths))
    _plot(result, args.depths, args.out + ".png")


def _table(result: Dict[str, Any], depths: List[int]) -> List[str]:
    lines = [f"# XLA compile time against depth ({result['date']}): transformer d_model 128, 2 XLA:CPU devices, "
             f"the first {result['steps']} steps", "",
             "Compile seconds (graphs compiled) over those steps, per depth; k: the fitted exponent of compile "
             "seconds against depth. One run per cell, on this 2-core machine: read the shape, not the seconds.", "",
             "| contender | " + " | ".join(f"depth {d}" for d in depths) + " | k | first / steady step at "
             f"depth {depths[-1]} |", "|---|" + "---|" * (len(depths) + 2)]
    for label, per_depth in result["rows"].items():
        cells = []
        for d in depths:
            r = per_depth.get(str(d), {})
            cells.append(f"{r['compile_s']:.1f} s ({r['graphs']})" if "compile_s" in r else
                         f"fails: {r.get('error', 'not run')[:80]}")
        k = result["exponents"].get(label)
        last = per_depth.get(str(depths[-1]), {})
        steps = (f"{last['first_step_s']:.1f} s / {last['steady_step_s'] * 1e3:.0f} ms" if "first_step_s" in last
                 else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {'-' if k is None else f'{k:.2f}'} | {steps} |")
    if result["phases"]:
        lines += ["", "Compile seconds by graph (forward + backward with the collectives / the optimizer step):", "",
                  "| contender | " + " | ".join(f"depth {d}" for d in depths) + " |", "|---|" + "---|" * len(depths)]
        for label, per_depth in result["rows"].items():
            cells = [f"{r['backward_compile_s']:.1f} / {r['optimizer_compile_s']:.1f}" if "backward_compile_s" in r
                     else "-" for r in (per_depth.get(str(d), {}) for d in depths)]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if "cache" in result:
        c = result["cache"]
        lines += ["", f"Persistent compilation cache, xla_fsdp's wrapper at depth {c['depth']}, two runs sharing one "
                  "cache folder:", ""]
        for i, r in enumerate(c["runs"], 1):
            lines.append(f"- run {i}: " + (f"{r['compile_s']:.1f} s compiling, {r['graphs']} graphs, first step "
                                           f"{r['first_step_s']:.1f} s" if "compile_s" in r else r["error"]))
        lines.append(f"- the same losses both runs: {c['same_losses']}")
    return lines


def _plot(result: Dict[str, Any], depths: List[int], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, per_depth in result["rows"].items():
        pts = [(d, per_depth[str(d)]["compile_s"]) for d in depths if "compile_s" in per_depth.get(str(d), {})]
        if pts:
            ax.plot([d for d, _ in pts], [s for _, s in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("layers")
    ax.set_ylabel(f"compile seconds, first {result['steps']} steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
