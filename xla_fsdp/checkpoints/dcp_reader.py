"""Reading a DCP folder without running code from it, one entry at a time.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load`` and its default load
planner reads non-tensor entries with ``torch.load(weights_only=False)``: a crafted folder runs any
code it likes in the converting process. Here ``.metadata`` is unpickled with an allow-list (DCP's
metadata classes and the torch types they hold) and entries with ``weights_only=True``; anything
else is a :class:`~.files.CheckpointError` naming the file. Damaged input (truncated, not a pickle)
is one too, never a traceback.
"""
from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from .files import CheckpointError, causes

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


@contextlib.contextmanager
def single_process():
    """dcp.save/load with ``no_dist=True`` warn that no process group is up: here that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


def read_entry(reader: SafeFileSystemReader, fqn: str, meta) -> Any:
    """One entry of a DCP checkpoint (a tensor, or a pickled object), read alone."""
    if isinstance(meta, TensorStorageMetadata):
        target = {fqn: torch.empty(meta.size, dtype=meta.properties.dtype)}
    else:
        target = {fqn: None}
    try:
        with single_process():
            dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(allow_partial_load=True), no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        raise dcp_failure(e, f"reading '{fqn}' from the DCP checkpoint '{reader.path}' failed") from None
    return target[fqn]


def dcp_failure(error: BaseException, what: str) -> CheckpointError:
    """One line for a failure inside DCP: ours as it is, else the first exception DCP collected."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CheckpointError):
            return e
        if not isinstance(e, CheckpointException):
            first = (str(e).strip().splitlines() or [""])[0]
            return CheckpointError(f"{what}: {type(e).__name__}: {first} (the folder is damaged or incomplete: "
                                   "copy it again from its source)")
        todo += causes(e)
    return CheckpointError(f"{what}: {error}")


# Top-level entries that torchtitan saves beside the model's (its model keys sit at the top level).
NON_MODEL_ROOTS = ("optim", "optimizer", "lr_scheduler", "lr_schedulers", "dataloader", "train_state")


def find_prefix(names: List[str], wanted: Optional[str], candidates: Tuple[str, ...]) -> str:
    if wanted == "":  # the model's entries at the top level (torchtitan)
        return wanted
    if wanted is not None:
        if not any(n.startswith(wanted + ".") for n in names):
            raise CheckpointError(f"the DCP checkpoint has no entries under '{wanted}.' (it has e.g. "
                                  f"{sorted(names)[:4]}); name the right one with --model_key/--optim_key")
        return wanted
    for c in candidates:
        if any(n.startswith(c + ".") for n in names):
            return c
    raise CheckpointError(f"cannot tell where the model state is in the DCP checkpoint (entries e.g. "
                          f"{sorted(names)[:4]}); name it with --model_key")


def model_prefix(entries: Dict[str, Any], wanted: Optional[str]) -> str:
    """``model`` or ``app.model`` (the tutorials' AppState); else, when tensors sit at the top level
    beside torchtitan's ``optimizer``/``lr_scheduler``/... entries, the top level (``""``)."""
    names = list(entries)
    if wanted is None and not any(n.startswith(c + ".") for n in names for c in ("model", "app.model")):
        if any(isinstance(m, TensorStorageMetadata) and n.partition(".")[0] not in NON_MODEL_ROOTS
               for n, m in entries.items()):
            return ""
    return find_prefix(names, wanted, ("model", "app.model"))


def model_entries(entries: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    if prefix:
        return {n[len(prefix) + 1:]: m for n, m in entries.items() if n.startswith(prefix + ".")}
    return {n: m for n, m in entries.items()
            if isinstance(m, TensorStorageMetadata) and n.partition(".")[0] not in NON_MODEL_ROOTS}


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def read_param_groups(reader, entries, optim_prefix: str) -> List[Dict[str, Any]]:
    """The param groups with parameter names, as ``get_optimizer_state_dict`` writes them: a list
    (``param_groups.0.lr``, ``param_groups.0.params``) or, with ``flatten_optimizer_state_dict``
    (torchtitan), per parameter (``param_groups.<name>.lr``); parameters whose hyperparameters are
    equal then share a group, in the order the checkpoint lists them."""
    prefix = f"{optim_prefix}.param_groups."
    listed: Dict[int, Dict[str, Any]] = {}
    per_param: Dict[str, Dict[str, Any]] = {}
    for fqn, meta in entries.items():
        if fqn.startswith(prefix):
            rest = fqn[len(prefix):]
            number, _, field = rest.partition(".")
            if number.isdigit():
                listed.setdefault(int(number), {})[field] = read_entry(reader, fqn, meta)
            else:
                name, _, field = rest.rpartition(".")  # hyperparameter names hold no dots
                per_param.setdefault(name, {})[field] = read_entry(reader, fqn, meta)
    if per_param and not listed:
        groups: List[Dict[str, Any]] = []
        for name, hyper in per_param.items():
            same = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == hyper), None)
            if same is None:
                groups.append(dict(hyper, params=[name]))
            else:
                same["params"].append(name)
        return groups
    if not listed or any("params" not in g for g in listed.values()):
        raise CheckpointError(f"the DCP checkpoint's optimizer state under '{optim_prefix}' has no param_groups "
                              "with parameter names (write it with get_state_dict / get_optimizer_state_dict)")
    return [listed[i] for i in sorted(listed)]
