"""The file torch's zip writer writes into: a failed write never reaches the writer.

torch's ``PyTorchFileWriter`` aborts the process when a write fails: its destructor writes the end of
the archive again, that throws inside a destructor and C++ calls ``std::terminate`` ("unexpected pos
38208 vs 38096", exit 134) — on a full disk, a whole training job killed by a checkpoint. Given this
file, the writer sees every write succeed; the first error is kept, later writes are dropped, and
``close()`` raises it, so the caller gets an ``OSError`` (ENOSPC, EDQUOT, EFBIG) it can report.
"""
from __future__ import annotations

from typing import Optional


class NoAbortFile:
    """``open(path, 'wb')`` for torch's zip writer (``write``/``flush``/``close``)."""

    def __init__(self, path: str):
        self._file = open(path, "wb")
        self.error: Optional[BaseException] = None

    def write(self, data) -> int:
        n = data.nbytes if isinstance(data, memoryview) else len(data)
        if self.error is None:
            try:
                self._file.write(data)
            except Exception as e:  # OSError from the disk; ValueError once closed
                self.error = e
        return n

    def flush(self) -> None:
        if self.error is None:
            try:
                self._file.flush()
            except Exception as e:
                self.error = e

    def close(self) -> None:
        """Close the file; raise the first error any write met."""
        try:
            self._file.close()  # flushes: can fail too
        except Exception as e:
            self.error = self.error or e
        if self.error is not None:
            raise self.error

    def __enter__(self) -> "NoAbortFile":
        return self

    def __exit__(self, exc_type, *rest) -> bool:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:
                pass  # the exception in flight says more
        return False
