"""The largest decoder-only transformer that trains one AdamW step at world size 4 on this machine.

    python -m benchmarks.scale [--limit_gib 20] [--contenders xla_fsdp,ddp]
    python -m benchmarks.scale --contenders xla_fsdp_xla_perparam,torchxla_fsdp_perparam --name scale-xla

Layers (d_model 2048, 16 heads, seq 128, vocab 8192, batch 1 per rank) double until a run fails or
its process tree passes the RSS limit, then bisect between the last success and the first failure.
Each probe is a fresh process tree, killed when its summed RSS exceeds the limit.

- gloo (4 processes): xla_fsdp builds the model on the meta device and materializes one unit at a
  time (ZeRO-3); DDP builds the full model in every rank, as users run it.
- XLA:CPU (4 devices, threads of one process; its RSS holds every device's buffers): both XLA FSDPs
  in their default per-parameter layout, each rank building the model on the meta device and
  wrapping it with the transformer auto-wrap policy and one ``param_init_fn`` (host storage and
  ``reset_parameters``, unit by unit), as their docs show for models larger than host memory.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORLD_SIZE = 4


def workload(layers: int):
    from .workloads import Workload
    return Workload("scale", "lm", batch=1, d_model=2048, layers=layers, heads=16, vocab=8192, seq=128)


def params_of(layers: int) -> int:
    d, v, s = 2048, 8192, 128
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return v * d + s * d + layers * block + 2 * d + v * d


# ----------------------------------------------------------------------------- one rank
def _rank(rank: int, contender: str, layers: int, port: int, out: str) -> None:
    import time as _time

    import torch
    import torch.distributed as dist
    from .workloads import Block, batch, build_model, loss_fn
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    w = workload(layers)
    if contender == "xla_fsdp":
        import functools
        from xla_fsdp import XlaFullyShardedDataParallel
        from xla_fsdp.wrap import transformer_auto_wrap_policy
        with torch.device("meta"):
            model = build_model(w)
        model = XlaFullyShardedDataParallel(model, auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}))
    else:
        model = torch.nn.parallel.DistributedDataParallel(build_model(w))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = batch(w, 0, rank, 1)
    dist.barrier()
    t0 = _time.perf_counter()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    dist.barrier()
    step_s = _time.perf_counter() - t0
    from .measure import peak_rss_mib, state_bytes
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"step_s": step_s, "loss": loss.item(), "state_bytes": state_bytes(model, opt),
                   "peak_rss_mib": peak_rss_mib()}, f)
    dist.destroy_process_group()


XLA = ("xla_fsdp_xla_perparam", "torchxla_fsdp_perparam")


def _xla_rank(index: int, contender: str, layers: int, out: str) -> None:
    import time as _time

    import torch
    import torch_xla
    import torch_xla.runtime as xr
    import xla_fsdp
    from xla_fsdp.collectives.xla import install_safe_sync

    from . import contenders
    from .workloads import batch, build_model, loss_fn
    torch.set_num_threads(1)
    install_safe_sync()
    w, rank, device = workload(layers), xr.global_ordinal(), torch_xla.device()
    with _LOCK:  # the rank threads share the CPU RNG: each builds and materializes alone, seeded alike
        with torch.device("meta"):
            model = build_model(w)
        torch.manual_seed(0)
        model = contenders.wrap_xla(contender, model, w, device, param_init_fn=_init_on_host)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = batch(w, 0, rank, 1)
    barrier = _BARRIER.wait
    barrier()
    t0 = _time.perf_counter()
    contenders.new_step()
    loss = loss_fn(model(x.to(device)), y.to(device))
    loss.backward()
    opt.step()
    xla_fsdp.sync()
    value = loss.item()
    step_s = _time.perf_counter() - t0
    barrier()
    from .measure import state_bytes
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"step_s": step_s, "loss": value, "state_bytes": state_bytes(model, opt)}, f)


def _init_on_host(module) -> None:
    """param_init_fn for both XLA FSDPs: the unit's meta parameters get host storage and their
    module's own initialization; units wrapped already are real and left alone. The wrapper moves
    each unit's parameters to its device and shards them."""
    import torch
    for m in module.modules():
        meta = [n for n, p in m._parameters.items() if p is not None and p.is_meta]
        for n in meta:
            p = m._parameters[n]
            m._parameters[n] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
        if meta and hasattr(m, "reset_parameters"):
            with torch.no_grad():
                m.reset_parameters()


_LOCK = threading.Lock()
_BARRIER = threading.Barrier(WORLD_SIZE)


def _child(contender: str, layers: int, out: str) -> None:
    if contender in XLA:
        os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(WORLD_SIZE))
        import xla_fsdp  # torch_xla.launch with what several XLA:CPU devices need (torch_xla's FSDP too)
        xla_fsdp.launch(_xla_rank, args=(contender, layers, out))
        return
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(contender, layers, port, out), nprocs=WORLD_SIZE)


