"""One live run per training folder: ``save_training_checkpoint`` and ``resume_training`` claim their
folder with a lock file naming the run (run id, host, pid, start time), so a second run given the same
folder stops with that run named instead of pruning and overwriting the first one's checkpoints.

A lock whose run is gone is taken over: on this host, when its process no longer runs (pid and start
time); from another host, when it names this job's run id (``TORCHELASTIC_RUN_ID``: torchrun's restarts
of one job). A live holder on this host is never taken over, whatever the ids say: torchrun's default
``--rdzv_id`` is "none", so two separate jobs share that id. A lock of a live run, or of a run on
another host that cannot be checked, is refused with the way out. The lock goes at exit.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
import warnings
from typing import Dict, Optional, Set

from .. import patches
from ..unit.base import takes_root_unit

LOCK_NAME = ".xla_fsdp-run.lock"
_PROCESS_RUN = uuid.uuid4().hex[:12]
_OWNED: Dict[str, str] = {}  # folder (realpath) -> lock file this process wrote
_CLAIMED: Set[str] = set()  # folders this process's run holds (every rank keeps the set)


def _identity() -> Dict[str, object]:
    return {"run_id": os.environ.get("TORCHELASTIC_RUN_ID") or _PROCESS_RUN, "host": socket.gethostname(),
            "pid": os.getpid(), "pid_start": _start_time(os.getpid()), "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _start_time(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot, Linux), telling a reused pid from its
    first holder; None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, start: Optional[int] = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return start is None or _start_time(pid) in (None, start)


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
            here = owner.get("host") == me["host"] and isinstance(owner.get("pid"), int)
            mine = here and owner.get("pid") == me["pid"]
            dead = here and not mine and not _alive(owner["pid"], owner.get("pid_start"))
            same_run = owner.get("run_id") == me["run_id"]
            # on this host the holder's process decides; from another host only the run id can
            if not (mine or dead or (same_run and not here)):
                shared_id = (f" The run ids are the same ({me['run_id']}) but that run's process is alive: separate "
                             "torchrun jobs share an id when not given --rdzv_id (its default is 'none')"
                             if same_run else "")
                return (f"the checkpoint folder '{ckpt_dir}' is in use by another run (run id {owner.get('run_id')}, "
                        f"host {owner.get('host')}, pid {owner.get('pid')}, since {owner.get('since')}; lock "
                        f"'{path}'): give this run its own folder, or stop that one.{shared_id} A lock whose "
                        "process has died is taken over on its host; from another host, delete the lock once that "
                        "run is gone")
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
        patches.at_exit("atexit: xla_fsdp releases its checkpoint folder locks", _release_all,
                        "a run that ends normally leaves its training folders free for the next run")
        _OWNED[real] = path
        return None
    return f"could not claim the checkpoint folder '{ckpt_dir}': its lock '{path}' keeps changing hands"


@takes_root_unit
def claim(model, ckpt_dir: str) -> None:
    """Every rank: the run's first rank claims ``ckpt_dir``; all raise its refusal together."""
    from .files import CheckpointError
    from .sharded import messages_over_ranks
    real = os.path.realpath(ckpt_dir)
    if real in _CLAIMED:
        return
    first = model.rank == 0 and model.comms.replica_rank == 0
    refusal = None
    if first:
        try:
            refusal = try_claim(ckpt_dir)
        except OSError as e:  # a read-only or missing folder: every rank says so, none waits for this one
            refusal = (f"cannot claim the checkpoint folder '{ckpt_dir}' for this run: {e.strerror or e} "
                       f"('{e.filename or ckpt_dir}'): training checkpoints need a folder this run can write; "
                       "to start from a read-only checkpoint, copy it into one")
    refusals = messages_over_ranks(model, refusal)
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
