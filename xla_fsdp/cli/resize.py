"""CLI: rewrite a sharded checkpoint for another world size (model and optimizer state).

    python -m xla_fsdp.resize --ckpt_prefix /ckpt/step100 --world_size 8 --out_prefix /ckpt/step100_ws8
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..checkpoints.files import DEFAULT_SUFFIX, run_cli_action
from ..checkpoints.resizing import resize_checkpoint
from .parser import ArgumentParser


def main(argv: Optional[List[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m xla_fsdp.resize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_prefix", required=True)
    parser.add_argument("--world_size", type=int, required=True, help="number of ranks to write for")
    parser.add_argument("--out_prefix", required=True)
    parser.add_argument("--ckpt_suffix", default=DEFAULT_SUFFIX)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an output path that holds something other than an earlier output of this "
                             "tool (outputs of the same kind are replaced anyway; inputs never are)")
    args = parser.parse_args(argv)

    def action() -> str:
        paths = resize_checkpoint(args.ckpt_prefix, args.world_size, args.out_prefix, args.ckpt_suffix, args.overwrite)
        return f"wrote {len(paths)} rank files: {paths[0]} ... {paths[-1]}"

    return run_cli_action(action)

if __name__ == "__main__":
    sys.exit(main())
