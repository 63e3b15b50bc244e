"""Can a collective run inside torch_xla 2.9's ``scan`` (an XLA While loop) on XLA:CPU? What scanned
layers under per-device FSDP need: the loop's body all-gathers layer i's shard and its backward
reduce-scatters layer i's gradient.

    python -m benchmarks.scan_collectives [--layers 4] [--devices 1 2] [--timeout 300]

Each case runs in a fresh process (a crash ends only that process) on 1 and on 2 XLA:CPU device threads:
a stack of ``--layers`` layers ``c = tanh(c @ W[i])``, each rank holding rows of every W[i], forward,
backward and a sync; its gradient (or, forward only, its output) against the same stack run eagerly on
the CPU. The all-gather is the one xla_fsdp's rank threads need, with a channel id (XLA:CPU pairs rank
threads by it): torch_xla's ``_xla_all_gather`` binding, called directly or wrapped in a
``torch.library.custom_op`` (a fake implementation for AOTAutograd, which traces scan's body) whose
backward reduce-scatters, through torch_xla's binding (it takes the device's token) or as an all-gather
and a sum (no token). The controls: scan with no collective, a custom op with no collective (a copy)
inside scan, the all-gather op in a Python loop. Writes benchmarks/results/scan_collectives.json and .md.
"""

import argparse
import datetime
import os
import subprocess
import sys
import threading
from typing import Any, Dict

from .report import write_result

HERE = os.path.dirname(os.path.abspath(__file__))

CASES = {
    "scan, no collective": "scan_plain",
    "custom op with no collective (a copy) inside scan": "scan_copy",
    "custom-op all-gather, Python loop (no scan)": "loop_gather",
    "custom-op all-gather inside scan, forward only": "scan_gather_forward",
    "custom-op all-gather inside scan": "scan_gather",
    "custom-op all-gather inside scan, backward summing an all-gather (no token)": "scan_gather_sum_by_gather",
    "all-gather binding inside scan": "scan_binding",
}


