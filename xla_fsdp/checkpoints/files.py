"""Per-rank checkpoint files: names, atomic writes, checksums, and finding a complete set.

A checkpoint is ``{prefix}_rank-{rank:08d}-of-{world_size:08d}.pth`` for every rank, each holding
``{'model', 'shard_metadata', 'optimizer'}``. Every write goes to a temporary file in the same
directory, is flushed and fsynced, then renamed over the final name, so a crash never leaves a
partial file under a final name and never damages the previous checkpoint.
"""
from __future__ import annotations

import glob
import os
import re
import sys
import uuid
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

import torch
from torch.torch_version import TorchVersion

from .._exit_cleanup import UNFINISHED as _UNFINISHED, remove_unfinished_writes  # noqa: F401
from ..shard_names import readable_key
from .zip_crc import save_with_crc_outside_gil

RANK_FILE = re.compile(r"_rank-(\d{8})-of-(\d{8})\.pth")
DEFAULT_SUFFIX = "_rank-*-of-*.pth"


class CheckpointError(RuntimeError):
    """A checkpoint set is incomplete, inconsistent or corrupted (the message names the file)."""

    user_facing = True  # its message says all: reported in one line, without a traceback


def rank_path(prefix: str, rank: int, world_size: int) -> str:
    return f"{prefix}_rank-{rank:08d}-of-{world_size:08d}.pth"


