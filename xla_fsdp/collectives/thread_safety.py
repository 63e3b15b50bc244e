"""What several XLA:CPU rank threads of one process share and torch does not guard.

On TPU every rank is a process; on XLA:CPU they are threads of one, so process-wide state that a
program changes for a moment is changed under its peers' feet. ``torch.serialization.safe_globals``
(used by the HF Trainer around every ``torch.load`` of its RNG files) adds globals on entry and
removes them on exit: one rank leaving the block took them away from another rank still loading
("Weights only load failed ... Unsupported global"), 1 run in 6 of the Trainer's resume at 2 devices.
Here nested and concurrent blocks count their holders and remove a global only when the last leaves.
"""
from __future__ import annotations

import threading
from collections import Counter

from .. import patches

_LOCK = threading.Lock()
_HOLDERS: Counter = Counter()


def install_shared_safe_globals() -> None:
    """Make ``torch.serialization.safe_globals`` blocks safe across threads; idempotent."""
    from torch import _weights_only_unpickler as unpickler

    def enter(self):
        with _LOCK:
            _HOLDERS.update(self.safe_globals)
            unpickler._add_safe_globals(self.safe_globals)

    def exit_(self, exc_type, exc, tb):
        with _LOCK:
            _HOLDERS.subtract(self.safe_globals)
            released = [g for g in self.safe_globals if _HOLDERS[g] <= 0]
            for g in released:
                del _HOLDERS[g]
            unpickler._remove_safe_globals(released)

    why = "torch.serialization.safe_globals blocks safe across XLA:CPU rank threads"
    patches.replace(unpickler._safe_globals, "__enter__", enter, why)
    patches.replace(unpickler._safe_globals, "__exit__", exit_, why)


#: one rank thread at a time makes the first calls of torch_xla's host fallbacks
_FALLBACK_LOCK = threading.Lock()


def count_host_fallbacks_first(fn):
    """``fn`` (a rank thread's body), after this thread's first calls of torch_xla's common host
    fallbacks (``.item()``, ``torch.equal``, ``nonzero`` / boolean indexing), one thread at a time.

    torch_xla 2.9 counts every operation it runs on the host in a ``std::unordered_map`` that it
    fills at each operation's first call, unguarded (``xla_fallback`` in aten_cpu_fallback.cpp). Two
    rank threads making the first ``.item()`` of the process at once corrupted it: a segfault in
    ``_Hashtable::_M_find_before_node`` under ``_local_scalar_dense``, 1 run in about 50 of a
    2-device program that ends each rank with ``xm.all_reduce(...).item()``. Made here first, under
    a lock, each counter exists before the program runs, and its later calls only read the map.
    The tensors are host data on the device: no graph is compiled or run, the random state is left."""
    def run(*args, **kwargs):
        import torch
        import torch_xla
        with _FALLBACK_LOCK:
            x = torch.ones(1).to(torch_xla.device())
            x.item()
            torch.equal(x, x)
            torch.nonzero(x)
        return fn(*args, **kwargs)

    return run
