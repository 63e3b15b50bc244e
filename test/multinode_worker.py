"""One rank of a multi-node run, started by torchrun (test_multinode): trains the configs named on
the command line for harness.STEPS steps on gloo and writes its results with torchrun's topology."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from ranks import Rank, end_process_group  # noqa: E402


def _refusals() -> dict:
    """PyTorch FSDP group arguments xla_fsdp cannot honour: each must raise, naming the fix."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    world, per_host = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world // per_host, per_host), mesh_dim_names=("replicate", "shard"))
    some = dist.new_group(list(range(per_host)))  # every rank creates it, as torch requires
    attempts = {
        "subset_group": dict(process_group=some, sharding_strategy="FULL_SHARD"),
        "mesh_without_hybrid": dict(device_mesh=mesh),
        "both": dict(device_mesh=mesh, process_group=some, sharding_strategy="HYBRID_SHARD"),
        "wrong_replicate": dict(process_group=(mesh.get_group("shard"), mesh.get_group("shard")),
                                sharding_strategy="HYBRID_SHARD"),
    }
    errors = {}
    for what, kwargs in attempts.items():
        try:
            FSDP(nn.Linear(4, 4), **kwargs)
            errors[what] = "no error"
        except ValueError as e:
            errors[what] = str(e)
    return errors


def main() -> None:
    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        me = Rank.of_torch_group()
        rank = me.rank
        results = {n: harness.train_sharded(me, n) for n in names}
        results["refusals"] = _refusals()
        results["env"] = {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                           "GROUP_RANK")}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_process_group()


if __name__ == "__main__":
    main()
