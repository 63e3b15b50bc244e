"""Save and load this rank's part of a checkpoint, in torch_xla's documented per-rank layout."""
from __future__ import annotations

import glob
import os
import threading
import warnings
import weakref
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Union

import torch

from .reader import RankFileReader
from .resized_load import ResizedLoad, needs_resizing
from .files import (RANK_FILE, CheckpointError, rank_path, stored_bytes)
from .rank_writer import RankFileWriter
from ..unit.base import takes_root_unit


def _to_host(obj: Any, staging: Optional[Dict[tuple, torch.Tensor]] = None, path: tuple = ()) -> Any:
    """Tensors of a (nested) state dict on the host. Without ``staging`` a CPU tensor is returned
    as it is (a blocking save writes it before training goes on); with it, every tensor is copied
    into the buffer kept there from the previous save of this model (allocated the first time), so
    the snapshot of an async save costs a copy, not fresh memory, each time."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if staging is None:
            t = t.cpu()
            compact = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            return t if compact else t.clone()  # a view's own bytes, in a storage of their size
        buffer = staging.get(path)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = staging[path] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        buffer.copy_(t)
        return buffer
    if isinstance(obj, dict):
        return {k: _to_host(v, staging, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v, staging, path + (i,)) for i, v in enumerate(obj))
    return obj


def every_rank_calls(model, call: str) -> None:
    """Meet the job's other ranks at ``call`` before its first collective: a rank that never comes
    (a save under ``if rank == 0:``) is named in one error, where the first collective would abort
    the process on gloo's mismatch or wait on a peer that is gone."""
    late, timeout = model.comms.meet(call)
    if late:
        raise CheckpointError(f"{call} is called on every rank (each writes or reads its own shards), but ranks {late} "
                              f"did not call it within the job's timeout ({timeout:.0f} s): a call under "
                              "`if rank == 0:` is the usual cause; call it on every rank")


def _agree_on_run_id(model) -> str:
    """A random id chosen by rank 0 and shared with all ranks, so files of one save match."""
    comms = model.comms
    # os.urandom, not torch's RNG: seeded runs would otherwise reuse the same id.
    words = [int.from_bytes(os.urandom(4), "little") >> 1 for _ in range(2)] if comms.rank == 0 else [0, 0]
    mine = torch.tensor(words, dtype=torch.int32)
    gathered = model.gather_over_ranks(mine)
    comms.sync()
    first = gathered.cpu()[:2].tolist()
    return f"{first[0]:08x}{first[1]:08x}"


@takes_root_unit
def optimizer_param_keys(model, optimizer) -> list:
    """The shard key of each of ``optimizer``'s parameters, in its order: what a rank file written
    with plain ``torch.save`` needs in ``shard_metadata['optimizer_param_keys']`` to be resized or
    consolidated with optimizer state when the optimizer was built from parameter groups."""
    names = {id(p): n for n, p in model.named_parameters()}
    keys = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError("the optimizer holds a parameter that is not a shard of this model; "
                                      "build the optimizer from the wrapped model's parameters()")
            keys.append(names[id(p)])
    return keys


@takes_root_unit
def save_sharded_checkpoint(model, optimizer: Optional[torch.optim.Optimizer], ckpt_prefix: str,
                            extra: Optional[Mapping[str, Any]] = None,
                            blocking: bool = True) -> Union[str, "PendingSave"]:
    """Write ``{prefix}_rank-RRRRRRRR-of-WWWWWWWW.pth`` for this rank, atomically (creating the
    prefix's folder if needed); returns its path, or with ``blocking=False`` a :class:`PendingSave`.

    Call on every rank. Holds ``{'model', 'shard_metadata', 'optimizer'}`` (plus ``'extra'``); the
    metadata carries CRC32 checksums of every tensor. The shards are copied to host memory first;
    with ``blocking=False`` the checksums and the write then run in a background thread while
    training goes on, and ``wait()`` (called by the next save or load at the latest) returns once
    every rank's file is in place. A failed write raises on every rank, at the return or at ``wait()``.
    """
    every_rank_calls(model, "save_sharded_checkpoint")
    previous = _PENDING.pop(model, None)
    if previous is not None:
        previous.wait()  # one save at a time: the next waits for the previous
    run_id = _agree_on_run_id(model)
    model.comms.sync()
    metadata = model.get_shard_metadata()
    # async: a snapshot on the host (training changes the shards meanwhile), in buffers reused across saves
    staging = None if blocking else _STAGING.setdefault(model, {})
    state = _to_host(model.state_dict(), staging, ("model",))
    osd = _to_host(optimizer.state_dict(), staging, ("optimizer",)) if optimizer is not None else None
    metadata["run_id"] = run_id
    if optimizer is not None:
        metadata["optimizer_param_keys"] = optimizer_param_keys(model, optimizer)
    ckpt: Dict[str, Any] = {"model": state, "shard_metadata": metadata, "optimizer": osd}
    if extra is not None:
        ckpt["extra"] = dict(extra)
    path = rank_path(ckpt_prefix, model.rank, model.world_size)
    pending = PendingSave(model, ckpt_prefix, path, ckpt)
    if blocking:
        pending.run()
        return pending.wait()
    pending.start()
    _PENDING[model] = pending
    return pending


