"""CLI: consolidate per-rank FSDP checkpoint files into one full state dict.

    python -m xla_fsdp.consolidate_sharded_ckpts --ckpt_prefix /tmp/run/final_ckpt
        [--ckpt_suffix '_rank-*-of-*.pth'] [--save_path F] [--format pth|safetensors]
        [--optimizer] [--verify]

Works for checkpoints written by xla_fsdp and by torch_xla's XlaFullyShardedDataParallel.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..checkpoints.consolidate import ShardedCheckpoint, default_save_path, write_consolidated
from ..checkpoints.files import DEFAULT_SUFFIX, run_cli_action


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xla_fsdp.consolidate_sharded_ckpts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_prefix", required=True, help="prefix of the rank files")
    parser.add_argument("--ckpt_suffix", default=DEFAULT_SUFFIX,
                        help="glob appended to the prefix (e.g. the HF Trainer's rank*-of-*-pytorch_model.bin); "
                             "ranks come from each file's metadata")
    parser.add_argument("--save_path", default="", help="output file (default PREFIX_consolidated.pth)")
    parser.add_argument("--format", choices=["pth", "safetensors"], default="pth")
    parser.add_argument("--optimizer", action="store_true",
                        help="also consolidate optimizer state, keyed by original parameter names")
    parser.add_argument("--verify", action="store_true", help="only check the files (checksums, layout)")
    args = parser.parse_args(argv)

    def action() -> str:
        ckpt = ShardedCheckpoint(args.ckpt_prefix, args.ckpt_suffix)
        if args.verify:
            lines = ckpt.verify()
            return "\n".join(lines + [f"verified {ckpt.world_size} rank files of '{args.ckpt_prefix}'"])
        path = args.save_path or default_save_path(args.ckpt_prefix, args.format)
        write_consolidated(ckpt, path, args.format, args.optimizer)
        return f"consolidated {ckpt.world_size} rank files into {path}"

    return run_cli_action(action)

if __name__ == "__main__":
    sys.exit(main())
