"""Per-rank checkpoint files: names, atomic writes, checksums, and finding a complete set.

A checkpoint is ``{prefix}_rank-{rank:08d}-of-{world_size:08d}.pth`` for every rank, each holding
``{'model', 'shard_metadata', 'optimizer'}``. Every write goes to a temporary file in the same
directory, is flushed and fsynced, then renamed over the final name, so a crash never leaves a
partial file under a final name and never damages the previous checkpoint.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import pickle
import re
import shutil
import sys
import uuid
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional

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


class ModelMismatchError(CheckpointError):
    """A sound checkpoint that does not fit the model: names or sizes differ (another model or config).
    Resuming stops at it rather than falling back to an older checkpoint, which would not fit either."""


class DiskFullError(CheckpointError):
    """A write did not fit: the disk is full, a quota or the file size limit is reached."""


_NO_ROOM = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
            errno.EFBIG: "the file size limit (ulimit -f) is reached"}


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def free_bytes(directory: str) -> int:
    return shutil.disk_usage(directory).free


def check_free_space(directory: str, needed: int, what: str) -> None:
    """Refuse before writing ``needed`` bytes of ``what`` into ``directory`` when they cannot fit."""
    free = free_bytes(directory)
    if needed > free:
        raise DiskFullError(f"not enough space in '{directory}' for {what}: it needs {_size(needed)} ({needed} "
                            f"bytes), {_size(free)} are free; free space there or choose another folder (nothing "
                            "was written)")


def as_disk_full(error: BaseException, path: str, needed: Optional[int] = None) -> Optional[DiskFullError]:
    """The clear error for an ``OSError`` that means no room (found in ``error``'s causes too, where
    a library wrapped it), else None."""
    seen = _find_no_room(error, set())
    if seen is None and needed is not None and _short_write(error, set()):
        seen = _why_short(os.path.dirname(os.path.abspath(path)), needed)
    if seen is None:
        return None
    directory = os.path.dirname(os.path.abspath(path))
    need = f"it needs {_size(needed)} ({needed} bytes), " if needed is not None else ""
    if seen.errno == errno.EFBIG:  # the process's limit, not the disk: free space is beside the point
        import resource
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        where = f"at most {_size(limit)} per file" if limit != resource.RLIM_INFINITY else "a file got too large"
        fix = "raise the limit (ulimit -f unlimited) and run again"
    else:
        try:
            where = f"{need}{_size(free_bytes(directory))} free in '{directory}'"
        except OSError:
            where = f"{need}free space unknown in '{directory}'"
        fix = "free space there or choose another folder"
    return DiskFullError(f"cannot write '{path}': {_NO_ROOM[seen.errno]}: {where}; nothing was written and earlier "
                         f"files are untouched; {fix}")


def causes(error: Any) -> List[BaseException]:
    """The exceptions behind ``error``: its cause and context, and what DCP's ``CheckpointException``
    collected per rank (``failures``: rank -> ``(exception, traceback)``)."""
    inner = [getattr(error, "__cause__", None), getattr(error, "__context__", None), getattr(error, "exception", None)]
    failures = getattr(error, "failures", None)
    if isinstance(failures, Mapping):
        for failure in failures.values():
            inner.append(failure[0] if isinstance(failure, tuple) and failure else failure)
    return [e for e in inner if isinstance(e, BaseException)]


def _find_no_room(error: Any, visited: set) -> Optional[OSError]:
    """The no-room ``OSError`` behind ``error``: itself or one of its :func:`causes`."""
    if error is None or id(error) in visited:
        return None
    visited.add(id(error))
    if isinstance(error, OSError) and error.errno in _NO_ROOM:
        return error
    for e in causes(error):
        found = _find_no_room(e, visited)
        if found is not None:
            return found
    return None


def _short_write(error: Any, visited: set) -> bool:
    """torch's zip writer (inside DCP's writer, say) reports a write that came up short as
    "unexpected pos", not as the OSError behind it."""
    if error is None or id(error) in visited:
        return False
    visited.add(id(error))
    if "unexpected pos" in str(error):
        return True
    return any(_short_write(e, visited) for e in causes(error))


def _why_short(directory: str, needed: int) -> Optional[OSError]:
    """The no-room condition that explains a short write of ``needed`` bytes, if one does."""
    import resource
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < needed:
        return OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    if free_bytes(directory) < needed:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def stored_bytes(obj: Any) -> int:
    """The bytes ``torch.save`` writes for the tensors in ``obj`` (each storage once): a lower bound
    of its file size."""
    seen: Dict[Any, int] = {}

    def visit(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            storage = o.untyped_storage()
            ptr = storage.data_ptr()  # 0 for meta tensors (placeholders): each counts
            seen[(ptr, o.device) if ptr else id(o)] = storage.nbytes()
        elif isinstance(o, Mapping):
            for v in o.values():
                visit(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v)
    visit(obj)
    return sum(seen.values())


def rank_path(prefix: str, rank: int, world_size: int) -> str:
    return f"{prefix}_rank-{rank:08d}-of-{world_size:08d}.pth"


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, no copy; valid while ``t`` lives. Through ctypes, not
    ``.numpy()``: torch does not require NumPy, and a plain ``pip install torch`` has none."""
    if not t.numel():
        return memoryview(b"")
    assert t.device.type == "cpu" and t.is_contiguous()
    return memoryview((ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def tensor_checksum(tensor: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (any dtype), with its dtype and shape folded in."""
    t = tensor.detach().cpu().contiguous()
    # the tensor's own bytes, no copy: zlib reads the buffer (and lets other threads run meanwhile)
    data = host_bytes(t)
    header = f"{t.dtype}:{tuple(t.shape)}".encode()
    return zlib.crc32(data, zlib.crc32(header))


def write_temporary(path: str, write: Callable[[str], None], size: Optional[int] = None) -> str:
    """Run ``write(tmp_path)`` for a temporary file beside ``path``, fsync it and return its name
    (:func:`commit` moves it to ``path``). ``size``, where known, is checked against the free space
    first. On any error the temporary file is gone; no room becomes a :class:`DiskFullError`."""
    tmp = new_temporary(path, size)
    try:
        write(tmp)
        fsync_file(tmp)
    except BaseException as e:
        discard(tmp)
        error = write_error(e, path, size)
        if error is e:
            raise
        raise error from e
    return tmp


def new_temporary(path: str, size: Optional[int] = None) -> str:
    """Create an empty temporary file beside ``path`` (removed at exit if never committed) and return
    its name; ``size``, where known, is checked against the free space first."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CheckpointError(f"cannot write '{path}': directory '{directory}' does not exist")
    if size is not None:
        check_free_space(directory, size, f"'{path}'")
    tmp = os.path.join(directory, f"{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
    _UNFINISHED.add(tmp)
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except PermissionError as e:
        _UNFINISHED.discard(tmp)
        raise CheckpointError(f"cannot write '{path}': no permission to create files in '{directory}'") from e
    except OSError as e:
        _UNFINISHED.discard(tmp)
        if e.errno in _NO_ROOM:
            raise write_error(e, path, size) from e
        raise CheckpointError(f"cannot write '{path}': cannot create files in '{directory}' ({e.strerror})") from e
    except BaseException:  # interrupted right after the file was made
        discard(tmp)
        raise
    return tmp


def write_error(e: BaseException, path: str, size: Optional[int] = None) -> BaseException:
    """What a failed write of ``path`` raises: no room as a :class:`DiskFullError`, another OSError as a
    :class:`CheckpointError` naming ``path`` (not its temporary file), anything else as it is."""
    full = as_disk_full(e, path, size)
    if full is not None:
        return full
    if isinstance(e, OSError) and not isinstance(e, CheckpointError):
        return CheckpointError(f"cannot write '{path}': {e.strerror or e}; nothing was written and earlier files "
                               "are untouched")
    return e


def fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def commit(tmp: str, path: str) -> None:
    """Move a finished temporary file to its name and make the rename durable."""
    try:
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise
    _UNFINISHED.discard(tmp)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def discard(tmp: str) -> None:
    if os.path.exists(tmp):
        os.unlink(tmp)
    _UNFINISHED.discard(tmp)


def atomic_write(path: str, write: Callable[[str], None], size: Optional[int] = None) -> None:
    """Run ``write(tmp_path)`` then move the finished, fsynced file to ``path``. The file gets the
    mode any new file gets (0666 less the umask), as ``torch.save`` would give it."""
    commit(write_temporary(path, write, size), path)


class FileSet:
    """Files that appear together or not at all: each is written under a temporary name, and
    they take their names when the ``with`` block ends without error (else all are removed)."""

    def __init__(self) -> None:
        self._done: List[tuple] = []

    def write(self, path: str, write: Callable[[str], None], size: Optional[int] = None) -> None:
        self._done.append((write_temporary(path, write, size), path))

    def torch_save(self, obj: Any, path: str) -> None:
        self.write(path, lambda tmp: save_with_crc_outside_gil(obj, tmp), stored_bytes(obj))

    def __enter__(self) -> "FileSet":
        return self

    def __exit__(self, exc_type, *rest) -> bool:
        done, self._done = self._done, []
        if exc_type is not None:
            for tmp, _ in done:
                discard(tmp)
            return False
        for i, (tmp, path) in enumerate(done):
            try:
                commit(tmp, path)
            except BaseException:
                for later, _ in done[i + 1:]:
                    discard(later)
                raise
        return False


_KINDS = {"torch": "a torch.save file", "safetensors": "a safetensors file", "json": "a JSON file",
          "dcp": "a DCP checkpoint folder"}


def _is_kind(path: str, kind: str) -> bool:
    """Whether ``path`` holds what a tool of ours writes as ``kind`` (so replacing it loses nothing
    the user put there by another way)."""
    try:
        if kind == "dcp":
            return os.path.isdir(path) and (not os.listdir(path) or os.path.isfile(os.path.join(path, ".metadata")))
        if not os.path.isfile(path):
            return False
        if kind == "torch":
            with zipfile.ZipFile(path) as archive:
                return any(n.endswith("data.pkl") for n in archive.namelist())
        with open(path, "rb") as f:
            if kind == "safetensors":
                head = f.read(9)
                size = os.path.getsize(path)
                return len(head) == 9 and int.from_bytes(head[:8], "little") < size and head[8:] == b"{"
            json.load(f)
            return True
    except (OSError, ValueError, zipfile.BadZipFile):
        return False


def prepare_output(path: str, kind: str, overwrite: bool = False) -> None:
    """The one rule of every tool for what it writes: the output's folders are created; an existing
    output of the same kind (an earlier run's, a file a tool of ours wrote) is replaced once the new
    one is complete; anything else there is refused unless ``overwrite`` (``--overwrite``). Inputs
    are never written over, ``overwrite`` or not (:func:`refuse_overwriting_inputs`)."""
    if kind != "dcp" and os.path.isdir(path):
        raise CheckpointError(f"the output '{path}' is a folder: give a file name"
                              + (" (a Hugging Face model folder is --format safetensors)" if kind == "torch" else ""))
    if os.path.lexists(path) and not overwrite and not _is_kind(path, kind):
        raise CheckpointError(f"the output '{path}' exists and is not {_KINDS[kind]}: it is left as it is; choose "
                              "another output, or pass --overwrite (overwrite=True) to replace it")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise CheckpointError(f"cannot write '{path}': '{parent}' is a file, not a folder")
    os.makedirs(parent, exist_ok=True)


@contextlib.contextmanager
def new_folders_removed_on_error(paths: Iterable[str]) -> Iterator[None]:
    """The folders that writing ``paths`` creates are removed again (when empty) if it fails: a
    failed tool run leaves the disk as it found it."""
    missing = set()
    for path in paths:
        folder = os.path.dirname(os.path.abspath(path))
        while not os.path.exists(folder):
            missing.add(folder)
            folder = os.path.dirname(folder)
    try:
        yield
    except BaseException:
        for folder in sorted(missing, key=len, reverse=True):  # deepest first
            try:
                os.rmdir(folder)
            except OSError:  # not empty, or gone
                pass
        raise


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
        # Never unpickle code. Earlier rank files of this package hold torch's version as the TorchVersion
        # that torch.__version__ is (a str subclass; metadata.py now writes a plain str): allowed, so they load.
        with torch.serialization.safe_globals([TorchVersion]):
            ckpt = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused a global: never relay torch's retry advice
        refused = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                       str(e).strip().splitlines()[0] if str(e).strip() else "")
        raise CheckpointError(f"'{path}' is refused, nothing in it was run: it holds objects a checkpoint does not "
                              f"({refused}); it was not written by xla_fsdp or torch_xla, or was altered") from None
    except Exception as e:  # torch raises several types for damaged zip files
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"'{path}' is not a readable checkpoint ({type(e).__name__}: {first})") from e
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
                              f"'{rank_path(ckpt_prefix, 0, 2)}'){_did_you_mean(ckpt_prefix)}")
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


def _did_you_mean(ckpt_prefix: str) -> str:
    """The prefixes meant by a rank file's name or a folder given as a prefix, as a hint."""
    m = RANK_FILE.search(ckpt_prefix)
    if m and ckpt_prefix.endswith(m.group(0)):
        return f"; '{ckpt_prefix}' is a rank file's name: did you mean --ckpt_prefix {ckpt_prefix[:m.start()]}?"
    if os.path.isdir(ckpt_prefix):
        found = sorted({p[:RANK_FILE.search(p).start()] for p in glob.glob(os.path.join(glob.escape(ckpt_prefix),
                        "*_rank-*-of-*.pth")) if RANK_FILE.search(p)})
        if found:
            others = found[:-1][-3:]  # the last in name order is suggested: step-N names sort by step
            more = f" (or {', '.join(reversed(others))}{', ...' if len(found) > 4 else ''})" if others else ""
            return (f"; '{ckpt_prefix}' is a folder, and the prefix is the rank files' path up to '_rank-': did you "
                    f"mean --ckpt_prefix {found[-1]}{more}?")
        return (f"; '{ckpt_prefix}' is a folder with no rank files in it: the prefix is the rank files' path up "
                "to '_rank-'")
    return ""


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


class _Terminated(Exception):
    """SIGTERM, raised where the command is, so that its unfinished files are removed on the way out."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


def run_cli_action(action: Callable[[], str]) -> int:
    """Run a CLI's work: print its summary and return 0, or print the error and return 2.
    Checkpoint problems are reported as one line naming the file, never as a traceback. Stopped by
    Ctrl-C or SIGTERM, it removes the temporary files of its unfinished writes (finished files were
    renamed into place whole; the inputs are never written) and says so in one line (exit 130 / 143)."""
    import signal
    import threading
    own_signal = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if own_signal else None
    try:
        summary = action()
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, _Terminated) as e:
        removed = remove_unfinished_writes()
        name = "SIGTERM" if isinstance(e, _Terminated) else "Ctrl-C (SIGINT)"
        print(f"error: stopped by {name}; removed {len(removed)} unfinished temporary file(s); files already "
              "finished are whole and the inputs are untouched: run the command again", file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    finally:
        if own_signal:
            signal.signal(signal.SIGTERM, previous)
    print(summary)
    return 0


def os_error_line(e: OSError) -> str:
    """An operating system's refusal as what it means for the command, and what to do."""
    where = e.filename if e.filename is not None else ""
    if isinstance(e, IsADirectoryError):
        return f"'{where}' is a folder where a file is to be written: move it away or choose another output prefix"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (f"cannot write or read '{where}': {e.strerror}: choose an output in a folder this user can write "
                "(the inputs are untouched)")
    if e.errno == errno.ENOSPC:
        return f"no space left on the device of '{where}': free some, or choose an output on another device"
    return f"{e.strerror or e}: '{where}'" if where else str(e)
