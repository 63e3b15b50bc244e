"""Turns a benchmark run into a readable Markdown table, the target checks and a PNG chart."""
from __future__ import annotations

import json
import os
import statistics
from typing import Any, Dict, List, Optional, Tuple

MIB = 1024 * 1024
OURS = {"gloo": "xla_fsdp", "xla": "xla_fsdp_xla"}
FAMILY = {"unwrapped": "gloo", "ddp": "gloo", "fsdp1": "gloo", "fsdp2": "gloo", "xla_fsdp": "gloo",
          "xla_plain": "xla", "torchxla_fsdp": "xla", "xla_fsdp_xla": "xla", "torchxla_spmd": "xla",
          "xla_fsdp_spmd": "xla", "torchxla_fsdp_perparam": "xla", "xla_fsdp_xla_perparam": "xla",
          "xla_fsdp_fully_shard": "xla"}
PER_PARAM = "_perparam"  # XLA FSDP rows in the default per-parameter layout: compared with each other
IDEAL_COPIES = {"lm": 4, "resnet": 3}   # params + grads + AdamW (2) / SGD momentum (1)
SHARDED = {"fsdp1", "fsdp2", "xla_fsdp", "xla_fsdp_xla", "torchxla_fsdp", "torchxla_spmd", "xla_fsdp_spmd",
           "torchxla_fsdp_perparam", "xla_fsdp_xla_perparam", "xla_fsdp_fully_shard"}


def ours_for(contender: str) -> str:
    """The row of ours a contender's ``x ours`` is taken against (same transport and layout)."""
    ours = OURS[FAMILY[contender]]
    per_param = contender.endswith(PER_PARAM) or contender == "xla_fsdp_fully_shard"  # fully_shard: dim-0 shards
    return ours + PER_PARAM if per_param else ours


def _row(rows: List[Dict], contender: str, ws: int) -> Optional[Dict]:
    for r in rows:
        if r["contender"] == contender and r["ws"] == ws and "median_step_s" in r:
            return r
    return None


def _in_run(rows: List[Dict], contenders: Tuple[str, ...], ws: int) -> bool:
    """Whether this run planned any of ``contenders`` at ``ws``: a comparison nobody asked for (a
    subset run) is left out of the targets, while one whose contender failed still shows as missed."""
    return any(r["contender"] in contenders and r["ws"] == ws for r in rows)


def _ratio(a: Optional[Dict], b: Optional[Dict]) -> Optional[float]:
    if a is None or b is None:
        return None
    return a["median_step_s"] / b["median_step_s"]


def _peak_ratio(a: Optional[Dict], b: Optional[Dict]) -> Optional[float]:
    """Peak memory of ``a`` over ``b``: XLA:CPU exposes no live device-buffer statistics
    (GetAllocatorStats is unimplemented), and its devices' buffers are host memory, so the peak RSS
    of the one process that holds every device stands for peak device memory."""
    if a is None or b is None:
        return None
    return a["peak_rss_mib_max"] / b["peak_rss_mib_max"]


def floor(data: Dict) -> List[Tuple[str, int, Optional[float], Optional[float]]]:
    """(workload, ws, unwrapped model / torch_xla per parameter, ours per parameter / unwrapped):
    ``xla_plain`` trains the unwrapped model on every device with no communication, the least step
    time any XLA FSDP could have on this machine, so it bounds what a step-time target can ask."""
    out = []
    for wl, rows in data["rows"].items():
        for ws in (2, 4):
            plain = _row(rows, "xla_plain", ws)
            if plain is not None:
                out.append((wl, ws, _ratio(plain, _row(rows, "torchxla_fsdp" + PER_PARAM, ws)),
                            _ratio(_row(rows, "xla_fsdp_xla" + PER_PARAM, ws), plain)))
    return out


#: step-time comparisons whose round-to-round spread the report shows (ours, then the reference)
ROUND_PAIRS = (("xla_fsdp_xla", "torchxla_fsdp"), ("xla_fsdp_spmd", "torchxla_spmd"),
               ("xla_fsdp_xla" + PER_PARAM, "torchxla_fsdp" + PER_PARAM),
               ("xla_fsdp_xla", "xla_plain"), ("xla_fsdp_xla" + PER_PARAM, "xla_plain"),
               ("torchxla_fsdp", "xla_plain"), ("xla_fsdp", "fsdp1"), ("xla_fsdp", "fsdp2"),
               ("xla_fsdp_fully_shard", "xla_fsdp_xla" + PER_PARAM),
               ("xla_fsdp_fully_shard", "torchxla_fsdp" + PER_PARAM), ("xla_fsdp_fully_shard", "fsdp2"))