# ----------------------------------------------------------------------------- the search
def _tree_rss_bytes(root_pid: int) -> int:
    children: Dict[int, List[int]] = {}
    rss: Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/statm") as f:
                rss[int(entry)] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            children.setdefault(ppid, []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    total, stack = 0, [root_pid]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


def probe(contender: str, layers: int, limit_gib: float, timeout: int = 1200) -> Dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=ROOT)
    for key in ("PJRT_DEVICE", "CPU_NUM_DEVICES"):
        env.pop(key, None)
    result = {"layers": layers, "params": params_of(layers)}
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.scale", "--_child", contender, str(layers), out],
                                cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        peak, start, killed = 0, time.time(), None
        while proc.poll() is None:
            peak = max(peak, _tree_rss_bytes(proc.pid))
            if peak > limit_gib * 2**30:
                killed = f"killed: process-tree RSS {peak / 2**30:.1f} GiB > {limit_gib} GiB"
            elif time.time() - start > timeout:
                killed = f"killed: over {timeout} s"
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.5)
        err = proc.stderr.read() if proc.stderr else ""
        ranks = [json.load(open(os.path.join(out, n))) for n in sorted(os.listdir(out))]
    result["peak_tree_rss_gib"] = peak / 2**30
    if killed:
        result["result"] = killed
    elif proc.returncode != 0 or len(ranks) != WORLD_SIZE:
        result["result"] = f"failed (exit {proc.returncode}): {err.strip()[-200:]}"
    else:
        result.update(result="ok", step_s=max(r["step_s"] for r in ranks),
                      state_mib=max(r["state_bytes"] for r in ranks) / 2**20)
    return result


def search(contender: str, limit_gib: float, start: int = 1, max_layers: int = 64) -> Dict:
    """Double the layer count until failure, then bisect."""
    probes, ok, bad = [], 0, None
    layers = start
    while layers <= max_layers:
        p = probe(contender, layers, limit_gib)
        probes.append(p)
        print(f"scale {contender} layers={layers} params={p['params'] / 1e6:.0f}M: {p['result']}", flush=True)
        if p["result"] != "ok":
            bad = layers
            break
        ok, layers = layers, layers * 2
    while bad is not None and bad - ok > 1:
        mid = (ok + bad) // 2
        p = probe(contender, mid, limit_gib)
        probes.append(p)
        print(f"scale {contender} layers={mid} params={p['params'] / 1e6:.0f}M: {p['result']}", flush=True)
        ok, bad = (mid, bad) if p["result"] == "ok" else (ok, mid)
    return {"largest_layers": ok, "largest_params": params_of(ok) if ok else 0, "probes": probes}


#: where each contender's search starts (layers): near its expected limit, so few probes are spent
START = {"xla_fsdp": 8, "ddp": 1, "xla_fsdp_xla_perparam": 8, "torchxla_fsdp_perparam": 8}


def probe_all(contenders=("xla_fsdp", "ddp"), limit_gib: float = 20.0) -> Dict:
    out: Dict = {"limit_gib": limit_gib, "world_size": WORLD_SIZE, "date": datetime.date.today().isoformat()}
    for c in contenders:
        out[c] = search(c, limit_gib, start=START.get(c, 1))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_child":
        _child(argv[1], int(argv[2]), argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--limit_gib", type=float, default=20.0)
    p.add_argument("--contenders", default="xla_fsdp,ddp",
                   help=f"of xla_fsdp, ddp (gloo) and {', '.join(XLA)} (XLA:CPU)")
    p.add_argument("--name", default="", help="also write benchmarks/results/NAME.json and NAME.md")
    args = p.parse_args(argv)
    result = probe_all(tuple(args.contenders.split(",")), args.limit_gib)
    if not args.name:
        print(json.dumps(result, indent=1))
        return 0
    from .report import write_result
    lines = [f"# Largest transformer for one AdamW step at ws {WORLD_SIZE}, process-tree RSS limit "
             f"{args.limit_gib:g} GiB ({result['date']})", "",
             "`python -m benchmarks.scale --contenders " + args.contenders + f" --name {args.name}`", "",
             "| contender | largest: layers (d_model 2048) | params M |", "|---|---|---|"]
    lines += [f"| {c} | {result[c]['largest_layers']} | {result[c]['largest_params'] / 1e6:.0f} |"
              for c in args.contenders.split(",")]
    lines += ["", "Every probe:", "", "| contender | layers | params M | result | step s | peak tree RSS GiB |",
              "|---|---|---|---|---|---|"]
    for c in args.contenders.split(","):
        for p_ in result[c]["probes"]:
            step = f"{p_['step_s']:.1f}" if "step_s" in p_ else "–"
            lines.append(f"| {c} | {p_['layers']} | {p_['params'] / 1e6:.0f} | {p_['result']} | {step} | "
                         f"{p_['peak_tree_rss_gib']:.2f} |")
    write_result(os.path.join(HERE, "results", args.name), result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
