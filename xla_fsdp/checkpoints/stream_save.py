"""Write a state dict one tensor at a time, so a model larger than memory can be saved.

``PthStreamWriter`` produces an ordinary ``torch.save`` zip file (``torch.load`` reads it, with or
without ``mmap=True``): each tensor's bytes are written as soon as it is added, and the small
pickle that names them is written last. ``SafetensorsStreamWriter`` does the same for the
safetensors format (header first, computed from the shapes given up front).
"""
from __future__ import annotations

import collections
import io
import json
import pickle
import struct
import sys
from typing import Dict, List, Mapping, Sequence, Tuple

import torch

from .files import host_bytes
from .safe_file import NoAbortFile
from .zip_crc import fill_zip_crcs


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Stands for a written tensor in the pickle: rebuilt by torch.load like a saved tensor."""

    def __init__(self, storage: _StorageRef, shape: Tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol):
        stride = torch.empty(self.shape, device="meta").stride()
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, stride, False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    """Tensors added earlier by reference; any other tensor in the structure (an ``extra`` entry) by its
    storage, written as a record when the pickle meets it, as ``torch.save`` does."""

    def __init__(self, file, writer: "PthStreamWriter"):
        super().__init__(file, protocol=2)
        self._writer = writer
        self._written: Dict[int, str] = {}

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        if isinstance(obj, torch.storage.TypedStorage):
            untyped = obj._untyped_storage.cpu()
            key = self._written.get(untyped._cdata)
            if key is None:
                key = self._writer._write_storage(untyped)
                self._written[untyped._cdata] = key
            return ("storage", getattr(torch, obj._pickle_storage_type()), key, "cpu", obj._size())
        return None


class PthStreamWriter:
    """``with PthStreamWriter(path) as w: w.add(key, tensor) ...; w.set_structure(fn)``.

    The saved object is ``structure(tensors)`` where ``tensors`` maps each added key to its
    tensor; by default a plain dict of them.
    """

    def __init__(self, path: str, crc_outside_gil: bool = True):
        self.path = path
        self._file = NoAbortFile(path)  # a failed write raises at close(), never aborts in torch's writer
        self._crc_later = False
        try:
            self._open_writer(crc_outside_gil)
        except BaseException:
            self.abandon()
            raise
        self._refs: "collections.OrderedDict[str, _TensorRef]" = collections.OrderedDict()
        self._structure = None
        self._count = 0
        self.nbytes = 0  # tensor bytes added so far

    def _open_writer(self, crc_outside_gil: bool) -> None:
        with self._file.interrupts_held():  # each call into torch's writer: Ctrl-C waits for its return
            if crc_outside_gil:  # the records' CRC-32s filled in at close() by zlib (zip_crc), not by torch
                try:
                    self._writer = torch._C.PyTorchFileWriter(self._file, False,
                                                              torch.serialization._get_storage_alignment())
                    self._crc_later = True
                except (AttributeError, TypeError):
                    pass
            if not self._crc_later:  # torch's writer computes them, holding the GIL
                self._writer = torch._C.PyTorchFileWriter(self._file)

    def add(self, key: str, tensor: torch.Tensor) -> "_TensorRef":
        t = tensor.detach().cpu().contiguous()
        if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view: its own bytes only, from the start of a storage of its size
        ref = _StorageRef(self._write_storage(t.untyped_storage()), t.dtype, t.numel())
        tensor_ref = _TensorRef(ref, tuple(t.shape))
        if key is not None:
            self._refs[key] = tensor_ref
        return tensor_ref

    def _write_storage(self, storage: torch.UntypedStorage) -> str:
        """Write a storage's bytes as the next record (straight from it: no second copy); its key."""
        key = str(self._count)
        self._count += 1
        with self._file.interrupts_held():
            self._writer.write_record(f"data/{key}", storage, storage.nbytes())
        self.nbytes += storage.nbytes()
        return key

    def add_nested(self, obj):
        """Write every tensor inside dicts/lists/tuples now; returns the structure to pickle."""
        if isinstance(obj, torch.Tensor):
            return self.add(None, obj)
        if type(obj) in (dict, collections.OrderedDict):
            return type(obj)((k, self.add_nested(v)) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(self.add_nested(v) for v in obj)
        return obj  # anything else as it is: its tensors are written when the pickle meets them

    def set_structure(self, structure) -> None:
        self._structure = structure

    def close(self) -> None:
        obj = self._structure(self._refs) if self._structure else dict(self._refs)
        buf = io.BytesIO()
        _Pickler(buf, self).dump(obj)
        data = buf.getvalue()
        with self._file.interrupts_held():
            self._writer.write_record("data.pkl", data, len(data))
            self._writer.write_record(".format_version", "1", 1)
            self._writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
            self._writer.write_end_of_file()
        self._file.close()
        if self._crc_later:
            fill_zip_crcs(self.path)

    def abandon(self) -> None:
        """Close the file unfinished; whatever its writes met (the error being handled) is not raised again."""
        try:
            self._file.close()
        except BaseException:  # noqa: BLE001 - the KeyboardInterrupt or OSError that abandoned it
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        if exc_type is None:
            self.close()
        else:
            self._file.__exit__(exc_type, *rest)
        return False


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


class SafetensorsStreamWriter:
    """Writes the safetensors header from ``specs`` (key -> (dtype, shape)), then each tensor in
    the same order as it is added."""

    def __init__(self, path: str, specs: Sequence[Tuple[str, torch.dtype, Tuple[int, ...]]],
                 metadata: Mapping[str, str] = None):
        header: Dict[str, object] = {}
        offset = 0
        self._order: List[str] = []
        for key, dtype, shape in specs:
            if dtype not in _SAFETENSORS_DTYPES:
                raise TypeError(f"safetensors cannot store dtype {dtype} ('{key}')")
            nbytes = (
                torch.empty(shape, dtype=dtype, device="meta").numel() * torch.empty((), dtype=dtype).element_size()
            )
            header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            self._order.append(key)
        if metadata:
            header["__metadata__"] = dict(metadata)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._next = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order) or self._order[self._next] != key:
            raise ValueError(f"tensor '{key}' added out of the declared order")
        t = tensor.detach().cpu().contiguous()
        if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view: its own bytes only, from the start of a storage of its size
        if t.numel():
            self._file.write(host_bytes(t))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            raise ValueError(f"only {self._next} of {len(self._order)} declared tensors were written")
        self._file.flush()
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *rest):
        if exc_type is None:
            self.close()
        else:
            self._file.close()
        return False
