"""Temporary files of checkpoint writes in progress, so a process that must exit at once (Ctrl-C in
an XLA:CPU device process) leaves no half-written file. Depends on nothing: the writer
(checkpoints) registers, the launcher hook (collectives) cleans up."""
from __future__ import annotations

import os
from typing import List, Set

UNFINISHED: Set[str] = set()


def remove_unfinished_writes() -> List[str]:
    """Delete the temporary files of writes in progress; finished files were renamed into place whole."""
    removed = []
    for tmp in list(UNFINISHED):
        try:
            os.unlink(tmp)
            removed.append(tmp)
        except OSError:
            pass
    return removed
