"""Preemption-safe training: numbered checkpoints in one folder, and a resume that finds the newest
complete one.

``save_training_checkpoint`` writes ``{ckpt_dir}/step-{step:09d}_rank-*.pth`` (the usual sharded
checkpoint, with the step, LR scheduler, data position and RNG state in its ``extra``) and only
then, once every rank's file is in place, a marker ``step-{step:09d}.complete``. A job killed at any
moment therefore leaves at worst a checkpoint without its marker, which ``latest_checkpoint``
never picks. ``resume_training`` loads the newest complete one at any world size: the sharded load
resizes on the fly, and the step, scheduler and data position are global.
"""
from __future__ import annotations

import glob
import json
import os
import random
import re
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

import torch

from ..advice import only_warns
from .files import CheckpointError, ModelMismatchError, atomic_write, rank_path
from .folder_lock import claim
from .reader import RankFileReader
from .sharded import (LoadedCheckpoint, every_rank_calls, load_sharded_checkpoint, save_sharded_checkpoint,
                      values_over_ranks)
from ..unit.base import takes_root_unit

_MARKER = re.compile(r"step-(\d{9})\.complete")


@dataclass
class TrainingCheckpoint:
    """A complete checkpoint in a training folder: every rank's file was written."""
    prefix: str
    step: int
    world_size: int


@dataclass
class ResumedState:
    """What ``resume_training`` restored besides the model, optimizer and scheduler."""
    step: int                    # steps done: continue with this step index
    data_state: Any              # what the caller saved as its data position
    extra: Any                   # the caller's own ``extra``
    saved_world_size: int
    prefix: str
    missing_keys: List[str] = field(default_factory=list)     # strict=False: the model's names not loaded
    unexpected_keys: List[str] = field(default_factory=list)  # strict=False: the checkpoint's names not used


def step_prefix(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step-{step:09d}")


def complete_checkpoints(ckpt_dir: str) -> List[TrainingCheckpoint]:
    """Complete checkpoints in ``ckpt_dir``, oldest first (a missing folder has none)."""
    found = []
    for marker in glob.glob(os.path.join(glob.escape(ckpt_dir), "step-*.complete")):
        m = _MARKER.fullmatch(os.path.basename(marker))
        if not m:
            continue
        try:
            with open(marker) as f:
                info = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"'{marker}' is not a checkpoint marker written by xla_fsdp ({e}); "
                                  "remove it to resume from the checkpoints before it") from e
        found.append(TrainingCheckpoint(step_prefix(ckpt_dir, int(m.group(1))), int(m.group(1)),
                                        int(info["world_size"])))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(ckpt_dir: str) -> Optional[TrainingCheckpoint]:
    """The newest complete checkpoint in ``ckpt_dir``, or None."""
    found = complete_checkpoints(ckpt_dir)
    return found[-1] if found else None