_PENDING: "weakref.WeakKeyDictionary[Any, PendingSave]" = weakref.WeakKeyDictionary()
_STAGING: "weakref.WeakKeyDictionary[Any, Dict[tuple, torch.Tensor]]" = weakref.WeakKeyDictionary()


class PendingSave:
    """A save whose host copy is being checksummed and written (``blocking=False``)."""

    def __init__(self, model, ckpt_prefix: str, path: str, ckpt: Dict[str, Any]):
        self._model, self.prefix, self.path = model, ckpt_prefix, path
        self._ckpt: Optional[Dict[str, Any]] = ckpt
        self._error: Optional[BaseException] = None
        self._tmp: Optional[RankFileWriter] = None  # written, named once every rank's file is
        self._thread: Optional[threading.Thread] = None
        self._finished = False

    def run(self) -> None:
        """Checksum and write this rank's file (in the calling thread)."""
        writer = None
        try:
            ckpt, self._ckpt = self._ckpt, None
            # Hybrid/NO_SHARD: replicas hold identical shards; only the first copy of each is written.
            if self._model.comms.replica_rank == 0:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)  # as DCP, make ckpt/
                writer = RankFileWriter(self.path, stored_bytes(ckpt))
                for key, value in ckpt["model"].items():
                    writer.add_model(key, value)
                if ckpt["optimizer"] is not None:
                    writer.set_optimizer(ckpt["optimizer"])
                if "extra" in ckpt:
                    writer.set_extra(ckpt["extra"])
                writer.write(ckpt["shard_metadata"])
                self._tmp, writer = writer, None
        except CheckpointError as e:  # reported on every rank by wait()
            self._error = e
        except Exception as e:
            self._error = CheckpointError(f"could not write '{self.path}': {type(e).__name__}: {e}")
            self._error.__cause__ = e
        except BaseException as e:  # KeyboardInterrupt, SystemExit: raised again by wait()
            self._error = e
        finally:
            if writer is not None:
                writer.discard()

    def start(self) -> None:
        # not a daemon: a process that ends while saving finishes the file first
        self._thread = threading.Thread(target=self.run, name=f"xla_fsdp save {self.path}")
        self._thread.start()

    def done(self) -> bool:
        """Whether this rank's write has ended (``wait()`` still joins the ranks)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        """Block until every rank's file is written; returns this rank's path. Call on every rank."""
        if self._finished:
            return self.path
        if self._thread is not None:
            self._thread.join()
        self._finished = True
        if _PENDING.get(self._model) is self:
            del _PENDING[self._model]
        model = self._model
        # Every rank's file is written under a temporary name first; they take their names only
        # when all are written, so a failed save leaves the checkpoint at this prefix as it was.
        errors = messages_over_ranks(model, _one_line(self._error) if self._error is not None else None)
        failed = [r for r, e in enumerate(errors) if e is not None]
        if failed:
            if self._tmp is not None:
                self._tmp.discard()
            _replica_barrier(model)
            if self._error is not None and not isinstance(self._error, Exception):
                raise self._error  # KeyboardInterrupt, SystemExit
            first = failed[0]
            where = "this rank" if first == _flat_rank(model) else f"rank {first}"
            also = f" (ranks {failed} failed)" if len(failed) > 1 else ""
            raise CheckpointError(f"the save to '{self.prefix}' failed on {where}{also}: {errors[first]}; no rank's "
                                  "file was replaced") from self._error
        error = None
        if self._tmp is not None:
            try:
                self._tmp.commit()
            except OSError as e:
                error = e
            self._tmp = None
        failed = _ranks_that_failed(model, error is not None)  # also the barrier: every file is in place
        _replica_barrier(model)
        if failed:
            raise CheckpointError(f"the save to '{self.prefix}' failed on rank {failed[0]} while naming its file"
                                  + (f": {error}" if error is not None else "")) from error
        if model.rank == 0 and model.comms.replica_rank == 0:
            _remove_other_world_sizes(self.prefix, model.world_size)
        return self.path


def _one_line(error: BaseException) -> str:
    text = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
    return " ".join(text.split())


def _remove_other_world_sizes(ckpt_prefix: str, world_size: int) -> List[str]:
    """A save replaces the checkpoint at its prefix. Rank files that an earlier run with another
    world size left there (an example re-run with another device count) would make the prefix a
    mix that no tool can read ("different world sizes"): once the new set is complete, they go."""
    stale = []
    for path in glob.glob(glob.escape(ckpt_prefix) + "_rank-*-of-*.pth"):
        m = RANK_FILE.fullmatch(path[len(ckpt_prefix):])
        if m and int(m.group(2)) != world_size:
            os.unlink(path)
            stale.append(os.path.basename(path))
    if stale:
        warnings.warn(f"xla_fsdp: the save to '{ckpt_prefix}' (world size {world_size}) replaced an older checkpoint "
                      f"there of another world size: removed {', '.join(sorted(stale))}", stacklevel=3)
    return stale


def _replica_barrier(model) -> None:
    if model.comms.num_replicas > 1:
        token = torch.zeros(1).to(model.comms.device)
        model.sum_over_replicas(token)
        model.comms.sync()


def _check_matches_model(path: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    if saved.get("world_size") != current["world_size"]:
        raise CheckpointError(f"'{path}' was written for world size {saved.get('world_size')}, this run has "
                              f"{current['world_size']}; resize it first: python -m xla_fsdp.resize "
                              f"--ckpt_prefix PREFIX --world_size {current['world_size']} --out_prefix NEW")
    if saved.get("rank") != current["rank"]:
        raise CheckpointError(f"'{path}' holds the shards of rank {saved.get('rank')} of {saved.get('world_size')} "
                              f"(its metadata says so), but rank {current['rank']} reads it: the rank files were "
                              "renamed or copied over each other; name each file after the rank its metadata gives "
                              "(python -m xla_fsdp.inspect --ckpt_prefix PREFIX lists them)")
    s_layout, c_layout = saved.get("layout", {}), current["layout"]
    if set(s_layout) != set(c_layout):
        diff = sorted(set(s_layout) ^ set(c_layout))[:3]
        raise CheckpointError(f"'{path}' does not match the model: shard keys differ (e.g. {diff}); the model "
                              "must be wrapped exactly as when the checkpoint was saved")
    for key, info in c_layout.items():
        other = s_layout[key]
        if other["names"] != info["names"] or other["shapes"] != info["shapes"] or other["mode"] != info["mode"]:
            raise CheckpointError(f"'{path}' does not match the model at '{key}': saved {other['names']} "
                                  f"{other['shapes']} ({other['mode']}), model {info['names']} {info['shapes']} "
                                  f"({info['mode']})")


class LoadedCheckpoint(NamedTuple):
    """What ``load_sharded_checkpoint(..., strict=False)`` returns: the saved ``extra`` and, as
    ``load_state_dict``'s result, the model's names the checkpoint lacks (they kept their values)
    and the checkpoint's names the model lacks (not loaded)."""
    extra: Optional[dict]
    missing_keys: List[str]
    unexpected_keys: List[str]


