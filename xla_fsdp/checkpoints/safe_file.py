"""The file torch's zip writer writes into: a failed write never reaches the writer.

torch's ``PyTorchFileWriter`` aborts the process when a write fails: its destructor writes the end of
the archive again, that throws inside a destructor and C++ calls ``std::terminate`` ("unexpected pos
38208 vs 38096", exit 134) — on a full disk, a whole training job killed by a checkpoint. Given this
file, the writer sees every write succeed; the first error is kept, later writes are dropped, and
``close()`` raises it, so the caller gets an ``OSError`` (ENOSPC, EDQUOT, EFBIG) it can report.

Ctrl-C is the other way a write raises: the KeyboardInterrupt lands at the start of whatever Python
function runs next, often this file's ``write`` called from inside the writer ("terminate called after
throwing an instance of 'c10::Error' ... unexpected pos", ~30 C++ frames). While the writer runs,
SIGINT is held (:meth:`NoAbortFile.interrupts_held`): with Python's own handler the rest of the writes
are dropped and the KeyboardInterrupt is raised once the writer has returned; another handler of the
program's is called then instead.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator, Optional


class NoAbortFile:
    """``open(path, 'wb')`` for torch's zip writer (``write``/``flush``/``close``)."""

    def __init__(self, path: str):
        self._file = open(path, "wb")
        self.error: Optional[BaseException] = None
        self._held: Optional[contextlib.AbstractContextManager] = None

    @contextlib.contextmanager
    def interrupts_held(self) -> Iterator[None]:
        """SIGINT held off (main thread only: no other thread gets signals) and delivered on exit."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        caught = []

        def hold(signum, frame):
            caught.append((signum, frame))
            if previous is signal.default_int_handler and self.error is None:
                self.error = KeyboardInterrupt()  # the file is abandoned: drop the rest of its writes
        try:
            previous = signal.signal(signal.SIGINT, hold)
        except ValueError:  # not the main interpreter
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
            if caught and sys.exc_info()[1] is None:  # delivered now, unless an error is on its way out
                if previous is signal.default_int_handler:
                    raise KeyboardInterrupt
                if callable(previous):
                    previous(*caught[0])
                elif previous == signal.SIG_DFL:
                    os.kill(os.getpid(), signal.SIGINT)

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
        """Open for one writer's whole run, SIGINT held meanwhile."""
        self._held = self.interrupts_held()
        self._held.__enter__()
        return self

    def __exit__(self, exc_type, *rest) -> bool:
        try:
            if exc_type is None:
                self.close()
            else:
                try:
                    self.close()
                except Exception:
                    pass  # the exception in flight says more
        finally:
            if self._held is not None:
                held, self._held = self._held, None
                held.__exit__(*sys.exc_info())
        return False