def tensor_checksum(tensor: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (any dtype), with its dtype and shape folded in."""
    t = tensor.detach().cpu().contiguous()
    # the tensor's own bytes, no copy: zlib reads the buffer (and lets other threads run meanwhile)
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
    header = f"{t.dtype}:{tuple(t.shape)}".encode()
    return zlib.crc32(data, zlib.crc32(header))


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Run ``write(tmp_path)`` then move the finished, fsynced file to ``path``. The file gets the
    mode any new file gets (0666 less the umask), as ``torch.save`` would give it."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CheckpointError(f"cannot write '{path}': directory '{directory}' does not exist")
    tmp = os.path.join(directory, f"{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    _UNFINISHED.add(tmp)
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        _UNFINISHED.discard(tmp)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def refuse_overwriting_inputs(outputs: Iterable[str], inputs: Iterable[str]) -> None:
    """Raise before anything is written when an output is one of the inputs, however spelled
    (``dir/./x``, a symlink, a hard link): a tool never writes over the files it reads."""
    inputs = list(inputs)
    real_inputs = {os.path.realpath(p): p for p in inputs}
    for out in outputs:
        same = real_inputs.get(os.path.realpath(out))
        if same is None and os.path.exists(out):
            same = next((p for p in inputs if os.path.exists(p) and os.path.samefile(out, p)), None)
        if same is not None:
            raise CheckpointError(f"the output '{out}' is the input file '{same}': choose another output path "
                                  "(inputs are never overwritten)")


def verify_archive(path: str) -> None:
    """Check every record of a ``torch.save`` file against the CRC-32 its zip header holds,
    streaming (``torch.load`` never checks them): flipped bytes in any writer's file are caught,
    also where the file carries no checksums of ours (plain ``torch.save``, ``xm.save``)."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"'{path}' is not a file written by torch.save (not a zip archive); it is "
                              "truncated or another kind of file") from e
    except OSError:
        raise
    except Exception as e:  # a damaged header raises zlib.error, EOFError, NotImplementedError and others
        raise CheckpointError(f"'{path}' is damaged ({type(e).__name__}: {e})") from e
    if bad is not None:
        raise CheckpointError(f"'{path}' is corrupted: its record '{bad}' fails its CRC-32 check; restore this "
                              "file from a backup or use an earlier checkpoint")


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` atomically, its zip checksums computed outside the GIL (a save in
    a background thread leaves the training thread its speed)."""
    atomic_write(path, lambda tmp: save_with_crc_outside_gil(obj, tmp))


@dataclass
class RankFile:
    path: str
    rank: int
    world_size: int


def load_rank_file(path: str, mmap: bool = True) -> Dict[str, Any]:
    """Load one rank file (memory-mapped: tensors are read from disk when touched)."""
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"'{path}' is not a file written by torch.save (not a zip archive); it is "
                              "truncated or another kind of file")
    try:
        # Never unpickle code. Files of xla_fsdp before 0.1.1 recorded torch's version as a
        # TorchVersion object: allowed explicitly, it is a str.
        with torch.serialization.safe_globals([TorchVersion]):
            ckpt = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as e:  # torch raises several types for damaged zip files
        raise CheckpointError(f"'{path}' is not a readable checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt or "shard_metadata" not in ckpt:
        raise CheckpointError(f"'{path}' is not a sharded checkpoint: it has no 'model' and "
                              "'shard_metadata' entries (is it a consolidated file?)")
    return ckpt


def find_rank_files(ckpt_prefix: str, ckpt_suffix: str = DEFAULT_SUFFIX) -> List[RankFile]:
    """The complete, consistent set of rank files matching ``ckpt_prefix + ckpt_suffix`` (a glob),
    sorted by rank.

    Names of the form ``*_rank-RRRRRRRR-of-WWWWWWWW.pth`` (8 digits each) say their rank; where
    any matching file is named so, only those count, so a consolidated output in the same folder
    is never picked up. Where none is (the HF Trainer's ``rank*-of-*-pytorch_model.bin``), every
    matching file is a rank file and its metadata says its rank and world size, as in torch_xla.
    """
    paths = sorted(glob.glob(glob.escape(ckpt_prefix) + ckpt_suffix))
    files = []
    for p in paths:
        m = RANK_FILE.fullmatch(p[len(ckpt_prefix):])
        if m:
            files.append(RankFile(p, int(m.group(1)), int(m.group(2))))
    if not files:
        files = [_rank_file_from_metadata(p) for p in paths]
    if not files:
        raise CheckpointError(f"no rank files match '{ckpt_prefix}{ckpt_suffix}' (expected names like "
                              f"'{rank_path(ckpt_prefix, 0, 2)}')")
    sizes = sorted({f.world_size for f in files})
    if len(sizes) > 1:
        raise CheckpointError(f"rank files for '{ckpt_prefix}' come from different world sizes {sizes}: "
                              + ", ".join(os.path.basename(f.path) for f in files))
    world_size = sizes[0]
    by_rank: Dict[int, RankFile] = {}
    for f in files:
        if f.rank in by_rank:
            raise CheckpointError(f"rank {f.rank} appears twice: '{by_rank[f.rank].path}' and '{f.path}'")
        by_rank[f.rank] = f
    missing = [r for r in range(world_size) if r not in by_rank]
    if missing:
        raise CheckpointError(f"checkpoint '{ckpt_prefix}' (world size {world_size}) is missing rank files "
                              f"for ranks {missing}, e.g. '{rank_path(ckpt_prefix, missing[0], world_size)}'")
    extra = [r for r in by_rank if r >= world_size]
    if extra:
        raise CheckpointError(f"rank files {extra} are outside world size {world_size}")
    return [by_rank[r] for r in range(world_size)]


def _rank_file_from_metadata(path: str) -> RankFile:
    metadata = load_rank_file(path)["shard_metadata"]
    rank, world_size = metadata.get("rank"), metadata.get("world_size")
    if not isinstance(rank, int) or not isinstance(world_size, int):
        raise CheckpointError(f"'{path}': its shard_metadata has no integer 'rank' and 'world_size'")
    return RankFile(path, rank, world_size)


def check_consistent(files: List[RankFile], metadatas: List[Mapping[str, Any]]) -> None:
    """Every file belongs to the same save of the same run and says the rank its name says."""
    run_ids = {md.get("run_id") for md in metadatas}
    if len(run_ids) > 1:
        raise CheckpointError("rank files come from different saves (run ids differ): " + ", ".join(
            f"{os.path.basename(f.path)}={md.get('run_id')}" for f, md in zip(files, metadatas)))
    for f, md in zip(files, metadatas):
        if md.get("world_size") != f.world_size or md.get("rank") != f.rank:
            raise CheckpointError(f"'{f.path}' holds metadata of rank {md.get('rank')} of "
                                  f"{md.get('world_size')}, but its name says rank {f.rank} of {f.world_size}")


def verify_checksums(path: str, state: Mapping[str, torch.Tensor], checksums: Optional[Mapping[str, int]],
                     keys: Optional[List[str]] = None) -> None:
    """Raise if a tensor's bytes no longer match the checksum recorded at save time."""
    if not checksums:
        return
    for key in keys if keys is not None else list(checksums):
        if key not in state:
            raise CheckpointError(f"'{path}': tensor '{readable_key(key)}' listed in the metadata is missing")
        if tensor_checksum(state[key]) != checksums[key]:
            raise CheckpointError(f"'{path}': tensor '{readable_key(key)}' is corrupted (checksum mismatch); restore "
                                  "this file from a backup or use an earlier checkpoint")


def run_cli_action(action: Callable[[], str]) -> int:
    """Run a CLI's work: print its summary and return 0, or print the error and return 2.
    Checkpoint problems are reported as one line naming the file, never as a traceback."""
    try:
        summary = action()
    except (CheckpointError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary)
    return 0
