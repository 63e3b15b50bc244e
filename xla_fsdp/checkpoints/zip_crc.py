"""Zip CRC-32s computed outside the GIL: ``fill_zip_crcs`` for the stream writer every rank file is written
with (a save in a background thread leaves the training thread its speed), ``save_with_crc_outside_gil``
for whole files (the consolidated outputs).

torch 2.9's zip writer (``PyTorchFileWriter``) checksums every record while holding the GIL: an
async save of a 1 GiB checkpoint slowed the training thread's steps 1.36x, against 1.06x with the
checksum off (benchmarks/async_save.py). Here torch writes the archive with its checksum off, then
the CRC-32 of every record is computed with ``zlib.crc32`` (which releases the GIL on large buffers)
read back from the file and written where torch's writer puts it: the record's data descriptor (or its
local header) and its central-directory entry.
The result is the same standard archive: ``zipfile.testzip`` and ``unzip -t`` pass, ``torch.load``
(mmap too) reads it. Where torch's internals or the archive's form differ from what this expects,
``save_with_crc_outside_gil`` falls back to a plain ``torch.save``; a streamed file cannot be written
again, so ``fill_zip_crcs`` raises.
"""
from __future__ import annotations

import pickle
import struct
import zipfile
import zlib
from typing import Any, BinaryIO, List

import torch

from .safe_file import NoAbortFile

_LOCAL_HEADER, _CENTRAL_HEADER, _DESCRIPTOR = b"PK\x03\x04", b"PK\x01\x02", b"PK\x07\x08"
_CHUNK = 16 << 20  # read and checksummed 16 MiB at a time


def _write_archive_without_crc(obj: Any, f: BinaryIO) -> bool:
    ser = torch.serialization
    try:
        writer = torch._C.PyTorchFileWriter(f, False, ser._get_storage_alignment())
        save = ser._save
    except (AttributeError, TypeError):
        return False
    save(obj, writer, pickle, ser.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()
    return True


def _crc(f: BinaryIO, start: int, size: int, buf: memoryview) -> int:
    """CRC-32 of ``size`` bytes at ``start``, read through one reused buffer (no mapping of the
    file, so the process's resident memory grows by the buffer only)."""
    f.seek(start)
    crc = 0
    while size:
        n = f.readinto(buf[:min(size, len(buf))])
        if not n:
            raise ValueError("the archive ends inside a record")
        crc, size = zlib.crc32(buf[:n], crc), size - n
    return crc


def _put_crc(f: BinaryIO, at: int, crc: int) -> None:
    f.seek(at)
    f.write(struct.pack("<I", crc))


def _read(f: BinaryIO, at: int, n: int) -> bytes:
    f.seek(at)
    return f.read(n)


def fill_zip_crcs(path: str) -> None:
    """Compute and write the CRC-32 of every stored record of the zip archive at ``path``: in the
    data descriptor that follows the record where there is one (torch writes one), else in its
    local header, and in its central-directory entry."""
    with zipfile.ZipFile(path) as archive:
        infos, start_dir = archive.infolist(), archive.start_dir
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        raise ValueError(f"'{path}': only stored (uncompressed) records are supported")
    buf = memoryview(bytearray(min(_CHUNK, max([i.compress_size for i in infos] + [1]))))
    with open(path, "r+b", buffering=0) as f:
        crcs: List[int] = []
        for info in infos:
            at = info.header_offset
            header = _read(f, at, 30)
            if header[:4] != _LOCAL_HEADER:
                raise ValueError(f"'{path}': no local header at {at}")
            name_len, extra_len = struct.unpack_from("<HH", header, 26)
            data = at + 30 + name_len + extra_len
            crc = _crc(f, data, info.compress_size, buf)
            if info.flag_bits & 0x08:
                after = data + info.compress_size
                _put_crc(f, after + 4 if _read(f, after, 4) == _DESCRIPTOR else after, crc)
            else:
                _put_crc(f, at + 14, crc)
            crcs.append(crc)
        at = start_dir
        for crc in crcs:  # central directory entries come in the records' order
            entry = _read(f, at, 46)
            if entry[:4] != _CENTRAL_HEADER:
                raise ValueError(f"'{path}': no central directory entry at {at}")
            _put_crc(f, at + 16, crc)
            name_len, extra_len, comment_len = struct.unpack_from("<HHH", entry, 28)
            at += 46 + name_len + extra_len + comment_len


def save_with_crc_outside_gil(obj: Any, path: str) -> None:
    """Write ``obj`` to ``path`` as ``torch.save`` does, the checksums computed outside the GIL."""
    with NoAbortFile(path) as f:
        # Through a Python file object: torch's writer hands each record to f.write, which releases
        # the GIL while the bytes go out (given a path, it writes holding the GIL).
        written = _write_archive_without_crc(obj, f)
    if written:
        try:
            fill_zip_crcs(path)
            return
        except ValueError:
            pass  # an archive form this does not patch: write it again the plain way
    with NoAbortFile(path) as f:
        torch.save(obj, f)
