"""Rank files are written by torch with its zip checksum off, then checksummed with zlib outside the
GIL (xla_fsdp.checkpoints.zip_crc): the archive must equal what torch.save writes, checksums included."""
import struct
import zipfile

import pytest
import torch

from xla_fsdp.checkpoints import zip_crc
from xla_fsdp.checkpoints.files import CheckpointError, verify_archive


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(300, 7, generator=g), "b": torch.arange(5, dtype=torch.bfloat16),
                      "empty": torch.zeros(0), "mask": torch.rand(33, generator=g) > 0.5,
                      "ids": torch.randint(0, 9, (17,), generator=g)},
            "shard_metadata": {"world_size": 2, "names": ["w", "b"]}, "optimizer": {}}


def _crcs(path):
    with zipfile.ZipFile(path) as z:
        return {i.filename.split("/", 1)[1]: (i.CRC, i.file_size) for i in z.infolist()}


@pytest.mark.parametrize("chunk", [64 << 20, 1000])  # one zlib call per record, and many per record
def test_the_archive_has_torch_saves_checksums_and_loads(chunk, tmp_path, monkeypatch):
    state = _state()
    ours, plain = str(tmp_path / "ours.pth"), str(tmp_path / "plain.pth")
    filled = []
    monkeypatch.setattr(zip_crc, "_CHUNK", chunk)
    monkeypatch.setattr(zip_crc, "fill_zip_crcs", lambda p, fill=zip_crc.fill_zip_crcs: filled.append(fill(p)))
    monkeypatch.setattr(zip_crc.torch, "save", None)  # the fallback is not taken
    zip_crc.save_with_crc_outside_gil(state, ours)
    monkeypatch.undo()
    assert len(filled) == 1
    with open(plain, "wb") as f:  # torch.save through a file object, as ours writes
        torch.save(state, f)
    with zipfile.ZipFile(ours) as z:
        assert z.testzip() is None
        last = z.getinfo("archive/.data/serialization_id")  # the one record that differs: a random id
    assert last.header_offset == max(i.header_offset for i in z.infolist())
    with open(ours, "rb") as a, open(plain, "rb") as b:
        assert a.read(last.header_offset) == b.read(last.header_offset)  # every record, descriptors included
    mine, theirs = _crcs(ours), _crcs(plain)
    del mine[".data/serialization_id"], theirs[".data/serialization_id"]
    assert mine == theirs and all(crc for crc, size in mine.values() if size)  # the central directory too
    for mmap in (False, True):
        got = torch.load(ours, weights_only=True, mmap=mmap)
        assert got["shard_metadata"] == state["shard_metadata"]
        for k, v in state["model"].items():
            assert torch.equal(got["model"][k], v) and got["model"][k].dtype == v.dtype


@pytest.mark.fast
def test_a_flipped_byte_is_caught_as_in_a_torch_save_file(tmp_path):
    path = str(tmp_path / "ours.pth")
    zip_crc.save_with_crc_outside_gil(_state(), path)
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data/0"))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))  # the local header's (its extra pads for alignment)
        at = info.header_offset + 30 + name_len + extra_len + 3
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        verify_archive(path)


def test_falls_back_to_torch_save_where_torchs_internals_differ(tmp_path, monkeypatch):
    monkeypatch.setattr(zip_crc, "_write_archive_without_crc", lambda obj, f: False)
    path = str(tmp_path / "ours.pth")
    zip_crc.save_with_crc_outside_gil(_state(), path)
    assert _crcs(path) == _crcs(_plain(tmp_path))


def _plain(tmp_path):
    path = str(tmp_path / "plain.pth")
    torch.save(_state(), path)
    return path
