"""Print a sharded checkpoint's metadata, sizes and checksum status.

    python -m xla_fsdp.inspect --ckpt_prefix /ckpt/step100 [--tensors]
    (or python -m xla_fsdp.cli.inspect)

Exit code 0 when every rank file is present, consistent and matches its checksums; 2 otherwise.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from ..checkpoints import CheckpointError, ShardedCheckpoint
from ..checkpoints.files import DEFAULT_SUFFIX
from .parser import ArgumentParser


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.2f} MiB"


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m xla_fsdp.inspect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt_prefix", required=True)
    p.add_argument("--ckpt_suffix", default=DEFAULT_SUFFIX)
    p.add_argument("--tensors", action="store_true", help="list every shard entry")
    args = p.parse_args(argv)
    try:
        ckpt = ShardedCheckpoint(args.ckpt_prefix, args.ckpt_suffix)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    md = ckpt.metadata
    print(f"checkpoint   {args.ckpt_prefix}")
    print(
        "format       " + ("torch_xla XlaFSDP (five-key metadata)" if ckpt.from_torch_xla
                             else f"xla_fsdp v{md.get('version')}")
    )
    print(f"world size   {ckpt.world_size}   run id {md.get('run_id', '-')}   transport {md.get('transport', '-')}")
    print(f"flatten      {md.get('flatten_parameters', '-')}   dim-0 {md.get('shard_param_on_dim_0', '-')}   "
          f"pad multiple {md.get('shard_size_multiple', '-')}")
    print(f"versions     {md.get('library_versions', '-')}")
    numel = sum(sum(math.prod(s) for s in e["shapes"]) for e in ckpt.layout.values())
    print(f"parameters   {numel:,} in {len(ckpt.layout)} shards; buffers {len(ckpt.buffer_keys)}; "
          f"optimizer {'yes' if md.get('optimizer_param_keys') or ckpt.from_torch_xla else 'no'}")
    for f in ckpt.files:
        print(f"  {os.path.basename(f.path)}  {_mib(os.path.getsize(f.path))}")
    if args.tensors:
        for e in ckpt.layout.values():
            print(f"  [{e['mode']}] {', '.join(e['names'])}  shapes {e['shapes']}  padded {e['padded_numel']}"
                  f"  shard {e['shard_shape']}")
    try:
        for line in ckpt.verify():
            print(f"checksums    {line}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