@takes_root_unit
def load_sharded_checkpoint(model, optimizer: Optional[torch.optim.Optimizer], ckpt_prefix: str, *,
                            strict: bool = True) -> Union[Optional[dict], LoadedCheckpoint]:
    """Load a sharded checkpoint into ``model`` (and ``optimizer``), after checking it; returns ``extra``.

    Call on every rank. A checkpoint of this world size and wrapping is read file for file; one of
    another world size (or another wrapping of the same model) is resized while loading, each
    rank reading only the slices its shards need (see ``resized_load``). Each rank reads and
    checks first; then the ranks agree, and if any rank failed, every rank raises (naming the
    files) before any loads a thing, rather than one rank failing while the others train on from
    the checkpoint or wait for it.

    Strict as ``load_state_dict``: a parameter or buffer that only the model or only the checkpoint
    has is a ``ModelMismatchError`` naming them. ``strict=False`` loads the names both have, the
    rest of the model keeps its values, and a ``LoadedCheckpoint(extra, missing_keys,
    unexpected_keys)`` is returned instead of ``extra``."""
    every_rank_calls(model, "load_sharded_checkpoint")
    previous = _PENDING.pop(model, None)
    if previous is not None:
        previous.wait()
    ckpt, resized, error = None, None, None
    try:
        own = _own_metadata(model, ckpt_prefix)
        if own is not None and not needs_resizing(ckpt_prefix, model, own):
            ckpt = _read_checked(model, optimizer, rank_path(ckpt_prefix, model.rank, model.world_size), ckpt_prefix)
        elif own is not None or not _has_files_of_world_size(ckpt_prefix, model.world_size):
            resized = _read_resized(model, optimizer, ckpt_prefix, strict)
        else:  # this world size's set lacks this rank's file
            ckpt = _read_checked(model, optimizer, rank_path(ckpt_prefix, model.rank, model.world_size), ckpt_prefix)
    except CheckpointError as e:
        error = e
    errors = messages_over_ranks(model, _one_line(error) if error is not None else None)
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        if resized is not None:
            resized[0].close()
        if error is not None:
            others = [r for r in failed if r != _flat_rank(model)]
            raise type(error)(f"{error}" + (f" (ranks {others} failed too)" if others else "")) from error
        first = failed[0]
        also = f"; ranks {failed} failed" if len(failed) > 1 else ""
        raise CheckpointError(f"the checkpoint '{ckpt_prefix}' cannot be loaded: rank {first} failed: {errors[first]}"
                              f"{also}; no rank has loaded anything")
    if ckpt is not None:
        _check_one_save(model, ckpt_prefix, ckpt["shard_metadata"].get("run_id"))
    if resized is not None:
        source, plan = resized
        try:
            source.apply(plan, model, optimizer)
            extra, missing, unexpected = source.extra(), plan["missing"], plan["unexpected"]
        finally:
            source.close()
    else:
        model.load_state_dict(ckpt["model"])
        if optimizer is not None:
            optimizer.load_state_dict(ckpt["optimizer"])
        extra, missing, unexpected = ckpt.get("extra"), [], []
    return extra if strict else LoadedCheckpoint(extra, missing, unexpected)


