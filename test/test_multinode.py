"""Past one machine: two torchrun "nodes" of 2 ranks each on this machine's loopback,
real processes and a real c10d rendezvous, the way the multi-node FSDP tutorial starts a job:

    torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:PORT ...

Every strategy trains harness.STEPS AdamW steps and equals the unsharded run (1e-5, losses and
consolidated parameters); the hybrid strategies shard within each node and replicate across the
nodes when given no groups (from LOCAL_WORLD_SIZE), and follow a 2-D DeviceMesh or (shard,
replicate) process groups when given them (here laid across the nodes)."""
import os
import subprocess
import sys

import pytest
import torch

import harness
from ranks import free_port

TOL = 1e-5
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
HYBRID = ["node_hybrid_adamw", "node_hybrid_zero2_adamw"]  # default groups: the ranks of a host
EXPLICIT = ["mesh_hybrid_adamw", "pg_hybrid_zero2_adamw"]  # PyTorch FSDP's device_mesh / (shard, replicate)
CONFIGS = ["strategy_full_shard_adamw", "strategy_shard_grad_op_adamw", "strategy_no_shard_adamw", *HYBRID,
           *EXPLICIT]
HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun_nodes(script_args, port, out_dir, timeout=300):
    """Start one torchrun agent per simulated node; both join one c10d rendezvous."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc_per_node={PER_NODE}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=multinode-test",
               "--max_restarts=0", *script_args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PJRT_DEVICE", None)
    logs = [open(os.path.join(out_dir, f"node{n}.log"), "w") for n in range(NODES)]
    nodes = [subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT) for log in logs]
    try:
        codes = [node.wait(timeout=timeout) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
        for log in logs:
            log.close()
    if any(codes):
        tails = [open(log.name).read()[-3000:] for log in logs]
        pytest.fail(f"torchrun nodes exited with {codes}:\n" + "\n---\n".join(tails))


@pytest.fixture(scope="module")
def multinode_run(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("multinode"))
    torchrun_nodes([os.path.join(HERE, "multinode_worker.py"), out_dir, ",".join(CONFIGS)], free_port(),
                   out_dir)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("name", CONFIGS)
def test_two_nodes_train_as_one_process(multinode_run, name):
    ranks = [r[name] for r in multinode_run]
    ref = harness.train_reference(name, WORLD)
    losses = [sum(r["losses"][s] for r in ranks) / WORLD for s in range(harness.STEPS)]
    loss_dev = max(abs(a - b) for a, b in zip(losses, ref["losses"]))
    assert loss_dev <= TOL, (losses, ref["losses"])
    full = harness.consolidate(ranks)
    assert set(full) == set(ref["state_dict"])
    param_dev = max((full[k] - v).abs().max().item() for k, v in ref["state_dict"].items())
    assert param_dev <= TOL
    print(f"{name}: losses within {loss_dev:.1e}, parameters within {param_dev:.1e}")


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_shards_within_each_node_and_replicates_across_nodes(multinode_run, name):
    nodes = {}
    for result in multinode_run:
        env = result["env"]
        assert env["WORLD_SIZE"] == WORLD and env["LOCAL_WORLD_SIZE"] == PER_NODE
        nodes.setdefault(env["GROUP_RANK"], []).append(env["RANK"])
    node_groups = sorted(sorted(ranks) for ranks in nodes.values())
    assert len(node_groups) == NODES and all(len(g) == PER_NODE for g in node_groups)
    for result in multinode_run:
        md, env = result[name]["metadata"], result["env"]
        assert sorted(sorted(g) for g in md["sharding_groups"]) == node_groups  # shard groups = the nodes
        assert md["world_size"] == PER_NODE and md["rank"] == sorted(nodes[env["GROUP_RANK"]]).index(env["RANK"])
        replicas = [g for g in md["replica_groups"] if env["RANK"] in g]
        assert len(replicas) == 1 and len(replicas[0]) == NODES
        assert {next(n for n, ranks in nodes.items() if r in ranks) for r in replicas[0]} == set(nodes)
    for result in multinode_run:  # full sharding spans every rank of both nodes
        assert result["strategy_full_shard_adamw"]["metadata"]["world_size"] == WORLD


@pytest.mark.parametrize("name", EXPLICIT)
def test_hybrid_follows_a_device_mesh_or_process_groups(multinode_run, name):
    across = [list(range(i, WORLD, PER_NODE)) for i in range(PER_NODE)]  # the mesh's shard axis: [[0, 2], [1, 3]]
    for result in multinode_run:
        md, rank = result[name]["metadata"], result["env"]["RANK"]
        assert md["sharding_groups"] == across and md["world_size"] == NODES
        assert [g for g in md["replica_groups"] if rank in g] == [[r for r in range(WORLD) if r // PER_NODE ==
                                                                  rank // PER_NODE]]


def test_group_arguments_xla_fsdp_cannot_honour_are_refused_on_every_rank(multinode_run):
    for result in multinode_run:
        refused = result["refusals"]
        if result["env"]["RANK"] < PER_NODE:  # in the group of the first node's ranks
            assert "of some ranks" in refused["subset_group"] and "sharding_groups" in refused["subset_group"]
        else:
            assert "is not in the process group" in refused["subset_group"]
        assert "need sharding_strategy=HYBRID_SHARD" in refused["mesh_without_hybrid"]
        assert "not both" in refused["both"]
        assert "replicate group" in refused["wrong_replicate"]