#: peak-memory comparisons shown round by round (XLA:CPU against torch_xla, both layouts)
MEMORY_PAIRS = (("xla_fsdp_xla", "torchxla_fsdp"), ("xla_fsdp_xla" + PER_PARAM, "torchxla_fsdp" + PER_PARAM),
                ("xla_fsdp_fully_shard", "xla_fsdp_xla" + PER_PARAM),
                ("xla_fsdp_fully_shard", "torchxla_fsdp" + PER_PARAM))


def per_round_ratios(a: Dict, b: Dict, steps: int) -> Optional[List[float]]:
    """Round-by-round ratio of two rows' median step times (each round's contenders ran back to
    back); None unless every round of both succeeded, since a failed round shifts the steps."""
    if a["ok_rounds"] != a["rounds"] or b["ok_rounds"] != b["rounds"] or a["rounds"] != b["rounds"]:
        return None
    def medians(row: Dict) -> List[float]:
        t = row["step_times"]
        return [statistics.median(t[i:i + steps]) for i in range(0, len(t), steps)]
    return [x / y for x, y in zip(medians(a), medians(b))]


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "–" if x is None else format(x, spec)


def _cell(value) -> str:
    if value is None:
        return "–"
    return _fmt(value, ".3f") if isinstance(value, float) else _fmt(value, "d")


def ideal_bytes(row: Dict, kind: str) -> float:
    """total / N: what a rank would hold if all state were split evenly (DDP shows N x)."""
    return row["param_bytes"] * IDEAL_COPIES[kind] / row["ws"]