def _rng_state(device: torch.device) -> Dict[str, Any]:
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        # as tensors and numbers: rank files are read with weights_only=True, which refuses arrays
        state["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    if device.type == "xla":
        import torch_xla.core.xla_model as xm
        state["xla"] = int(xm.get_rng_state(device))
    elif device.type != "cpu":  # CUDA, XPU, a PrivateUse1 device: its module's generator
        state[device.type] = torch.get_device_module(device).get_rng_state(device)
    return state


def _set_rng_state(state: Mapping[str, Any], device: torch.device, host_generators: bool) -> None:
    if host_generators:  # the CPU generators are the process's: one rank sets them
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        try:  # saved where NumPy was installed; without it here, no program draws from its generator
            import numpy as np
        except ImportError:
            np = None
        if "numpy" in state and np is not None:
            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if device.type == "xla" and "xla" in state:
        import torch_xla.core.xla_model as xm
        xm.set_rng_state(int(state["xla"]), device)
    elif device.type != "cpu" and device.type in state:
        torch.get_device_module(device).set_rng_state(state[device.type], device)


def _load_newest_sound(model, optimizer, ckpt_dir: str, strict: bool):
    """Load the newest complete checkpoint that passes its checks. A damaged one (a flipped byte, a
    truncated or missing rank file) is skipped with a warning on every rank naming the file and the
    reason, and kept for inspection as ``damaged-step-N`` (so a later save at its step does not write
    over it); the ranks agree on every failure, so all fall back together and none has loaded a
    thing from the damaged one. A sound checkpoint of another model stops the resume: an older one
    would not fit either, and none is set aside."""
    skipped = []
    for candidate in reversed(complete_checkpoints(ckpt_dir)):
        try:
            loaded = load_sharded_checkpoint(model, optimizer, candidate.prefix, strict=strict)
        except ModelMismatchError:
            raise
        except CheckpointError as e:
            skipped.append((candidate, str(e)))
            continue
        for damaged, reason in skipped:
            kept = _set_aside(model, damaged)
            warnings.warn(f"xla_fsdp: resume skipped the checkpoint '{damaged.prefix}' (step {damaged.step}): "
                          f"{reason}; resuming from step {candidate.step} instead; the damaged files are kept "
                          f"as '{kept}_rank-*' for inspection", stacklevel=3)
        return candidate, (LoadedCheckpoint(loaded, [], []) if strict else loaded)
    raise CheckpointError(f"no checkpoint in '{ckpt_dir}' can be loaded: " + "; ".join(
        f"'{c.prefix}': {reason}" for c, reason in skipped))


def _set_aside(model, damaged: TrainingCheckpoint) -> str:
    """Rename a damaged checkpoint's marker and rank files to ``damaged-step-N`` (rank 0 does it):
    neither resume nor pruning looks at those names."""
    kept = os.path.join(os.path.dirname(damaged.prefix), "damaged-" + os.path.basename(damaged.prefix))
    if model.rank == 0 and model.comms.replica_rank == 0:
        for path in glob.glob(glob.escape(damaged.prefix) + "_rank-*-of-*.pth"):
            os.replace(path, kept + path[len(damaged.prefix):])
        marker = damaged.prefix + ".complete"
        if os.path.exists(marker):
            os.replace(marker, kept + ".was-complete")
    return kept


def _threaded_ranks(model) -> bool:
    """Whether this process's ranks are threads sharing the host generators (XLA:CPU)."""
    if model.comms.device.type != "xla":
        return False
    import torch_xla.runtime as xr
    return xr.world_size() > xr.process_count()


@takes_root_unit
def save_training_checkpoint(model, optimizer: Optional[torch.optim.Optimizer], ckpt_dir: str, step: int, *,
                             lr_scheduler=None, data_state: Any = None, extra: Any = None,
                             keep: int = 2) -> TrainingCheckpoint:
    """Save the model, optimizer, scheduler, data position and RNG state as of ``step`` steps done;
    mark it complete once every rank's file is written; keep the newest ``keep`` complete ones
    (``keep=0`` keeps all). Call on every rank; ``ckpt_dir`` must be one folder every rank (every
    node) sees."""
    every_rank_calls(model, "save_training_checkpoint")
    claim(model, ckpt_dir)  # one live run per folder
    prefix = step_prefix(ckpt_dir, step)
    training = {"step": int(step), "world_size": model.world_size * model.comms.num_replicas,
                "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
                "data_state": data_state, "user": extra, "rng": _rng_state(model.comms.device)}
    save_sharded_checkpoint(model, optimizer, prefix, extra={"training_state": training})  # returns when all are in
    if model.rank == 0 and model.comms.replica_rank == 0:
        marker = prefix + ".complete"

        def write(tmp: str) -> None:
            with open(tmp, "w") as f:
                json.dump({"step": int(step), "world_size": model.world_size}, f)
        atomic_write(marker, write)
        _prune(ckpt_dir, step, keep)
    values_over_ranks(model, 0)  # every rank returns once the marker is there
    return TrainingCheckpoint(prefix, int(step), model.world_size)


def _prune(ckpt_dir: str, newest: int, keep: int) -> None:
    """Drop complete checkpoints older than the newest ``keep`` (marker first, so a crash midway
    leaves an incomplete checkpoint, never a marked one with files missing), unmarked ones older
    than the newest (a killed job's partial writes), and temporary files of killed writers."""
    complete = complete_checkpoints(ckpt_dir)
    kept = {c.step for c in complete[-keep:]} if keep > 0 else {c.step for c in complete}
    for c in complete:
        if c.step not in kept:
            os.unlink(c.prefix + ".complete")
    marked = {c.step for c in complete if c.step in kept}
    for path in glob.glob(os.path.join(glob.escape(ckpt_dir), "step-*")):
        name = os.path.basename(path)
        if name.endswith(".tmp"):  # a rank file or a marker whose writer was killed
            os.unlink(path)
        elif "_rank-" in name:
            step = int(name[len("step-"):len("step-") + 9])
            if step not in marked and step < newest:  # left by a job killed before marking it
                os.unlink(path)


@only_warns
def _warn_if_restarts_share_the_store(model) -> None:
    """torchrun restarts with its rendezvous store shared (the default) can hand a restarted rank
    its peers' addresses from the failed attempt (pytorch/pytorch#135712): the restart then fails
    to connect, and the job is lost though its checkpoints are fine."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if (restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and model.rank == 0 and model.comms.replica_rank == 0):
        warnings.warn("xla_fsdp: torchrun --max_restarts with its shared rendezvous store: a restarted job can "
                      "fail to connect (pytorch/pytorch#135712); start torchrun with "
                      "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment", stacklevel=3)


@takes_root_unit
def resume_training(model, optimizer: Optional[torch.optim.Optimizer], ckpt_dir: str, *,
                    lr_scheduler=None, strict: bool = True) -> Optional[ResumedState]:
    """Load the newest complete checkpoint of ``ckpt_dir`` (written at any world size) into the
    model, optimizer and scheduler and restore the RNG state; None when there is none yet. Call on
    every rank, after wrapping and building the optimizer (and scheduler).

    At the saved world size each rank gets its own RNG state back. At another, per-rank streams
    cannot carry over one to one: each rank's generators are seeded from the saved step and its
    rank instead (still deterministic). ``strict`` as in ``load_sharded_checkpoint``: with
    ``strict=False`` the names not loaded are in the result's ``missing_keys`` / ``unexpected_keys``."""
    every_rank_calls(model, "resume_training")
    _warn_if_restarts_share_the_store(model)
    claim(model, ckpt_dir)  # one live run per folder
    latest = latest_checkpoint(ckpt_dir)
    seen = values_over_ranks(model, latest.step + 1 if latest is not None else 0)
    if len(set(seen)) > 1:
        raise CheckpointError(f"the ranks see different checkpoints in '{ckpt_dir}' (newest step per rank: "
                              f"{[s - 1 for s in seen]}); put it on storage every node shares")
    if latest is None:
        return None
    latest, loaded = _load_newest_sound(model, optimizer, ckpt_dir, strict)
    training = (loaded.extra or {}).get("training_state")
    if training is None:
        raise CheckpointError(f"'{latest.prefix}' holds no training state; write it with save_training_checkpoint")
    if lr_scheduler is not None:
        if training["lr_scheduler"] is None:
            raise CheckpointError(f"'{latest.prefix}' holds no LR scheduler state (saved without lr_scheduler=)")
        lr_scheduler.load_state_dict(training["lr_scheduler"])
    device = model.comms.device
    flat_rank = model.comms.replica_rank * model.world_size + model.rank
    host_generators = not _threaded_ranks(model) or flat_rank == 0
    own = None
    if training["world_size"] == model.world_size * model.comms.num_replicas and model.comms.replica_rank == 0:
        own = RankFileReader(rank_path(latest.prefix, model.rank, model.world_size), verify=False)  # loaded above
        if own.metadata.get("resharded_from") is not None:  # a resize's files: each holds rank 0's RNG state
            own = None
    if own is not None:
        _set_rng_state(own.extra["training_state"]["rng"], device, host_generators)
    else:
        seed = zlib.crc32(f"{training['step']}:{flat_rank}".encode())
        if host_generators:
            torch.manual_seed(seed)
            random.seed(seed)
        if device.type == "xla":
            import torch_xla.core.xla_model as xm
            xm.set_rng_state(seed, device)
        elif device.type != "cpu":
            with torch.accelerator.device_index(device.index):
                torch.get_device_module(device).manual_seed(seed)
    return ResumedState(training["step"], training["data_state"], training["user"], training["world_size"],
                        latest.prefix, loaded.missing_keys, loaded.unexpected_keys)
