"""``python -m xla_fsdp.resize``: the short command name for :mod:`xla_fsdp.cli.resize`."""
import sys

from .cli.resize import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
