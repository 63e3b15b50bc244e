"""``python -m xla_fsdp.convert``: the short command name for :mod:`xla_fsdp.cli.convert`."""
import sys

from .cli.convert import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
