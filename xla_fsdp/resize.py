"""``python -m xla_fsdp.reshard``: the short command name for :mod:`xla_fsdp.cli.reshard`."""
import sys

from .cli.reshard import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