def _ops(world: int, gather_backward: bool):
    """The all-gather xla_fsdp's rank threads need (a channel id), as a custom op whose backward
    reduce-scatters: through torch_xla's reduce-scatter binding (which takes the device's token), or as an
    all-gather, a sum and this rank's rows (no token)."""
    import torch
    import torch_xla
    import torch_xla.runtime as xr
    xlac = torch_xla._XLAC
    groups = [list(range(world))]

    @torch.library.custom_op("xla_fsdp_probe::all_gather", mutates_args=())
    def all_gather(shard: torch.Tensor, channel: int) -> torch.Tensor:
        return xlac._xla_all_gather(shard, 0, world, groups, False, channel, True)

    @all_gather.register_fake
    def _(shard, channel):
        return shard.new_empty((shard.shape[0] * world,) + tuple(shard.shape[1:]))

    @torch.library.custom_op("xla_fsdp_probe::reduce_scatter", mutates_args=())
    def reduce_scatter(full: torch.Tensor, channel: int) -> torch.Tensor:
        if gather_backward:
            rows = full.shape[0] // world
            every = xlac._xla_all_gather(full, 0, world, groups, False, channel, True)
            summed = every.view((world,) + tuple(full.shape)).sum(0)
            return summed[xr.global_ordinal() * rows:(xr.global_ordinal() + 1) * rows].clone()
        token = xlac._get_all_reduce_token(xlac._xla_get_default_device())
        return xlac._xla_reduce_scatter("sum", full, token, 1.0, 0, world, groups, False, channel, True)[0]

    @reduce_scatter.register_fake
    def _(full, channel):
        return full.new_empty((full.shape[0] // world,) + tuple(full.shape[1:]))

    def backward(ctx, grad):
        return reduce_scatter(grad.contiguous(), ctx.channel + 1), None

    def setup(ctx, inputs, output):
        ctx.channel = inputs[1]

    all_gather.register_autograd(backward, setup_context=setup)

    @torch.library.custom_op("xla_fsdp_probe::copy", mutates_args=())
    def copy(w: torch.Tensor) -> torch.Tensor:  # the same kind of op with no collective: the control
        return w.clone()

    @copy.register_fake
    def _(w):
        return w.new_empty(w.shape)

    copy.register_autograd(lambda ctx, grad: grad.clone())
    return all_gather, copy


_LOCK = threading.Lock()  # torch_xla's scan traces with dynamo's compile metrics, one set per process
_OPS: Dict[str, Any] = {}


def _say(error: float) -> None:
    sys.stdout.write(f"OK {error}\n")  # one write: whole lines from the rank threads
    sys.stdout.flush()


def _rank(index: int, mode: str, layers: int) -> None:
    """One rank thread of a case: prints ``OK <max error>``. Each rank holds rows of every layer's
    weight; the gradient of its rows is compared with the unsharded stack's times the world size (every
    rank's loss is the same sum, and the reduce-scatter sums them)."""
    import torch
    import torch_xla
    import torch_xla.runtime as xr
    from torch_xla.experimental.scan import scan
    world = xr.world_size()
    with _LOCK:
        if "ops" not in _OPS:
            _OPS["ops"] = _ops(world, "sum_by_gather" in mode)
    all_gather, copy = _OPS["ops"]
    n = 8
    weights = torch.randn(layers, n, n, generator=torch.Generator().manual_seed(0)) * 0.3
    x = torch.randn(2, n, generator=torch.Generator().manual_seed(1))
    c = x
    reference = weights.clone().requires_grad_()
    for i in range(layers):
        c = torch.tanh(c @ reference[i])
    c.sum().backward()
    dev, r = torch_xla.device(), xr.global_ordinal()
    whole = mode in ("scan_plain", "scan_copy")  # no gather: every rank holds whole layers
    rows = slice(None) if whole else slice(r * n // world, (r + 1) * n // world)
    stack = weights[:, rows].clone().to(dev).requires_grad_()

    def body(carry, w):
        if mode.startswith("scan_gather"):
            w = all_gather(w, 7)
        elif mode == "scan_copy":
            w = copy(w)
        elif mode == "scan_binding":
            w = torch_xla._XLAC._xla_all_gather(w, 0, world, [list(range(world))], False, 7, True)
        return torch.tanh(carry @ w), None

    if mode == "scan_gather_forward":
        with torch.no_grad(), _LOCK:
            out, _ = scan(body, x.to(dev), stack)
        torch_xla.sync()
        _say((out.cpu() - c).abs().max().item())  # the output's error: no gradient
        return
    if mode == "loop_gather":
        out = x.to(dev)
        for i in range(layers):
            out = torch.tanh(out @ all_gather(stack[i], 7 + 2 * i))
    else:
        with _LOCK:
            out, _ = scan(body, x.to(dev), stack)
    out.sum().backward()
    torch_xla.sync()
    expected = reference.grad[:, rows] * (1 if whole else world)
    _say((stack.grad.cpu() - expected).abs().max().item())


def run_case(mode: str, devices: int, layers: int, timeout: int) -> Dict[str, Any]:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.scan_collectives", "--case", mode,
                               "--layers", str(layers)], cwd=os.path.dirname(HERE), env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"outcome": f"no result in {timeout} s", "exit": None}
    said = [line for line in done.stdout.splitlines() if line.startswith("OK ")]
    if done.returncode == 0 and len(said) == devices:
        return {"outcome": "runs", "exit": 0, "max_error": max(float(line.split()[1]) for line in said)}
    errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
    if "BrokenProcessPool" in (errors or [""])[-1]:
        errors.append("a device process ended abruptly (BrokenProcessPool)")
    tail = errors[-1] if errors else (done.stderr.strip().splitlines() or [""])[-1]
    signal = -done.returncode if done.returncode < 0 else None
    return {"outcome": f"killed by signal {signal}" if signal else f"exit {done.returncode}",
            "exit": done.returncode, "error": tail[:300]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="XLA:CPU device threads per case")
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--case", choices=sorted(CASES.values()), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "scan_collectives"))
    args = parser.parse_args()
    if args.case:
        if os.environ.get("CPU_NUM_DEVICES") == "1":  # in this process: a crash shows as its signal
            _rank(0, args.case, args.layers)
            return
        import xla_fsdp
        xla_fsdp.launch(_rank, args=(args.case, args.layers))
        return
    import torch
    import torch_xla
    rows = {f"{label}, {devices} device{'s' if devices > 1 else ''}": run_case(mode, devices, args.layers, args.timeout)
            for devices in args.devices for label, mode in CASES.items()}
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "torch_xla": torch_xla.__version__, "layers": args.layers, "cases": rows}
    lines = [f"# Collectives inside torch_xla's scan on XLA:CPU ({args.layers} layers, "
             f"torch {torch.__version__}, torch_xla {torch_xla.__version__})", "",
             "| case | outcome | max error (gradient; output where forward only) | error |", "|---|---|---|---|"]
    for label, r in rows.items():
        err = r.get("max_error")
        lines.append(f"| {label} | {r['outcome']} | {'' if err is None else f'{err:.1e}'} | "
                     f"{r.get('error', '').replace('|', '/')} |")
    write_result(args.out, result, lines)


if __name__ == "__main__":
    main()
