"""One live run per training folder: ``save_training_checkpoint`` and ``resume_training`` claim their
folder with a lock file naming the run (run id, host, pid, start time), so a second run given the same
folder stops with that run named instead of pruning and overwriting the first one's checkpoints.

A lock whose run is gone is taken over: its process is dead on this host, or it names this job's run
id (``TORCHELASTIC_RUN_ID``: torchrun's restarts of one job, on any host). A lock of a live run, or of
a run on another host that cannot be checked, is refused with the way out. The lock goes at exit.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import time
import uuid
import warnings
from typing import Dict, Optional, Set

LOCK_NAME = ".xla_fsdp-run.lock"
_PROCESS_RUN = uuid.uuid4().hex[:12]
_OWNED: Dict[str, str] = {}  # folder (realpath) -> lock file this process wrote
_CLAIMED: Set[str] = set()  # folders this process's run holds (every rank keeps the set)


def _identity() -> Dict[str, object]:
    return {"run_id": os.environ.get("TORCHELASTIC_RUN_ID") or _PROCESS_RUN, "host": socket.gethostname(),
            "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: str) -> Optional[Dict[str, object]]:
    for _ in range(20):  # a lock being written by its creator at this moment: read it again
        try:
            with open(path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except ValueError:
            time.sleep(0.05)
    return {"run_id": "?", "host": "?", "pid": -1, "since": "?"}


def try_claim(ckpt_dir: str) -> Optional[str]:
    """Claim ``ckpt_dir`` for this run (one process per run calls this); the refusal, or None."""
    real = os.path.realpath(ckpt_dir)
    if real in _OWNED:
        return None
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, LOCK_NAME)
    me = _identity()
    for _ in range(5):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            owner = _read(path)
            if owner is None:
                continue  # released meanwhile
            same_run = owner.get("run_id") == me["run_id"] or owner.get("pid") == me["pid"] and owner.get(
                "host") == me["host"]
            dead = owner.get("host") == me["host"] and isinstance(owner.get("pid"), int) and not _alive(owner["pid"])
            if not (same_run or dead):
                return (f"the checkpoint folder '{ckpt_dir}' is in use by another run (run id {owner.get('run_id')}, "
                        f"host {owner.get('host')}, pid {owner.get('pid')}, since {owner.get('since')}; lock "
                        f"'{path}'): give this run its own folder, or stop that one. A lock whose process has "
                        "died is taken over on its host; from another host, delete the lock once that run is gone")
            if dead and not same_run:
                warnings.warn(f"xla_fsdp: took over '{path}' from a run that is gone (run id {owner.get('run_id')}, "
                              f"pid {owner.get('pid')} no longer runs on {owner.get('host')})", stacklevel=4)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            continue  # two takers: O_EXCL lets one of them in
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        if not _OWNED:
            atexit.register(_release_all)
        _OWNED[real] = path
        return None
    return f"could not claim the checkpoint folder '{ckpt_dir}': its lock '{path}' keeps changing hands"


def claim(model, ckpt_dir: str) -> None:
    """Every rank: the run's first rank claims ``ckpt_dir``; all raise its refusal together."""
    from .files import CheckpointError
    from .sharded import messages_over_ranks
    real = os.path.realpath(ckpt_dir)
    if real in _CLAIMED:
        return
    first = model.rank == 0 and model.comms.replica_rank == 0
    refusals = messages_over_ranks(model, try_claim(ckpt_dir) if first else None)
    refusal = next((r for r in refusals if r is not None), None)
    if refusal is not None:
        raise CheckpointError(refusal)
    _CLAIMED.add(real)


def _release_all() -> None:
    for path in list(_OWNED.values()):
        owner = _read(path) or {}
        if owner.get("pid") == os.getpid():
            try:
                os.unlink(path)
            except OSError:
                pass
    _OWNED.clear()
