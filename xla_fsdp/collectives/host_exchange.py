"""Small host-side exchanges between the rank threads of one process (XLA:CPU devices), for what
needs no device: which parameters a step used, rendezvous payloads."""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

#: after this long, and every such interval, a waiting rank says which ranks it waits for
NOTICE_S = 60.0


def timeout_s() -> float:
    """How long a rank waits for its peers at a host exchange before it stops with an error naming
    them: ``XLA_FSDP_HOST_TIMEOUT_S``, default 600 (a peer may legitimately be minutes late: compiling,
    loading or consolidating a large checkpoint)."""
    text = os.environ.get("XLA_FSDP_HOST_TIMEOUT_S", "600")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"xla_fsdp: XLA_FSDP_HOST_TIMEOUT_S={text!r} is not a positive number of seconds")
    return value


class ThreadExchange:
    """Gathers one value per rank thread. A rank leaves its value and goes on; it waits only when
    it asks for the values. The n-th call of every rank belongs to the same round.

    Rounds are counted per rank, not per thread: a rank calls from its own thread (forward) and
    from autograd's thread for its device (backward hooks, the end-of-backward callback), and
    both calls belong to the rank's one sequence of rounds."""

    def __init__(self, purpose: str, world_size: int):
        self.purpose = purpose
        self.world_size = world_size
        self._cond = threading.Condition()
        self._rounds: Dict[int, Dict[int, Any]] = {}
        self._readers: Dict[int, int] = {}
        self._next: Dict[int, int] = {}  # rank -> its next round

    def start_gather(self, rank: int, value: Any) -> Callable[[], List[Any]]:
        with self._cond:
            round_ = self._next.get(rank, 0)
            self._next[rank] = round_ + 1
            self._rounds.setdefault(round_, {})[rank] = value
            self._cond.notify_all()
        return lambda: self._gather(round_)

    def gather(self, rank: int, value: Any) -> List[Any]:
        return self.start_gather(rank, value)()

    def _gather(self, round_: int) -> List[Any]:
        with self._cond:
            rows = self._rounds[round_]
            start, limit = time.monotonic(), timeout_s()
            while not self._cond.wait_for(lambda: len(rows) == self.world_size or _FAILED,
                                          min(NOTICE_S, max(0.0, start + limit - time.monotonic()))):
                missing = sorted(set(range(self.world_size)) - set(rows))
                waited = time.monotonic() - start
                if waited >= limit:
                    raise RuntimeError(
                        f"xla_fsdp: ranks {missing} did not reach the {self.purpose} within {limit:g} s "
                        "(they hang, failed without an error, or run a different program; "
                        "XLA_FSDP_HOST_TIMEOUT_S sets the limit)")
                sys.stderr.write(f"xla_fsdp: a rank has waited {waited:.0f} s for ranks {missing} at the "
                                 f"{self.purpose}; it stops after {limit:g} s (XLA_FSDP_HOST_TIMEOUT_S)\n")
                sys.stderr.flush()
            if len(rows) < self.world_size:  # a peer failed and will never come
                rank, error = _FAILED[0]
                raise RuntimeError(f"xla_fsdp: rank {rank} failed before the {self.purpose} ({error}); "
                                   "this rank stops too instead of waiting for it")
            values = [rows[r] for r in range(self.world_size)]
            self._readers[round_] = self._readers.get(round_, 0) + 1
            if self._readers[round_] == self.world_size:  # everyone has read: forget the round
                del self._rounds[round_], self._readers[round_]
            return values


_EXCHANGES: Dict[Tuple[str, int], ThreadExchange] = {}
_LOCK = threading.Lock()
_FAILED: List[Tuple[int, str]] = []  # (rank, error) of the first rank thread that failed


def report_rank_failure(rank: int, error: BaseException) -> None:
    """A rank thread is leaving with an error: its peers must not wait for it in an exchange
    (every rank agrees on the error instead of hanging until the timeout)."""
    with _LOCK:
        if not _FAILED:
            _FAILED.append((rank, f"{type(error).__name__}: {error}"))
        exchanges = list(_EXCHANGES.values())
    for exchange in exchanges:
        with exchange._cond:
            exchange._cond.notify_all()


def thread_exchange(purpose: str, world_size: int) -> ThreadExchange:
    """The process's exchange for ``purpose`` among ``world_size`` rank threads."""
    with _LOCK:
        key = (purpose, world_size)
        if key not in _EXCHANGES:
            _EXCHANGES[key] = ThreadExchange(purpose, world_size)
        return _EXCHANGES[key]
