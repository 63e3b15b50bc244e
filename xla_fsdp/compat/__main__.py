"""``python -m xla_fsdp.compat SCRIPT [ARGS]``: run a program written for torch_xla's FSDP with
xla_fsdp, in it and in every Python process it starts (``torch_xla.launch`` spawns its device
processes afresh, so a ``sitecustomize`` on ``PYTHONPATH`` swaps the names in each of them)."""
from __future__ import annotations

import atexit
import os
import sys
from typing import List, Optional

ENV = "XLA_FSDP_REPLACE_TORCH_XLA_FSDP"  # read by _startup/sitecustomize.py
STARTUP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_startup")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m xla_fsdp.compat SCRIPT [ARGS]``: run a program written for torch_xla's FSDP
    with xla_fsdp, in it and in every Python process it starts."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: python -m xla_fsdp.compat SCRIPT [ARGS]  (runs SCRIPT with torch_xla.distributed.fsdp "
             "served by xla_fsdp)")
    if argv and argv[0] in ("-h", "--help"):
        print(f"{usage}\n\n{__doc__}")
        return 0
    if not argv or argv[0].startswith("-"):
        print(usage + (f"; '{argv[0]}' is not a script" if argv else ""), file=sys.stderr)
        return 2
    import importlib.util
    if importlib.util.find_spec("torch_xla") is None:
        from ..collectives import NEEDS_XLA
        print(f"xla_fsdp.compat runs programs written for torch_xla, which is not installed: {NEEDS_XLA}",
              file=sys.stderr)
        return 2
    env = dict(os.environ, **{ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (STARTUP_DIR, PACKAGE_PARENT,
                                                   env.get("PYTHONPATH")) if p)
    # This process ends here without exiting: run what it registered to run at exit first (importing
    # xla_fsdp imports torch, whose torch.distributed.nn makes a temp folder it removes at exit).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + argv, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