def targets(data: Dict) -> List[Tuple[str, str, Optional[float], str, bool]]:
    """(workload, target, measured, bound, met) for every performance target measurable in this run."""
    out = []
    for wl, rows in data["rows"].items():
        kind = data["workloads"][wl]["kind"]
        for ws in (2, 4):
            # The second pair goes beyond the flat layout: the default layout of both packages
            # (flatten_parameters=False).
            # (flat: step time <= 0.95; per parameter: <= 0.90; peak memory <= 1.00 in both layouts)
            for suffix, layout, step_bound in (("", "", 0.95), (PER_PARAM, ", default per-parameter layout", 0.90)):
                pair = ("xla_fsdp_xla" + suffix, "torchxla_fsdp" + suffix)
                if _in_run(rows, pair, ws):
                    a, b = _row(rows, pair[0], ws), _row(rows, pair[1], ws)
                    r = _ratio(a, b)
                    out.append((wl, f"XLA:CPU ws{ws} step time / torch_xla XlaFSDP{layout}", r,
                                f"<= {step_bound:.2f}", r is not None and r <= step_bound))
                    m = _peak_ratio(a, b)
                    out.append((wl, f"XLA:CPU ws{ws} peak memory / torch_xla XlaFSDP{layout}", m, "<= 1.00",
                                m is not None and m <= 1.0))
        for ws in (2, 4):  # our SPMD mode against torch_xla's FSDPv2, and the faster of our modes
            if _in_run(rows, ("xla_fsdp_spmd", "torchxla_spmd"), ws):
                r = _ratio(_row(rows, "xla_fsdp_spmd", ws), _row(rows, "torchxla_spmd", ws))
                out.append((wl, f"XLA:CPU ws{ws} SPMD step time / torch_xla FSDPv2", r, "<= 0.95",
                            r is not None and r <= 0.95))
                ours = [x for x in (_row(rows, "xla_fsdp_spmd", ws), _row(rows, "xla_fsdp_xla", ws)) if x]
                peers = [x for x in (_row(rows, p, ws) for p in ("torchxla_spmd", "torchxla_fsdp")) if x]
                if ours and peers:
                    r = min(o["median_step_s"] for o in ours) / min(p["median_step_s"] for p in peers)
                    out.append((wl, f"XLA:CPU ws{ws} faster of our two modes / fastest XLA peer", r, "<= 1.00",
                                r <= 1.0))
        for ws in (2, 4):  # FSDP2's API on XLA against our wrapper in the same (dim-0, per-parameter) layout
            if _in_run(rows, ("xla_fsdp_fully_shard",), ws):
                r = _ratio(_row(rows, "xla_fsdp_fully_shard", ws), _row(rows, "xla_fsdp_xla" + PER_PARAM, ws))
                out.append((wl, f"XLA:CPU ws{ws} fully_shard step time / XlaFullyShardedDataParallel per-parameter",
                            r, "<= 1.00", r is not None and r <= 1.0))
        if _in_run(rows, ("xla_fsdp",), 2):
            peers = [p for p in (_row(rows, "fsdp1", 2), _row(rows, "fsdp2", 2)) if p]
            fastest = min(peers, key=lambda p: p["median_step_s"]) if peers else None
            r = _ratio(_row(rows, "xla_fsdp", 2), fastest)
            out.append((wl, "gloo ws2 step time / faster of FSDP1, FSDP2", r, "<= 1.00", r is not None and r <= 1.0))
        for transport, label, flat_peer in (("gloo", "gloo", "fsdp1"), ("xla", "XLA:CPU", "torchxla_fsdp")):
            if transport not in data.get("ws1_interleaved", {}).get(wl, {}):
                continue
            run = data["ws1_interleaved"][wl][transport].get("contenders", {})
            ratio = {name: c["ratio_to_plain"] for name, c in run.items()}
            r = ratio.get("xla_fsdp")
            out.append((wl, f"{label} ws1 step time / unwrapped model (default per-parameter layout, "
                            "steps interleaved)", r, "<= 1.05", r is not None and r <= 1.05))
            # The flat layout pays one gradient concatenation (autograd's split backward) that an
            # unflattened model never does; the fair bar for it is the flat peer in the same process.
            r, peer = ratio.get("xla_fsdp flat"), ratio.get(flat_peer)
            out.append((wl, f"{label} ws1 step time / unwrapped model, flat layout (vs {flat_peer}, also flat)",
                        r, f"<= {peer:.3f}" if peer else "<= peer", r is not None and peer is not None and r <= peer))
        for ours in (*OURS.values(), OURS["xla"] + PER_PARAM, "xla_fsdp_spmd"):
            for ws in (2, 4):
                row = _row(rows, ours, ws)
                if row is None:
                    continue
                mem = row["state_bytes_max"] / ideal_bytes(row, kind)
                out.append((wl, f"{ours} ws{ws} persistent bytes / ideal", mem, "<= 1.02", mem <= 1.02))
                if row["collective_bytes_per_step"] is not None:
                    coll = row["collective_bytes_per_step"] / (3 * row["param_bytes"])
                    out.append((wl, f"{ours} ws{ws} collective bytes / 3x param bytes", coll, "<= 1.05", coll <= 1.05))
                if FAMILY[ours] == "xla":
                    new = row["new_compiles_after_step2"]
                    out.append((wl, f"{ours} ws{ws} XLA compilations after step 2", new, "== 0", new == 0))
    cons = data.get("consolidation")
    if cons:
        peak = cons["contenders"]["xla_fsdp streaming CLI"]["above_baseline_mib"]
        out.append(
            (
                "checkpoint",
                f"consolidation peak RSS above the interpreter's after-import RSS, MiB "
                f"({cons['checkpoint_total_mib']:.0f} MiB ckpt; bound = largest shard file + 2 x largest tensor)",
                peak,
                f"<= {cons['bound_mib']:.0f}",
                peak <= cons["bound_mib"],
            )
        )
    scale = data.get("scale")
    if scale and scale.get("xla_fsdp", {}).get("largest_params"):
        ours = scale["xla_fsdp"]["largest_params"] / 1e6
        out.append(("scale", "largest transformer at ws4, M params (FSDP2: 940 with meta init in 20 GiB, "
                             "../shared/notes/anchor_bench_results.md)", ours, ">= 940", ours >= 940))
    return out


