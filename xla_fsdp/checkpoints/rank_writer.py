"""Every rank file is written here: the save, the resize, and the DCP and pretrained imports.

A rank file holds ``{'model', 'shard_metadata', 'optimizer'}`` (plus ``'extra'`` from a save). Each
tensor is streamed to the file as it is added (``stream_save``: memory holds one tensor, the CRC-32s of
the zip records are computed outside the GIL) and its checksum goes into the metadata's ``checksums``.
The file is written under a temporary name, fsynced, and takes its name only at :meth:`commit`; a set
of files (:class:`RankFiles`) takes its names together or not at all.
"""
from __future__ import annotations

import errno
import os
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from .files import (CheckpointError, check_free_space, commit, discard, fsync_file, new_temporary, tensor_checksum,
                    write_error)
from .stream_save import PthStreamWriter


def checksums(model: Mapping[str, Any], optimizer: Optional[Mapping[str, Any]]) -> Dict[str, Dict[str, int]]:
    """The metadata's ``checksums`` of a rank file's model state and optimizer state dict (keys
    ``"{index}.{field}"``): the CRC-32 of each tensor's dtype, shape and bytes."""
    return {"model": {k: tensor_checksum(v) for k, v in model.items() if isinstance(v, torch.Tensor)},
            "optimizer": {f"{i}.{f}": tensor_checksum(v) for i, st in (optimizer or {}).get("state", {}).items()
                          for f, v in st.items() if isinstance(v, torch.Tensor)}}


class RankFileWriter:
    """One rank file, written one tensor at a time."""

    def __init__(self, path: str, size: Optional[int] = None):
        self.path, self._size = path, size  # size: bytes known up front, checked against the free space
        self.tmp: Optional[str] = new_temporary(path, size)
        try:
            self._stream: Optional[PthStreamWriter] = PthStreamWriter(self.tmp)
        except BaseException:
            self.discard()
            raise
        self._model: Dict[str, Any] = {}
        self._optimizer: Optional[Dict[str, Any]] = None
        self._extra: Any = None
        self._sums: Dict[str, Dict[str, int]] = {"model": {}, "optimizer": {}}

    def add_model(self, key: str, value: Any) -> None:
        """A model state entry (a shard or a buffer; a non-tensor as it is)."""
        if isinstance(value, torch.Tensor):
            self._sums["model"][key] = tensor_checksum(value)
        self._model[key] = self._stream.add_nested(value)

    def add_optimizer(self, index: int, field: str, value: Any) -> None:
        """One field of the optimizer state of the ``index``-th shard in the optimizer's order."""
        if isinstance(value, torch.Tensor):
            self._sums["optimizer"][f"{index}.{field}"] = tensor_checksum(value)
        self._optimizer_dict()["state"].setdefault(index, {})[field] = self._stream.add_nested(value)

    def set_optimizer(self, osd: Mapping[str, Any]) -> None:
        """A whole optimizer state dict (``state`` by index and ``param_groups``, and any other key)."""
        for index, fields in osd.get("state", {}).items():
            for field, value in fields.items():
                self.add_optimizer(index, field, value)
        for key, value in osd.items():
            if key != "state":
                self._optimizer_dict()[key] = self._stream.add_nested(value)

    def set_param_groups(self, groups: List[Dict[str, Any]]) -> None:
        self._optimizer_dict()["param_groups"] = groups

    def set_extra(self, extra: Mapping[str, Any]) -> None:
        self._extra = self._stream.add_nested(dict(extra))

    def _optimizer_dict(self) -> Dict[str, Any]:
        if self._optimizer is None:
            self._optimizer = {"state": {}, "param_groups": []}
        return self._optimizer

    def write(self, metadata: Mapping[str, Any]) -> None:
        """Finish the temporary file with ``metadata`` (its checksums added) and fsync it."""
        obj: Dict[str, Any] = {"model": self._model, "shard_metadata": dict(metadata, checksums=self._sums),
                               "optimizer": self._optimizer}
        if self._extra is not None:
            obj["extra"] = self._extra
        stream, self._stream = self._stream, None
        try:
            stream.set_structure(lambda refs: obj)
            stream.close()
            fsync_file(self.tmp)
        except BaseException as e:
            stream.abandon()  # closed: a failed pickle leaves no open file (nor the disk space of a deleted one)
            self.discard()
            error = write_error(e, self.path, max(stream.nbytes, self._size or 0))
            if error is e:
                raise
            raise error from e

    def commit(self) -> None:
        """Give the written file its name (durably)."""
        tmp, self.tmp = self.tmp, None
        commit(tmp, self.path)

    def discard(self) -> None:
        stream, self._stream = getattr(self, "_stream", None), None
        try:
            if stream is not None:  # abandoned while writing: its file closed, later writes of torch's dropped
                stream.abandon()
        finally:
            if self.tmp is not None:
                discard(self.tmp)
                self.tmp = None


class RankFiles:
    """The rank files of one checkpoint, written side by side (an import or a resize reads each full
    tensor once and adds its shard to every file); ``with`` block: all take their names at its end,
    or none is left."""

    def __init__(self, paths: List[str], size: Optional[int] = None):
        self.paths, self._size = paths, size  # size: of each file, where known (checked against the free space)
        self.files: List[RankFileWriter] = []

    def __enter__(self) -> "RankFiles":
        folder = os.path.dirname(os.path.abspath(self.paths[0])) if self.paths else ""
        if self._size is not None and os.path.isdir(folder):  # all of them, before any byte is written
            check_free_space(folder, self._size * len(self.paths), f"the {len(self.paths)} files of '{self.paths[0]}'")
        try:
            for path in self.paths:
                self.files.append(RankFileWriter(path, self._size))
        except OSError as e:
            self._discard()
            if e.errno == errno.EMFILE:  # every file is open until all are written
                raise CheckpointError(f"cannot write {len(self.paths)} rank files side by side: this process may "
                                      "open fewer files at once (ulimit -n); raise the limit, or write for fewer "
                                      "ranks and resize in steps") from e
            raise
        except BaseException:
            self._discard()
            raise
        return self

    def add_model(self, key: str, per_rank: List[Any]) -> None:
        for f, value in zip(self.files, per_rank):
            f.add_model(key, value)

    def add_optimizer(self, index: int, field: str, per_rank: List[Any]) -> None:
        for f, value in zip(self.files, per_rank):
            f.add_optimizer(index, field, value)

    def set_param_groups(self, groups: List[Dict[str, Any]]) -> None:
        for f in self.files:
            f.set_param_groups(groups)

    def set_extra(self, extra: Mapping[str, Any]) -> None:
        for f in self.files:
            f.set_extra(extra)

    def finish(self, metadata_of_rank: Callable[[int], Mapping[str, Any]]) -> None:
        """Write every file with its rank's metadata, then name them all."""
        for rank, f in enumerate(self.files):
            f.write(metadata_of_rank(rank))
        for i, f in enumerate(self.files):
            try:
                f.commit()
            except BaseException:
                for later in self.files[i + 1:]:
                    later.discard()
                raise
        self.files = []

    def _discard(self) -> None:
        for f in self.files:
            f.discard()
        self.files = []

    def __exit__(self, exc_type, *rest) -> bool:
        self._discard()  # finish() not reached: nothing is left
        return False
