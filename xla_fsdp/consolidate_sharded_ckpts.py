"""``python -m xla_fsdp.consolidate_sharded_ckpts``: torch_xla's command name for
:mod:`xla_fsdp.cli.consolidate` (the code lives there)."""
import sys

from .checkpoints import consolidate_sharded_model_checkpoints  # torch_xla's module offers it too
from .cli.consolidate import main

__all__ = ["consolidate_sharded_model_checkpoints", "main"]

if __name__ == "__main__":
    sys.exit(main())
