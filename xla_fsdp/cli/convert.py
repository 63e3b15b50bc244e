"""CLI: move checkpoints between xla_fsdp's rank files and PyTorch Distributed Checkpoint (DCP).

    python -m xla_fsdp.convert --to dcp --ckpt_prefix /ckpt/step100 --out /ckpt/step100_dcp
    python -m xla_fsdp.convert --from dcp --ckpt_dir /ckpt/fsdp2_step100 --world_size 8 --out_prefix /ckpt/step100
    python -m xla_fsdp.convert --from hf --ckpt_dir /models/llama-3-8b --world_size 8 --out_prefix /ckpt/llama_init

A DCP folder written here is keyed by the original parameter names, model under ``model`` and
optimizer state under ``optim`` as ``get_state_dict`` lays them out: FSDP2, DDP or a plain model
restores it with ``dcp.load`` at any world size. Reading DCP, the model state is found under
``model`` or ``app.model`` (the DCP tutorial's AppState), or at the top level beside
``optimizer``/``lr_scheduler``/``train_state`` (torchtitan, whose optimizer state is flattened),
unless ``--model_key`` says where. ``--from hf`` reads a Hugging Face ``save_pretrained`` folder
(safetensors, one file or shards with their index), a ``.safetensors`` file or a consolidated ``.pth``,
one tensor at a time, and writes rank files a run resumes from with the ordinary loaders.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..checkpoints.dcp_format import export_dcp, import_dcp
from ..checkpoints.files import DEFAULT_SUFFIX, run_cli_action
from .parser import ArgumentParser


def main(argv: Optional[List[str]] = None) -> int:
    parser = ArgumentParser(prog="python -m xla_fsdp.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=["dcp"], help="write the rank files at --ckpt_prefix as this format")
    direction.add_argument("--from", dest="source", choices=["dcp", "hf"],
                           help="read this format from --ckpt_dir (hf: a save_pretrained folder or weights file)")
    parser.add_argument("--ckpt_prefix", help="(--to) prefix of the rank files")
    parser.add_argument("--ckpt_suffix", default=DEFAULT_SUFFIX)
    parser.add_argument("--out", help="(--to) output folder, new or empty")
    parser.add_argument("--ckpt_dir", help="(--from) the DCP checkpoint folder, or the Hugging Face folder or file")
    parser.add_argument("--world_size", type=int, help="(--from) number of ranks to write for")
    parser.add_argument("--out_prefix", help="(--from) prefix of the rank files to write")
    parser.add_argument("--model_key", default=None, help="where the model state is in the DCP state dict "
                        "('' = the top level, as torchtitan saves it; found by default)")
    parser.add_argument("--optim_key", default=None, help="where the optimizer state is (--to: 'none' leaves it out)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an output path that holds something other than an earlier output of this "
                             "tool (outputs of the same kind are replaced anyway; inputs never are)")
    args = parser.parse_args(argv)
    needed = ["ckpt_prefix", "out"] if args.to else ["ckpt_dir", "world_size", "out_prefix"]
    missing = [f"--{name}" for name in needed if getattr(args, name) is None]
    if missing:
        parser.error(f"{'--to dcp' if args.to else '--from ' + args.source} needs {', '.join(missing)}")

    def action() -> str:
        if args.to:
            optim_key = None if args.optim_key == "none" else (args.optim_key or "optim")
            out = export_dcp(args.ckpt_prefix, args.out, args.model_key or "model", optim_key, args.ckpt_suffix,
                             args.overwrite)
            return f"wrote the DCP checkpoint {out}"
        if args.source == "hf":
            from ..checkpoints.pretrained import import_pretrained
            paths = import_pretrained(args.ckpt_dir, args.world_size, args.out_prefix, args.overwrite)
            return (f"wrote {len(paths)} rank files: {paths[0]} ... {paths[-1]}\n"
                    "note: safetensors keep no checksums, so the values read were not verified against their source; "
                    "the rank files record that (python -m xla_fsdp.inspect says so)")
        paths = import_dcp(args.ckpt_dir, args.world_size, args.out_prefix, args.model_key, args.optim_key,
                           args.overwrite)
        return (f"wrote {len(paths)} rank files: {paths[0]} ... {paths[-1]}\n"
                "note: DCP keeps no checksums, so the values read were not verified against their source; the rank "
                "files record that (python -m xla_fsdp.inspect says so)")

    return run_cli_action(action)


if __name__ == "__main__":
    sys.exit(main())