def markdown(data: Dict) -> str:
    lines = [f"# Benchmarks {data['date']}{' (quick)' if data['quick'] else ''}", "",
             f"Machine: {data['machine']['cpus']} CPUs. Each figure: median over {data['steps']} measured steps "
             f"x {data['rounds']} round(s) after {data['warmup']} warm-up steps (one workload and world size's "
             "contenders back to back, their order reversed every other round); step time = slowest rank. "
             "`x ours` = this contender's median / xla_fsdp's at the same world size on the same transport "
             "(gloo: `xla_fsdp`, XLA:CPU: `xla_fsdp_xla`). State = params + grads + optimizer state per rank "
             "(max over ranks); ideal = total / N (so DDP shows N). SPMD runs one program for all devices: "
             "one row per run, its collectives are inserted by the compiler (not counted). `xla_plain` at ws > 1: "
             "the unwrapped model on every XLA:CPU device, each training alone with no communication at all: "
             "the floor an XLA FSDP could reach on this machine (its devices share 2 cores). Peak RSS is per "
             "process: a gloo rank is a process, but XLA:CPU ranks are threads of one process (the figure covers "
             "all of them). DDP's all-reduces run in its C++ reducer, out of the counters' sight (–).", ""]
    for wl, rows in data["rows"].items():
        kind = data["workloads"][wl]["kind"]
        spec = {k: v for k, v in data["workloads"][wl].items()
                if k in (("kind", "batch", "d_model", "layers", "heads", "vocab", "seq") if kind == "lm"
                         else ("kind", "batch", "image", "classes"))}
        lines += [
            f"## {wl}",
            "",
            "`" + ", ".join(f"{k}={v}" for k, v in spec.items()) + "` (batch per rank)",
            "",
            "| contender | transport | ws | median step s | x ours | state MiB | / ideal | peak RSS MiB per process | "
            "collective bytes / param bytes | new compiles after step 2 | last loss | status |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            fam = FAMILY[r["contender"]]
            if "median_step_s" not in r:
                lines.append(f"| {r['contender']} | {fam} | {r['ws']} | – | – | – | – | – | – | – | – | "
                             f"failed: {str(r.get('error', ''))[:160].replace('|', '/')} |")
                continue
            ours = _row(rows, ours_for(r["contender"]), r["ws"])
            coll = r["collective_bytes_per_step"]
            new = r["new_compiles_after_step2"] if fam == "xla" else None
            lines.append(
                f"| {r['contender']} | {fam} | {r['ws']} | {r['median_step_s']:.3f} | {_fmt(_ratio(r, ours), '.2f')} | "
                f"{r['state_bytes_max'] / MIB:.1f} | {r['state_bytes_max'] / ideal_bytes(r, kind):.3f} | "
                f"{r['peak_rss_mib_max']:.0f} | {_fmt(coll / r['param_bytes'] if coll is not None else None, '.2f')} | "
                f"{_fmt(new, 'd')} | {r['losses'][-1]:.4f} | ok ({r['ok_rounds']}/{r['rounds']}) |")
        lines.append("")
    if data["rounds"] > 1:
        lines += ["## Round by round", "",
                  "The pooled ratio (median over all rounds' steps) and each round's (median of that round's "
                  "steps): their spread is this machine's noise between processes.", "",
                  "| workload | ws | step time of / over | pooled | per round |", "|---|---|---|---|---|"]
        for wl, rows in data["rows"].items():
            for ws in sorted({r["ws"] for r in rows}):
                for ours, ref in ROUND_PAIRS:
                    a, b = _row(rows, ours, ws), _row(rows, ref, ws)
                    rounds = per_round_ratios(a, b, data["steps"]) if a and b else None
                    if rounds:
                        lines.append(f"| {wl} | {ws} | {ours} / {ref} | {_ratio(a, b):.3f} | "
                                     + ", ".join(f"{x:.3f}" for x in rounds) + " |")
        lines.append("")
        memory = [(wl, ws, ours, ref, _peak_ratio(a, b), [x / y for x, y in zip(a["peak_rss_mib_rounds"],
                                                                                 b["peak_rss_mib_rounds"])])
                  for wl, rows in data["rows"].items() for ws in sorted({r["ws"] for r in rows})
                  for ours, ref in MEMORY_PAIRS
                  for a, b in [(_row(rows, ours, ws), _row(rows, ref, ws))]
                  if a and b and "peak_rss_mib_rounds" in a and "peak_rss_mib_rounds" in b]
        if memory:
            lines += ["Peak memory, the same way: the ratio of the rows' medians over rounds, and each round's.", "",
                      "| workload | ws | peak memory of / over | median | per round |", "|---|---|---|---|---|"]
            lines += [f"| {wl} | {ws} | {ours} / {ref} | {r:.3f} | " + ", ".join(f"{x:.3f}" for x in rounds) + " |"
                      for wl, ws, ours, ref, r, rounds in memory]
            lines.append("")
    interleaved = data.get("ws1_interleaved")
    if interleaved:
        lines += ["## World size 1: every contender in one process, steps interleaved", "",
                  "One step of each per round, the order rotating; `x unwrapped` = median over rounds of the "
                  "step time / the unwrapped model's in the same round. Same seed and batches: losses must match.",
                  "", "| workload | transport | contender | median step s | x unwrapped | max loss diff |",
                  "|---|---|---|---|---|---|"]
        for wl, runs in interleaved.items():
            for transport, run in runs.items():
                if "contenders" not in run:
                    lines.append(f"| {wl} | {transport} | – | – | – | failed: {str(run.get('error'))[:160]} |")
                    continue
                for name, c in run["contenders"].items():
                    lines.append(f"| {wl} | {transport} | {name} | {c['median_step_s']:.3f} | "
                                 f"{c['ratio_to_plain']:.3f} | {c['max_loss_diff_to_plain']:.1e} |")
        lines.append("")
    cons = data.get("consolidation")
    if cons:
        lines += [
            f"## Consolidation of a {cons['checkpoint_total_mib']:.0f} MiB checkpoint ({cons['world_size']} ranks)",
            "",
            "| contender | seconds | peak RSS MiB | above baseline MiB |",
            "|---|---|---|---|",
        ]
        for name, c in cons["contenders"].items():
            lines.append(f"| {name} | {c['seconds']:.1f} | {c['peak_rss_mib']:.0f} | {c['above_baseline_mib']:.0f} |")
        lines.append("")
    scale = data.get("scale")
    if scale:
        lines += [
            "## Largest transformer for one AdamW step at ws 4 (gloo, process tree RSS limit "
            f"{scale.get('limit_gib', '?')} GiB{'; measured ' + scale['date'] if 'date' in scale else ''})",
            "",
            "| contender | layers (d_model 2048) | params M | result | step s | peak tree RSS GiB |",
            "|---|---|---|---|---|---|",
        ]
        for name in ("xla_fsdp", "ddp"):
            for p in scale.get(name, {}).get("probes", []):
                lines.append(f"| {name} | {p['layers']} | {p['params'] / 1e6:.0f} | {p['result']} | "
                             f"{_fmt(p.get('step_s'), '.1f')} | {_fmt(p.get('peak_tree_rss_gib'), '.2f')} |")
        lines.append("")
    floors = floor(data)
    if floors:
        lines += ["## The floor: the same model with no FSDP", "",
                  "`xla_plain` trains the unwrapped model on every XLA:CPU device with no communication: no "
                  "XLA FSDP can step faster on this machine. A step-time bound below its ratio cannot be met "
                  "by any sharding.", "",
                  "| workload | ws | xla_plain / torchxla_fsdp_perparam | xla_fsdp_xla_perparam / xla_plain |",
                  "|---|---|---|---|"]
        lines += [f"| {wl} | {ws} | {_fmt(a)} | {_fmt(b)} |" for wl, ws, a, b in floors]
        lines.append("")
    lines += ["## Targets", "", "| workload | target | measured | bound | met |", "|---|---|---|---|---|"]
    for wl, name, value, bound, met in targets(data):
        lines.append(
            f"| {wl} | {name} | {_cell(value)} | {bound} | {'yes' if met else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def is_ours(contender: str) -> bool:
    """Every contender of ours (gloo, XLA flat and per parameter, SPMD) is drawn red."""
    return contender.startswith("xla_fsdp")


def chart(data: Dict, path: str) -> None:
    """One row of panels per workload and world size: median step time on the left, peak memory
    (RSS per process) on the right, horizontal bars (ours red, peers grey) sorted by step time, so a
    reader sees at a glance who is faster and who holds less."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(wl, ws, sorted((r for r in data["rows"][wl] if "median_step_s" in r and r["ws"] == ws),
                              key=lambda r: r["median_step_s"]))
              for wl in data["rows"] for ws in sorted({r["ws"] for r in data["rows"][wl] if "median_step_s" in r})]
    tallest = max([len(rows) for _, _, rows in panels] + [1])
    fig, axes = plt.subplots(max(1, len(panels)), 2, figsize=(13, 0.9 + 0.32 * tallest * max(1, len(panels))),
                             squeeze=False)
    for (ax_step, ax_mem), (wl, ws, rows) in zip(axes, panels):
        colors = ["tab:red" if is_ours(r["contender"]) else "tab:gray" for r in rows]
        for ax, key, label in ((ax_step, "median_step_s", "median step time, s"),
                               (ax_mem, "peak_rss_mib_max", "peak memory (RSS per process), MiB")):
            ax.barh(range(len(rows)), [r[key] for r in rows], color=colors)
            ax.set_yticks(range(len(rows)))
            ax.set_yticklabels([r["contender"] for r in rows], fontsize=8)
            ax.invert_yaxis()  # fastest on top
            ax.set_xlabel(label + " (shorter is better)")
            ax.set_title(f"{wl}, world size {ws}: {label.split(' (')[0].split(',')[0]}", fontsize=10)
    fig.suptitle("xla_fsdp (red) vs peers (grey)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(data: Dict, stem: str) -> None:
    with open(stem + ".md", "w") as f:
        f.write(markdown(data))
    chart(data, stem + ".png")


def write_result(out: str, result: Dict, lines: List[str]) -> None:
    """A one-off benchmark's ``out``.json (the figures) and ``out``.md (its table), also printed."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
