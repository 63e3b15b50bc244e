"""Print a sharded checkpoint's metadata, sizes and checksum status (run from a checkout, no
install needed): ``python tools/inspect_checkpoint.py --ckpt_prefix P [--tensors]``. The tool is
:mod:`xla_fsdp.cli.inspect`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from xla_fsdp.cli.inspect import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
