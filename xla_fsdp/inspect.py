"""``python -m xla_fsdp.inspect``: the short command name for :mod:`xla_fsdp.cli.inspect`, beside
``xla_fsdp.consolidate_sharded_ckpts``, ``xla_fsdp.resize`` and ``xla_fsdp.convert``."""
import sys

from .cli.inspect import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
