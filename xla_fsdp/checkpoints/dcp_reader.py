"""Reading a DCP folder without running code from it.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load`` and its default load
planner reads non-tensor entries with ``torch.load(weights_only=False)``: a crafted folder runs any
code it likes in the converting process. Here ``.metadata`` is unpickled with an allow-list (DCP's
metadata classes and the torch types they hold) and entries with ``weights_only=True``; anything
else is a :class:`~.files.CheckpointError` naming the file. Damaged input (truncated, not a pickle)
is one too, never a traceback.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .files import CheckpointError

# (module, name) -> allowed: what DCP's own .metadata holds, on every torch this package supports
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a layout by its name, looked up among torch's layouts
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list (as opposed to a damaged pickle)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"it asks for {module}.{name}, which is not a class DCP's metadata holds")


def read_metadata_safely(path: str) -> Metadata:
    """The ``Metadata`` in the DCP ``.metadata`` file at ``path``, refusing any other object."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise CheckpointError(f"'{path}' is refused, nothing in it was run: {e} (a crafted file could run code "
                              "when read); use a DCP checkpoint written by torch.distributed.checkpoint") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OSError) as e:
        raise CheckpointError(f"'{path}' is damaged (truncated or not DCP metadata: {type(e).__name__}: {e}); "
                              "copy the checkpoint folder again from its source") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"'{path}' holds a {type(metadata).__name__}, not DCP metadata; copy the checkpoint "
                              "folder again from its source")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through :func:`read_metadata_safely`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = read_metadata_safely(str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` reading non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise CheckpointError(f"the DCP entry '{fqn}' is refused: it holds an object that weights_only "
                                  "loading does not allow (it could run code when read)") from None
        except (EOFError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"the DCP entry '{fqn}' is damaged ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''})") from None
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes puts it
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
