"""FSDP2's tutorial program on XLA with no sync of its own: the time it takes, beside the same
program with an explicit sync after each step and with the unit's graph cut turned off.

    python -m benchmarks.step_cut [--world_size 2] [--rounds 2] [--steps 8]

FSDP2 programs have no step marker. On XLA, ``fully_shard``'s root cuts the graph where the
optimizer steps its shards (``set_sync_after_optimizer_step``, on by default), so a program
written for FSDP2 runs one graph per step. The program is examples/train_llama_fsdp2.py's: its
model, meta init, ``fully_shard`` per block then the root, prefetch, ``unshard``, loss,
``clip_grad_norm_``, AdamW, LR schedule and ``loss.item()`` each step (its loop without the
checkpoints). Modes, each run a fresh process on ``--world_size`` XLA:CPU devices:

- ``as_written``: the program as FSDP2 users write it, no sync;
- ``own_sync``: the same with ``xla_fsdp.sync()`` after each step (what torch_xla programs do);
- ``cut_off``: no sync and ``set_sync_after_optimizer_step(False)`` (the graph is never cut where
  the step ends: only ``loss.item()`` runs what is pending, and the optimizer's update is traced
  into the next step's graph).

Per run: the wall seconds of all steps (compilation included), the median of the second half of
the steps, the graphs compiled and the losses (the same in every mode). The rounds run the modes back
to back, the order reversed every other round; ratios to ``own_sync`` are per round, pooled as
their median. Writes benchmarks/results/step_cut.json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("as_written", "own_sync", "cut_off")


def _rank_loop(ctx, args) -> None:
    """One rank of the tutorial's loop (examples/train_llama_fsdp2.py ``train``, checkpoints left out)."""
    import torch
    import torch.nn.functional as F
    import torch_xla.debug.metrics as met

    import train_llama_fsdp2 as example
    import xla_fsdp

    cfg = example.LlamaConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                              hidden_dim=args.hidden_dim, vocab_size=args.vocab_size, max_seq_len=args.seq_len)
    model = example.build(ctx, args, cfg)
    if args.mode == "cut_off":
        model.set_sync_after_optimizer_step(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, example.warmup_cosine(args.warmup, args.steps))
    xla_fsdp.sync()  # the init's graph is not a step's
    compiles_before = met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0
    times, losses = [], []
    start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        per_rank = args.batch_size
        tokens = example.batch(step, cfg, per_rank * ctx.world_size)[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
        tokens = tokens.to(ctx.device)
        model.unshard()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        opt.step()
        opt.zero_grad()
        scheduler.step()
        losses.append(loss.item())
        if args.mode == "own_sync":
            xla_fsdp.sync()
        times.append(time.perf_counter() - t0)
    total = time.perf_counter() - start
    compiles = (met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0) - compiles_before
    if ctx.rank == 0:
        with open(args.result, "w") as f:
            json.dump({"total_s": total, "step_times": times, "losses": losses, "compiles": compiles}, f)


def _worker(argv: List[str]) -> None:
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_llama_fsdp2 as example
    from example_utils import launch

    parser = example.build_parser()
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    launch(_rank_loop, args)


def run(mode: str, world_size: int, steps: int, timeout: int = 1800) -> Dict[str, Any]:
    """One run in a fresh process; its rank 0's figures, or the failure."""
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    with tempfile.TemporaryDirectory() as folder:
        result = os.path.join(folder, "result.json")
        argv = [sys.executable, "-m", "benchmarks.step_cut", "--worker", "--mode", mode, "--result", result,
                "--num_devices", str(world_size), "--steps", str(steps), "--out_dir", folder]
        try:
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s"}
        if done.returncode != 0 or not os.path.exists(result):
            return {"error": f"exit {done.returncode}: {done.stderr.strip()[-600:]}"}
        with open(result) as f:
            return json.load(f)


def steady_step(figures: Dict[str, Any]) -> Optional[float]:
    """The median of the second half of the steps (the first ones compile: as written, the graph cut
    begins at the second step, whose end the unit learns the program does not mark)."""
    times = figures.get("step_times") or []
    return statistics.median(times[len(times) // 2:]) if len(times) > 1 else None


def measure(world_size: int, rounds: int, steps: int) -> Dict[str, Any]:
    runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            runs[mode].append(run(mode, world_size, steps))
    return runs


def _ratio(runs: Dict[str, List[Dict[str, Any]]], mode: str, key) -> str:
    ratios = [key(a) / key(b) for a, b in zip(runs[mode], runs["own_sync"])
              if "error" not in a and "error" not in b and key(a) and key(b)]
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})"


def table(runs: Dict[str, List[Dict[str, Any]]]) -> List[str]:
    lines = ["| mode | total s (each round) | / own_sync, pooled (each round) | steady step s (each round) "
             "| / own_sync | graphs compiled | losses as own_sync's |", "|---|---|---|---|---|---|---|"]
    for mode, results in runs.items():
        ok = [x for x in results if "error" not in x]
        if not ok:
            lines.append(f"| {mode} | failed | - | - | - | - | - |")
            continue
        totals = ", ".join(f"{x['total_s']:.2f}" for x in ok)
        steady = ", ".join(f"{steady_step(x):.3f}" for x in ok if steady_step(x) is not None)
        reference = [x for x in runs["own_sync"] if "error" not in x]
        same = reference and max(abs(a - b) for a, b in zip(ok[0]["losses"], reference[0]["losses"])) < 1e-5
        lines.append(f"| {mode} | {statistics.median(x['total_s'] for x in ok):.2f} ({totals}) "
                     f"| {_ratio(runs, mode, lambda x: x['total_s'])} | {steady} "
                     f"| {_ratio(runs, mode, steady_step)} | {ok[0]['compiles']} | {bool(same)} |")
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker(argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world_size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default=os.path.join(HERE, "results", "step_cut"))
    args = p.parse_args(argv)
    runs = measure(args.world_size, args.rounds, args.steps)
    from .report import write_result
    lines = [f"# FSDP2's tutorial program on XLA, with and without syncs, {datetime.date.today()}", "",
             f"examples/train_llama_fsdp2.py's model and loop (defaults: dim 64, 4 layers, 2 sequences of 32 tokens "
             f"per rank), {args.steps} steps on {args.world_size} XLA:CPU devices, {args.rounds} rounds, the modes "
             "back to back in each round. Total: the wall seconds of every step, compilation included; steady "
             "step: the median of the second half of the steps. `as_written`: no sync in the program (the unit "
             "cuts the graph at the optimizer step); `own_sync`: `xla_fsdp.sync()` after each step; `cut_off`: no "
             "sync and `set_sync_after_optimizer_step(False)`.", ""]
    lines += table(runs)
    errors = [f"{m} round {i}: {x['error']}" for m, xs in runs.items() for i, x in enumerate(xs) if "error" in x]
    if errors:
        lines += ["", "Errors:"] + [f"- {e}" for e in errors]
    write_result(args.out, {"runs": runs, "world_size": args.world_size, "rounds": args.rounds, "steps": args.steps},
                 lines)


if __name__ == "__main__":
    main()
