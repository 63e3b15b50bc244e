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
