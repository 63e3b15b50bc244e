"""What ``reshard_after_forward`` and prefetch lists change, for FSDP2's API on XLA and for PyTorch's
FSDP2.

    python -m benchmarks.reshard [--world_sizes 2,4] [--workload transformer] [--quick]

The transformer's blocks through ``fully_shard`` with ``reshard_after_forward=True`` (FSDP2's
default: ZeRO-3, the blocks' parameters gathered again in backward) and ``False`` (ZeRO-2, kept from
forward to backward), half the world size (FSDP2's int: each rank keeps its rows within a group of
ws/2 ranks from forward to backward, at ws >= 4), and ``True`` with prefetch lists of two blocks each
way; the root as FSDP2 leaves it:
- ``xla_fsdp.fully_shard`` on XLA:CPU devices: all-gathers traced per step, bytes gathered and
  reduce-scattered per step, and device bytes of the compiled step (XLA's buffer assignment, as
  :mod:`benchmarks.step_buffers`);
- PyTorch's ``fully_shard`` on gloo ranks: all-gather calls per step, bytes per step, peak RSS.
Every setting trains to the same losses (checked here). Writes benchmarks/results/reshard.json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from .contenders import HALF, PREFETCH2, ZERO2
from .report import write_result
from .run import run_one
from .step_buffers import largest_program_bytes
from .workloads import FULL, QUICK

HERE = os.path.dirname(os.path.abspath(__file__))
_GATHER = re.compile(r" all-gather(?:-start)?\(.*")
_GROUPS = re.compile(r"replica_groups=\{(\{[^}]*\}(?:,\{[^}]*\})*)\}")
SIDES = {"XLA:CPU, xla_fsdp.fully_shard": "xla_fsdp_fully_shard", "gloo, PyTorch's fully_shard": "fsdp2"}


def measure(contender: str, ws: int, workload, steps: int = 2) -> Dict[str, Any]:
    """One run (1 warm-up step, ``steps`` measured); XLA runs also dump their compiled programs."""
    with tempfile.TemporaryDirectory() as dump:
        saved = os.environ.get("XLA_FLAGS")
        if contender.startswith("xla"):
            os.environ["XLA_FLAGS"] = f"{saved or ''} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()
        try:
            run = run_one(contender, ws, workload, 1, steps, 900)
        finally:
            if saved is None:
                os.environ.pop("XLA_FLAGS", None)
            else:
                os.environ["XLA_FLAGS"] = saved
        step_bytes = largest_program_bytes(dump) if contender.startswith("xla") else None
        compiled, in_groups = compiled_all_gathers(dump) if contender.startswith("xla") else (None, None)
    ranks = run["ranks"]
    row = {"contender": contender, "ws": ws, "error": run["error"], "step_bytes_per_device": step_bytes,
           "compiled_all_gathers": compiled, "compiled_all_gathers_in_subgroups": in_groups}
    if ranks:
        row.update(all_gathers_per_step=max(r["all_gathers_per_step"] for r in ranks),
                   collective_bytes_per_step=max(r["collective_bytes_per_step"] for r in ranks),
                   param_bytes=ranks[0]["param_bytes"], peak_rss_mib=max(r["peak_rss_mib"] for r in ranks),
                   losses=ranks[0]["losses"])
    return row


def compiled_all_gathers(dump_dir: str) -> Tuple[Optional[int], Optional[int]]:
    """All-gather instructions in the largest optimized program XLA wrote to ``dump_dir`` (the step):
    what the compiler kept of the traced gathers, after combining and CSE; and how many of them run
    within subgroups (more than one replica group: an int ``reshard_after_forward``'s backward)."""
    counts = []
    for path in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        with open(path) as f:
            text = f.read()
        gathers = _GATHER.findall(text)
        in_groups = sum(1 for g in gathers if (m := _GROUPS.search(g)) and m.group(1).count("{") > 1)
        counts.append((len(text), len(gathers), in_groups))
    return max(counts)[1:] if counts else (None, None)


#: setting -> contender suffix; "same losses" compares each row with the first setting's
SETTINGS = {"True": "", "False": ZERO2, "world size / 2": HALF, "True, prefetch 2": PREFETCH2}


def table(rows: List[Dict[str, Any]]) -> List[str]:
    by = {(r["contender"], r["ws"]): r for r in rows}
    lines = ["| side | ws | reshard_after_forward | all-gathers per step | in the compiled step | "
             "collective bytes / param bytes | step device MiB (XLA) | peak RSS MiB | same losses |",
             "|---|---|---|---|---|---|---|---|---|"]
    for side, name in SIDES.items():
        for ws in sorted({r["ws"] for r in rows}):
            base = by.get((name, ws))
            for label, suffix in SETTINGS.items():
                r = by.get((name + suffix, ws))
                if not base or not r or base["error"] or r["error"]:
                    continue
                same = max(abs(a - b) for a, b in zip(base["losses"], r["losses"])) <= 1e-5
                mib = f"{r['step_bytes_per_device'] / 2**20:.2f}" if r["step_bytes_per_device"] else "-"
                compiled = "-" if r["compiled_all_gathers"] is None else str(r["compiled_all_gathers"])
                if r.get("compiled_all_gathers_in_subgroups"):
                    compiled += f" ({r['compiled_all_gathers_in_subgroups']} within groups of {r['ws'] // 2})"
                lines.append(f"| {side} | {ws} | {label} | {r['all_gathers_per_step']:.0f} | {compiled} | "
                             f"{r['collective_bytes_per_step'] / r['param_bytes']:.2f} | {mib} | "
                             f"{r['peak_rss_mib']:.0f} | {'yes' if same else 'NO'} |")
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world_sizes", default="2,4")
    p.add_argument("--workload", default="transformer")
    p.add_argument("--quick", action="store_true", help="the quick workload shapes")
    p.add_argument("--out", default=os.path.join(HERE, "results", "reshard"))
    args = p.parse_args(argv)
    workload = (QUICK if args.quick else FULL)[args.workload]
    rows = [measure(name + variant, int(ws), workload) for ws in args.world_sizes.split(",")
            for name in SIDES.values() for variant in SETTINGS.values()
            if variant != HALF or int(ws) >= 4]  # half of 2 is 1: False
    lines = [f"# reshard_after_forward (True, False, an int) and prefetch lists, {datetime.date.today()}",
             "", f"Workload {args.workload}{' (quick shapes)' if args.quick else ''}: its blocks through `fully_shard` "
             "with the setting, then the root (FSDP2's default). World size / 2: FSDP2's int, each rank keeps "
             "its rows of the blocks' parameters within a group of ws/2 ranks from forward to backward. "
             "Prefetch 2: each block lists the next two blocks in `set_modules_to_forward_prefetch` and the "
             "previous two in `..._backward_prefetch` "
             "(without lists FSDP2 prefetches none in forward and the previous block in backward). "
             "All-gathers per step: calls issued through "
             "torch.distributed (gloo) or traced through torch_xla's all-gather bindings (XLA: `torch_xla._XLAC`, "
             "which `xm.all_gather` and xla_fsdp call), per rank; in the compiled "
             "step: all-gather instructions XLA kept in the optimized step program. Collective "
             "bytes: gathered plus reduce-scattered, over the fp32 parameter bytes. Step device MiB: XLA's buffer "
             "assignment of the compiled step. Peak RSS: the largest rank process (XLA: the one process).", ""]
    lines += table(rows)
    errors = [r for r in rows if r["error"]]
    if errors:
        lines += ["", "Errors:"] + [f"- {r['contender']} ws{r['ws']}: {r['error']}" for r in errors]
    write_result(args.out, {"workload": args.workload, "quick": args.quick, "rows": rows}, lines)


if __name__ == "__main__":
    main()
