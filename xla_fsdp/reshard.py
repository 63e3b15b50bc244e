"""``python -m xla_fsdp.reshard``: the former name of ``python -m xla_fsdp.resize`` (a checkpoint's
rank files for another world size), kept so scripts that call it keep working. "reshard" now names
only what a unit does: free its gathered parameters and keep the shards."""
import sys

from .cli.resize import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
