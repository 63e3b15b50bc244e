"""One leg of a run that moves between environments (test_cross_version.py): trains a harness config
for some steps in whichever interpreter runs this file and writes the global-batch losses and the
consolidated model to ``--out``. ``xla``: xla_fsdp on XLA:CPU devices (needs torch_xla); ``gloo``:
xla_fsdp's torch transport on gloo processes; ``fsdp2``: upstream ``fully_shard`` with DCP."""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import fsdp2_runs  # noqa: E402
import harness  # noqa: E402

GLOBAL_BATCH = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=["xla", "gloo", "fsdp2"])
    parser.add_argument("--name", required=True)
    parser.add_argument("--world_size", type=int, required=True)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--load", help="xla/gloo: a rank-file prefix; fsdp2: a DCP folder")
    parser.add_argument("--save", help="as --load")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    per_rank = GLOBAL_BATCH // args.world_size
    if args.kind == "fsdp2":
        result = fsdp2_runs.run(args.name, args.world_size, args.steps, start=args.start, per_rank=per_rank,
                                load_dir=args.load, save_dir=args.save)
    else:
        run = harness.run_xla if args.kind == "xla" else harness.run_gloo
        ranks = run([args.name], args.world_size, steps=args.steps, start=args.start, per_rank=per_rank,
                    load_prefix=args.load, save_prefix=args.save)[args.name]
        losses = [sum(r["losses"][i] for r in ranks) / args.world_size for i in range(args.steps)]
        result = {"losses": losses, "full": harness.consolidate(ranks)}
    torch.save({"losses": result["losses"], "full": {k: v.cpu() for k, v in result["full"].items()},
                "torch": str(torch.__version__)}, args.out)


if __name__ == "__main__":
    main()
