"""Named full tensors on disk that a load or an import reads: a Hugging Face folder (``model.safetensors``
or shards named by ``model.safetensors.index.json``), one ``.safetensors`` file, a consolidated
``.pth``/``.bin``, or a DCP folder. A read takes an element range of one tensor: from a safetensors file
with ``preadv`` straight into the shard (no mapping: the file's pages never count in the rank's memory),
from a ``.pth`` through a memory map (the pages of the rank's own rows); a DCP folder is read one whole
tensor at a time."""
from __future__ import annotations

import abc
import ctypes
import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from .files import CheckpointError
from .importing import ImportedOptimizer, ImportPlan

SAFETENSORS_INDEX = "model.safetensors.index.json"


class TensorSource(abc.ABC):
    """Named full tensors on disk, read by element ranges of each tensor flattened."""

    path: str
    shapes: Dict[str, Tuple[int, ...]]

    @abc.abstractmethod
    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of ``name`` flattened (row-major), as a 1-D tensor of the file's dtype."""

    def read_into(self, name: str, start: int, end: int, out: torch.Tensor) -> None:
        """The same elements written into ``out`` (cast to its dtype, as ``copy_``)."""
        out.copy_(self.read(name, start, end))

    def close(self) -> None:
        pass

    def read_whole(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        return self.read(name, 0, math.prod(shape) if shape else 1).reshape(shape).clone()

    def import_plan(self) -> ImportPlan:
        """What ``import_rank_files`` writes from this source: every tensor in order, the floating-point
        ones as shards, no optimizer state."""
        params = [n for n in self.shapes if self.read(n, 0, 1).is_floating_point()]
        where = os.path.abspath(self.path)
        return ImportPlan(entries=list(self.shapes), params=params, read=self.read_whole, optimizer=None,
                          origin=f"pretrained:{where}", what=f"pretrained weights {where}")


class SafetensorsSource(TensorSource):
    """One ``.safetensors`` file or a folder (one file, or shards named by the index)."""

    def __init__(self, path: str):
        try:
            from safetensors import safe_open
        except ImportError:
            raise CheckpointError(f"reading '{path}' needs the safetensors package, which a plain install of "
                                  "xla_fsdp does not bring: pip install safetensors") from None
        self.path = path
        if os.path.isdir(path):
            index = os.path.join(path, SAFETENSORS_INDEX)
            if os.path.isfile(index):
                try:
                    with open(index) as f:
                        weight_map = json.load(f)["weight_map"]
                except (OSError, ValueError, KeyError, TypeError) as e:
                    raise CheckpointError(f"'{index}' is damaged ({type(e).__name__}: {e}); copy the folder again "
                                          "from its source") from None
                files = sorted(set(weight_map.values()))
            else:
                files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
                if not files:
                    raise CheckpointError(f"'{path}' holds no .safetensors file (nor {SAFETENSORS_INDEX})")
            paths = [os.path.join(path, f) for f in files]
        else:
            paths = [path]
        self._files: Dict[str, Any] = {}  # safe_open handles: validated, and the reader of dtypes torch lacks
        self._fds: Dict[str, int] = {}
        self._offsets: Dict[str, Tuple[int, torch.dtype]] = {}  # where each tensor's bytes start, its dtype
        self._where: Dict[str, str] = {}
        self.shapes = {}
        for file in paths:
            if not os.path.isfile(file):
                raise CheckpointError(f"'{file}' is missing: the index of '{path}' names it; copy the folder again")
            try:
                handle = safe_open(file, framework="pt")
                names = list(handle.keys())
                shapes = {n: tuple(handle.get_slice(n).get_shape()) for n in names}
            except Exception as e:  # noqa: BLE001 - safetensors' own errors have no common base
                raise CheckpointError(f"'{file}' is damaged (not a safetensors file: {type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''}); copy it again") from None
            self._files[file] = handle
            self._fds[file] = os.open(file, os.O_RDONLY)
            self._offsets.update(_data_offsets(file))
            for n in names:
                self._where[n] = file
            self.shapes.update(shapes)

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        where = self._offsets.get(name)
        if where is None:  # a dtype torch names otherwise: safetensors' own slice
            return self._slice(name, start, end)
        numel = math.prod(self.shapes[name])
        out = torch.empty(max(0, min(end, numel) - start), dtype=where[1])
        self._pread(name, start, out)
        return out

    def read_into(self, name: str, start: int, end: int, out: torch.Tensor) -> None:
        where = self._offsets.get(name)
        if where is not None and out.dtype == where[1] and out.device.type == "cpu" and out.is_contiguous():
            self._pread(name, start, out)  # straight from the page cache into the shard: no copy between
            torch.autograd.graph.increment_version(out)  # written as copy_ would (the unit sees the values given)
        else:
            out.copy_(self.read(name, start, end))

    def _pread(self, name: str, start: int, out: torch.Tensor) -> None:
        """Elements from ``start`` of ``name`` into ``out`` with ``preadv``: no mapping, so the file's pages
        never count in this process's memory, and the bytes are copied once."""
        fd, offset = self._fds[self._where[name]], self._offsets[name][0] + start * out.element_size()
        nbytes = out.numel() * out.element_size()
        view = memoryview((ctypes.c_char * nbytes).from_address(out.data_ptr())).cast("B") if nbytes else None
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"'{self._where[name]}' is damaged: '{name}' ends past the end of the file "
                                      "(truncated); copy it again")
            done += got

    def _slice(self, name: str, start: int, end: int) -> torch.Tensor:
        handle = self._files[self._where[name]]
        shape = self.shapes[name]
        if len(shape) == 0:
            return handle.get_tensor(name).reshape(1)[start:end]
        row = math.prod(shape[1:])
        first, last = start // row, -(-end // row) if row else 0
        try:
            rows = handle.get_slice(name)[first:last]
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"'{self._where[name]}' is damaged: reading '{name}' failed ({type(e).__name__}: "
                                  f"{e}); copy it again") from None
        return rows.reshape(-1)[start - first * row:end - first * row]

    def close(self) -> None:
        self._files.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _data_offsets(file: str) -> Dict[str, Tuple[int, torch.dtype]]:
    """Where each tensor's bytes start in a safetensors file (already validated by ``safe_open``): the header
    is 8 bytes of its length then JSON whose ``data_offsets`` count from the header's end."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {n: (8 + length + e["data_offsets"][0], _SAFETENSORS_DTYPES[e["dtype"]])
            for n, e in header.items() if n != "__metadata__" and e["dtype"] in _SAFETENSORS_DTYPES}


class TorchFileSource(TensorSource):
    """A consolidated ``torch.save`` file: a state dict, or ``{"model": state dict, ...}`` as
    ``python -m xla_fsdp.consolidate`` writes it. Memory-mapped and read with ``weights_only=True``."""

    def __init__(self, path: str):
        self.path = path
        try:
            loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch.load's failures have no common base
            raise CheckpointError(f"'{path}' cannot be read as a weights-only torch file ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); copy it again, or consolidate "
                                  "the checkpoint first") from None
        state = loaded.get("model", loaded) if isinstance(loaded, dict) else None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"'{path}' holds no state dict of tensors (a dict of names to tensors, or one under "
                                  "'model')")
        self._state = state
        self.shapes = {n: tuple(t.shape) for n, t in state.items()}

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._state[name].reshape(-1)[start:end]

    def close(self) -> None:
        self._state = {}


class DCPSource(TensorSource):
    """A DCP folder's model tensors (under ``model``, ``app.model`` or the top level, or ``model_key``), one
    whole tensor read at a time, and for an import its other model entries and its optimizer state (under
    ``optim_key``, default ``optim`` or ``optimizer`` beside the model's)."""

    def __init__(self, path: str, model_key: Optional[str] = None, optim_key: Optional[str] = None):
        # torch.distributed.checkpoint is imported when a DCP folder is read, not with the package
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from .dcp_reader import SafeFileSystemReader, model_entries, model_prefix
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise CheckpointError(f"'{path}' is not a DCP checkpoint folder (no .metadata file)")
        self.path = path
        self._reader = SafeFileSystemReader(path)
        self._all = self._reader.read_metadata().state_dict_metadata
        self._prefix = model_prefix(self._all, model_key)
        self._model = model_entries(self._all, self._prefix)
        self._entries = {n: m for n, m in self._model.items() if isinstance(m, TensorStorageMetadata)}
        self.shapes = {n: tuple(m.size) for n, m in self._entries.items()}
        self._optim_key = optim_key
        self._cached: Tuple[Optional[str], Optional[torch.Tensor]] = (None, None)

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        from .dcp_reader import join, read_entry
        if self._cached[0] != name:
            self._cached = (name, None)  # the previous tensor is freed before the next is read
            self._cached = (name, read_entry(self._reader, join(self._prefix, name), self._entries[name]))
        return self._cached[1].reshape(-1)[start:end]

    def close(self) -> None:
        self._cached = (None, None)

    def _optim_prefix(self) -> Optional[str]:
        from .dcp_reader import find_prefix
        parent = self._prefix.rpartition(".")[0]
        candidates = tuple(f"{parent}.{c}" if parent else c for c in ("optim", "optimizer"))
        try:
            return find_prefix(list(self._all), self._optim_key, candidates)
        except CheckpointError:
            if self._optim_key is not None:
                raise
            return None

    def import_plan(self) -> ImportPlan:
        """The parameters (those the optimizer's groups name, else the floating-point tensors) as shards,
        then the other model entries whole; the optimizer state by parameter name."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from .dcp_reader import join, read_entry, read_param_groups
        optim_prefix = self._optim_prefix()
        groups = read_param_groups(self._reader, self._all, optim_prefix) if optim_prefix else None
        trained = {p for g in groups for p in g["params"]} if groups else None
        params = [n for n, m in self._entries.items()
                  if (n in trained if trained is not None else m.properties.dtype.is_floating_point)]
        shards = set(params)
        where = os.path.abspath(self.path)

        def read(name: str) -> Any:
            return read_entry(self._reader, join(self._prefix, name), self._model[name])
        optimizer = None
        if groups is not None:
            fields: Dict[str, Dict[str, Optional[List[int]]]] = {}
            metas: Dict[Tuple[str, str], Any] = {}
            for name in (p for g in groups for p in g["params"]):
                prefix = f"{optim_prefix}.state.{name}."
                fields[name] = {}
                for fqn, meta in self._all.items():
                    if fqn.startswith(prefix):
                        field = fqn[len(prefix):]
                        fields[name][field] = list(meta.size) if isinstance(meta, TensorStorageMetadata) else None
                        metas[name, field] = (fqn, meta)
            optimizer = ImportedOptimizer(groups, fields,
                                          lambda name, field: read_entry(self._reader, *metas[name, field]))
        # DCP keeps no checksums: ours are of the values as read, damaged or not
        return ImportPlan(entries=params + [n for n in self._model if n not in shards], params=params, read=read,
                          optimizer=optimizer, origin=f"dcp:{where}", what=f"DCP checkpoint {where}")


def open_source(path: str) -> TensorSource:
    """The source at ``path``, by what is there."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, ".metadata")):
            return DCPSource(path)
        return SafetensorsSource(path)
    if not os.path.exists(path):
        raise CheckpointError(f"'{path}' does not exist: pass a Hugging Face folder, a .safetensors file, a "
                              "consolidated .pth, a DCP folder, or the prefix of xla_fsdp rank files")
    with open(path, "rb") as f:
        head = f.read(8)
    if path.endswith(".safetensors") or (len(head) == 8 and int.from_bytes(head, "little") < 100_000_000
                                         and not head.startswith(b"PK")):
        return SafetensorsSource(path)
    return TorchFileSource(path)