def _check_one_save(model, ckpt_prefix: str, run_id: Optional[str]) -> None:
    """Every rank read a file of the same save: a file copied in from another save passes its own
    checks (checksums, layout, rank) but would load another step's shards beside this one's."""
    ids = messages_over_ranks(model, str(run_id))
    if len(set(ids)) > 1:
        by_id: Dict[str, List[int]] = {}
        for r, i in enumerate(ids):
            by_id.setdefault(i, []).append(r)
        raise CheckpointError(f"the rank files of '{ckpt_prefix}' come from different saves (run id by rank: "
                              + ", ".join(f"{i}: ranks {rs}" for i, rs in by_id.items())
                              + "); no rank has loaded anything: restore the set of one save")


def _has_files_of_world_size(ckpt_prefix: str, world_size: int) -> bool:
    for path in glob.glob(glob.escape(ckpt_prefix) + "_rank-*-of-*.pth"):
        m = RANK_FILE.fullmatch(path[len(ckpt_prefix):])
        if m and int(m.group(2)) == world_size:
            return True
    return False


def _own_metadata(model, ckpt_prefix: str) -> Optional[Dict[str, Any]]:
    """The metadata of this rank's file at the model's world size, if there is one (memory-mapped:
    only the metadata is read)."""
    path = rank_path(ckpt_prefix, model.rank, model.world_size)
    if not os.path.exists(path):
        return None
    return RankFileReader(path, verify=False).metadata


