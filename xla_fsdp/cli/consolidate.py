"""CLI: consolidate per-rank FSDP checkpoint files into one full state dict.

    python -m xla_fsdp.consolidate_sharded_ckpts --ckpt_prefix /tmp/run/final_ckpt
        [--ckpt_suffix '_rank-*-of-*.pth'] [--save_path F] [--format pth|safetensors]
        [--optimizer] [--verify]
    python -m xla_fsdp.consolidate_sharded_ckpts --ckpt_prefix P --format safetensors --max_shard_size 2GB
        [--dtype bfloat16] [--hf_config CONFIG] --save_path FOLDER     # a Hugging Face model folder

Works for checkpoints written by xla_fsdp and by torch_xla's XlaFullyShardedDataParallel.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from ..checkpoints.consolidate import default_save_path, write_consolidated
from ..checkpoints.reader import ShardedCheckpoint
from ..checkpoints.files import DEFAULT_SUFFIX, run_cli_action
from ..checkpoints.hf_export import INDEX_NAME, write_hf_safetensors
from .parser import ArgumentParser


def main(argv: Optional[List[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m xla_fsdp.consolidate_sharded_ckpts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_prefix", required=True, help="prefix of the rank files")
    parser.add_argument("--ckpt_suffix", default=DEFAULT_SUFFIX,
                        help="glob appended to the prefix (e.g. the HF Trainer's rank*-of-*-pytorch_model.bin); "
                             "ranks come from each file's metadata")
    parser.add_argument("--save_path", default="", help="output file (default PREFIX_consolidated.pth)")
    parser.add_argument("--format", choices=["pth", "safetensors"], default="pth")
    parser.add_argument("--optimizer", action="store_true",
                        help="also the optimizer state, keyed by original parameter names and listed in the "
                             "unwrapped model's named_parameters() order: the unwrapped model's optimizer takes "
                             "it with optimizer.load_state_dict(full['optimizer'])")
    parser.add_argument("--verify", action="store_true", help="only check the files (checksums, layout)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an output path that holds something other than an earlier output of this "
                             "tool (outputs of the same kind are replaced anyway; inputs never are)")
    hf = parser.add_argument_group("Hugging Face model folder (--format safetensors, --save_path a folder)")
    hf.add_argument("--max_shard_size", default=None,
                    help="split into model-0000i-of-0000N.safetensors files of at most this size (e.g. 2GB, 500MiB) "
                         "plus model.safetensors.index.json; --save_path is then a folder")
    hf.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="cast floating tensors (folder output)")
    hf.add_argument("--hf_config", default=None, help="config.json (or a folder holding it) to copy beside them")
    args = parser.parse_args(argv)
    folder = args.format == "safetensors" and (args.max_shard_size is not None or os.path.isdir(args.save_path)
                                               or args.save_path.endswith(os.sep))
    if (args.dtype or args.hf_config or args.max_shard_size) and not folder:
        parser.error("--max_shard_size, --dtype and --hf_config write a Hugging Face folder: use them with "
                     "--format safetensors --save_path FOLDER")

    def action() -> str:
        ckpt = ShardedCheckpoint(args.ckpt_prefix, args.ckpt_suffix)
        if args.verify:
            lines = ckpt.verify()
            return "\n".join(lines + [f"verified {ckpt.world_size} rank files of '{args.ckpt_prefix}'"])
        if folder:
            paths = write_hf_safetensors(ckpt, args.save_path, args.max_shard_size or "5GB", args.dtype, args.hf_config,
                                         args.overwrite)
            return f"wrote {len(paths)} safetensors files and {INDEX_NAME} into {args.save_path}"
        path = args.save_path or default_save_path(args.ckpt_prefix, args.format)
        write_consolidated(ckpt, path, args.format, args.optimizer, args.overwrite)
        return f"consolidated {ckpt.world_size} rank files into {path}"

    return run_cli_action(action)

if __name__ == "__main__":
    sys.exit(main())
