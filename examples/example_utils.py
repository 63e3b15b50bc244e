"""What every example needs: start ranks on the right transport, and report what a step cost.

``launch(fn, args)`` runs ``fn(ctx, args)`` on every rank: under ``torchrun`` (or with
``--transport torch``) over gloo; otherwise on XLA through ``torch_xla.launch`` (TPU when
PJRT_DEVICE=TPU, else ``args.num_devices`` XLA:CPU devices so sharding is real on a laptop).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from xla_fsdp.cli.parser import ArgumentParser  # noqa: E402  (--ckpt-prefix read as --ckpt_prefix)

ON_TPU = os.environ.get("PJRT_DEVICE", "").upper() == "TPU"


@dataclass
class RankContext:
    rank: int
    world_size: int
    device: torch.device
    sync: Callable[[], None]
    transport: str

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def log(self, *msg) -> None:
        if self.is_master:
            print(*msg, flush=True)

    def mean(self, value: float) -> float:
        """The mean of a number over every rank (every rank must call it)."""
        if self.world_size == 1:
            return value
        if self.transport == "torch":
            import torch.distributed as dist
            total = torch.tensor([value], dtype=torch.float64)
            dist.all_reduce(total)
            return total.item() / self.world_size
        import torch_xla.core.xla_model as xm
        return float(xm.mesh_reduce("example mean", value, lambda values: sum(values) / len(values)))


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every flag's default in --help."""

    def _get_help_string(self, action):
        text = (action.help or "").strip()
        shown = action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
        if shown and "%(default)" not in text:
            text += (" " if text else "") + "(default: %(default)s)"
        return text


class ExampleParser(ArgumentParser):
    """An example's flags: defaults shown in --help; a bad flag is one line, exit 2, before anything
    starts (no rank is launched, no folder created)."""

    def __init__(self, description: str):
        super().__init__(description=description, formatter_class=_Formatter)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if not action.help and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            action.help = "(default: %(default)s)"  # argparse formats nothing for a flag without help
        return action

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def at_least(minimum, kind=int):
    """An argparse type: a ``kind`` number >= ``minimum``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "whole number" if kind is int else "number"
            raise argparse.ArgumentTypeError(f"{text!r} is not a {what}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (a learning rate, a size)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"there is no file '{text}'")
    return text


def add_launch_flags(parser) -> None:
    parser.add_argument("--transport", choices=["xla", "torch"],
                        default="torch" if "TORCHELASTIC_RUN_ID" in os.environ else "xla",
                        help="xla: torch_xla.launch (TPU or XLA:CPU); torch: gloo (default under torchrun)")
    parser.add_argument("--num_devices", type=at_least(1), default=None,
                        help="XLA:CPU devices when there is no TPU (default 2); with --transport torch, start "
                             "ranks with torchrun --nproc_per_node N instead")


_RNG_LOCK = threading.Lock()


@contextlib.contextmanager
def seeded(seed: int):
    """Seed torch's CPU generator and keep it to this rank while building a model. XLA:CPU ranks
    are threads of one process sharing that generator: ranks building at once drew each other's
    numbers, so initial weights (and results) changed from run to run."""
    with _RNG_LOCK:
        torch.manual_seed(seed)
        yield


def _xla_entry(index, fn, args):
    import torch_xla
    import torch_xla.runtime as xr

    import xla_fsdp
    ctx = RankContext(xr.global_ordinal(), xr.world_size(), torch_xla.device(), xla_fsdp.sync, "xla")
    fn(ctx, args)


def launch(fn: Callable[[RankContext, object], None], args) -> None:
    if args.transport == "torch" and args.num_devices is not None:
        world = os.environ.get("WORLD_SIZE", "1")
        if str(args.num_devices) != world:
            raise SystemExit(
                f"error: --num_devices {args.num_devices} sets XLA:CPU devices, but --transport torch runs "
                f"{world} gloo rank(s) as started: run torchrun --nproc_per_node {args.num_devices} "
                f"{os.path.basename(sys.argv[0])} --transport torch (without --num_devices)"
            )
    if args.transport == "torch":
        import torch.distributed as dist

        from xla_fsdp.checkpoints import CheckpointError
        if "RANK" not in os.environ:  # plain `python ...`: a one-rank group
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
        try:
            fn(RankContext(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), lambda: None, "torch"), args)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise SystemExit(130) from None
        except CheckpointError as e:  # a problem with the user's files: one line, not a traceback
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        finally:
            # and free what still holds a group: gloo's threads stop only when the group object goes,
            # and one still releasing a collective's tensors as Python exits aborts the process
            # (pytorch/pytorch#190489); fn's model is out of scope by now
            dist.destroy_process_group()
            gc.collect()
        return
    if not ON_TPU:
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        os.environ.setdefault("CPU_NUM_DEVICES", str(args.num_devices or 2))
    import xla_fsdp
    from xla_fsdp.checkpoints import CheckpointError
    try:
        xla_fsdp.launch(_xla_entry, args=(fn, args))  # torch_xla.launch, with what XLA:CPU devices need
    except KeyboardInterrupt:  # the device processes stopped (xla_fsdp removed unfinished files)
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def state_bytes(model, optimizer) -> dict:
    """Bytes this rank holds for parameters, gradients and optimizer state."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    opt = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
              if isinstance(t, torch.Tensor))
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": opt}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compilations(ctx: RankContext) -> int:
    if ctx.transport != "xla":
        return 0
    import torch_xla.debug.metrics as met
    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0