def _read_resized(model, optimizer, ckpt_prefix: str, strict: bool = True):
    """Check a checkpoint of another world size or wrapping against the model (changes nothing);
    returns the open source and what it will fill."""
    source = ResizedLoad(ckpt_prefix)
    try:
        source.verify_share(_flat_rank(model), model.world_size * model.comms.num_replicas)
        keys = optimizer_param_keys(model, optimizer) if optimizer is not None else None
        return source, source.plan(model, optimizer, model.rank, keys, strict)
    except BaseException:
        source.close()
        raise


def _flat_rank(model) -> int:
    return model.comms.replica_rank * model.world_size + model.rank


@takes_root_unit
def values_over_ranks(model, value: int) -> List[int]:
    """Every rank's ``value`` (numbered replica-major): a collective every rank joins."""
    comms = model.comms
    total = model.world_size * comms.num_replicas
    if total == 1:
        return [value]
    row = [0] * total
    row[_flat_rank(model)] = value
    sums = comms.start_sum_over_ranks(row)()
    if sums is None:  # processes without a host channel (TPU hosts): the shard group's values on device
        mine = torch.tensor([value], dtype=torch.int32).to(comms.device)
        gathered = model.gather_over_ranks(mine)
        comms.sync()
        return [int(v) for v in gathered.cpu().tolist()]
    return [int(v) for v in sums]


_MESSAGE_BYTES = 1024


@takes_root_unit
def messages_over_ranks(model, message: Optional[str]) -> List[Optional[str]]:
    """Every rank's ``message`` (None: nothing to say; at most 1 KiB of UTF-8 each), numbered
    replica-major: a collective every rank joins, so every rank can name another's problem."""
    raw = (message or "").encode()[:_MESSAGE_BYTES - 2]
    row = [0 if message is None else 1, len(raw)] + list(raw) + [0] * (_MESSAGE_BYTES - 2 - len(raw))
    comms = model.comms
    total = model.world_size * comms.num_replicas
    if total == 1:
        rows = [row]
    else:
        full = [0] * (total * _MESSAGE_BYTES)
        at = _flat_rank(model) * _MESSAGE_BYTES
        full[at:at + _MESSAGE_BYTES] = row
        sums = comms.start_sum_over_ranks(full)()
        if sums is None:  # processes without a host channel (TPU hosts): the shard group's rows on device
            gathered = model.gather_over_ranks(torch.tensor(row, dtype=torch.int32))
            comms.sync()
            sums = [int(v) for v in gathered.cpu().tolist()]
        rows = [sums[i:i + _MESSAGE_BYTES] for i in range(0, len(sums), _MESSAGE_BYTES)]
    return [bytes(r[2:2 + r[1]]).decode(errors="replace") if r[0] else None for r in rows]


def _ranks_that_failed(model, failed: bool) -> list:
    """Which ranks (numbered replica-major) report a failure."""
    return [r for r, f in enumerate(values_over_ranks(model, int(failed))) if f]


def _read_checked(model, optimizer, path: str, ckpt_prefix: str) -> Dict[str, Any]:
    """This rank's file, read and checked against the model (changes nothing)."""
    if not os.path.exists(path):
        others = sorted(glob.glob(glob.escape(ckpt_prefix) + "_rank-*-of-*.pth"))
        sizes = {int(m.group(2)) for m in (RANK_FILE.search(o) for o in others) if m}
        if sizes - {model.world_size}:
            hint = (f" Found files for another world size (e.g. '{os.path.basename(others[0])}'): resize with "
                    f"python -m xla_fsdp.resize --world_size {model.world_size}.")
        elif others:  # the set of this world size lacks this file: resizing would not bring it back
            hint = (f" The other {len(others)} rank file(s) of this world size are there: restore this one from "
                    "where the checkpoint was written, or resume from an earlier checkpoint.")
        else:
            hint = ""
        raise CheckpointError(f"missing rank file '{path}' for rank {model.rank} of {model.world_size}.{hint}")
    reader = RankFileReader(path, mmap=False)
    _check_matches_model(path, reader.metadata, model.get_shard_metadata())
    reader.model()
    if optimizer is not None:
        reader.optimizer()
    return reader.contents
