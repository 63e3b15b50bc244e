"""Device memory of the compiled training step on XLA: bytes per device, from XLA's own
buffer assignment.

    python -m benchmarks.step_buffers [--world_sizes 2,4] [--workloads transformer,resnet18]

XLA:CPU has no live-buffer statistics (``xm.get_memory_info``: "GetAllocatorStats is not
supported"), and a process's peak RSS also counts compiled code and the host allocator, and moves by
~200 MiB between runs. What a TPU's HBM holds during a step is fixed when XLA compiles it: the step
program's buffer assignment (its parameters, i.e. shards, optimizer state and inputs; its temporaries;
its outputs). Each contender runs 2 steps with ``--xla_dump_to``; the figure is the largest "Total
bytes used" among the programs it compiled: the step (the others hold a few hundred bytes). Deterministic: the same
code gives the same bytes. Writes benchmarks/results/step_buffers.json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import tempfile
from typing import Dict, List, Optional

from .report import write_result
from .run import run_one
from .workloads import FULL

HERE = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = ["xla_fsdp_xla_perparam", "torchxla_fsdp_perparam", "xla_fsdp_xla", "torchxla_fsdp"]
#: ours -> the peer it is compared with (the same layout)
PAIRS = {"xla_fsdp_xla_perparam": "torchxla_fsdp_perparam", "xla_fsdp_xla": "torchxla_fsdp"}
_TOTAL = re.compile(r"^Total bytes used: (\d+)", re.M)


def largest_program_bytes(dump_dir: str) -> Optional[int]:
    """The largest "Total bytes used" of the memory-usage reports XLA wrote to ``dump_dir``."""
    sizes = []
    for path in glob.glob(os.path.join(dump_dir, "*memory-usage-report.txt")):
        with open(path) as f:
            match = _TOTAL.search(f.read())
        if match:
            sizes.append(int(match.group(1)))
    return max(sizes) if sizes else None


def measure(contender: str, ws: int, workload: str, workloads: Dict = FULL, root: Optional[str] = None) -> Dict:
    with tempfile.TemporaryDirectory() as dump:
        saved = os.environ.get("XLA_FLAGS")
        os.environ["XLA_FLAGS"] = f"{saved or ''} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()
        try:
            run = run_one(contender, ws, workloads[workload], 1, 1, 900, **({"root": root} if root else {}))
        finally:
            if saved is None:
                os.environ.pop("XLA_FLAGS")
            else:
                os.environ["XLA_FLAGS"] = saved
        return {"contender": contender, "ws": ws, "workload": workload, "error": run["error"],
                "step_bytes_per_device": largest_program_bytes(dump)}


def table(rows: List[Dict]) -> str:
    by = {(r["workload"], r["ws"], r["contender"]): r["step_bytes_per_device"] for r in rows}
    lines = ["| workload | ws | layout | xla_fsdp MiB per device | torch_xla MiB per device | ratio |",
             "|---|---|---|---|---|---|"]
    for (workload, ws) in sorted({(r["workload"], r["ws"]) for r in rows}):
        for ours, peer in PAIRS.items():
            a, b = by.get((workload, ws, ours)), by.get((workload, ws, peer))
            if a and b:
                layout = "per-parameter (default)" if ours.endswith("_perparam") else "flat"
                lines.append(f"| {workload} | {ws} | {layout} | {a / 2**20:.2f} | {b / 2**20:.2f} | {a / b:.3f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world_sizes", default="2,4")
    p.add_argument("--workloads", default="transformer,resnet18")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--out", default=os.path.join(HERE, "results", "step_buffers"))
    args = p.parse_args(argv)
    rows = [measure(c, int(ws), w) for w in args.workloads.split(",") for ws in args.world_sizes.split(",")
            for c in args.contenders.split(",")]
    text = (f"# Device memory of the compiled step, {datetime.date.today()}\n\n"
            "Bytes per device of the largest program each contender compiled (its training step), from XLA's "
            "buffer assignment: parameters (shards, optimizer state, inputs), temporaries and outputs. "
            "XLA:CPU, the benchmark's workloads (`benchmarks/workloads.py`).\n\n" + table(rows) + "\n")
    errors = [r for r in rows if r["error"]]
    if errors:
        text += "\nErrors:\n" + "\n".join(f"- {r['contender']} ws{r['ws']} {r['workload']}: {r['error']}"
                                          for r in errors) + "\n"
    write_result(args.out, {"rows": rows}, text.splitlines())


if __name__ == "__main__":
    main()
