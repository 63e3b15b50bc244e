"""Sharding strategies: names and numbers, the rank groups they imply, keyword conflicts, and
optimizer groups by original name. Multi-rank equivalence and bytes per strategy live in
test_equivalence (configs ``strategy_*``, ``wd_groups_flat_lm_adamw``)."""

import pytest
import torch
import torch.nn as nn
from hypothesis import given, strategies as st

import harness
import models
from xla_fsdp import ShardingStrategy, XlaFullyShardedDataParallel as FSDP
from xla_fsdp.strategy import parse_strategy, plan_groups


def test_strategy_names_numbers_and_torch_enum():
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    assert parse_strategy("FULL_SHARD") is ShardingStrategy.FULL_SHARD
    assert parse_strategy("shard_grad_op") is ShardingStrategy.SHARD_GRAD_OP
    assert parse_strategy(3) is ShardingStrategy.NO_SHARD
    assert parse_strategy("4") is ShardingStrategy.HYBRID_SHARD
    assert parse_strategy("_HYBRID_SHARD_ZERO2") is ShardingStrategy.HYBRID_SHARD_ZERO2
    for member in TorchStrategy:
        assert parse_strategy(member).name == member.name.lstrip("_")
        assert parse_strategy(member).value == member.value
    for bad in ("ZERO3", 0, 6, True, None):
        with pytest.raises(ValueError, match="unknown sharding_strategy .* 1=FULL_SHARD"):
            parse_strategy(bad)


@given(shard=st.integers(1, 8), replicas=st.integers(1, 8), data=st.data(),
       strategy=st.sampled_from(list(ShardingStrategy)))
@pytest.mark.fast
def test_group_plans_partition_the_ranks(shard, replicas, data, strategy):
    world = shard * replicas
    rank = data.draw(st.integers(0, world - 1))
    plan = plan_groups(strategy, world, rank, hybrid_shard_size=shard)
    expected_size = {ShardingStrategy.NO_SHARD: 1, ShardingStrategy.HYBRID_SHARD: shard,
                     ShardingStrategy.HYBRID_SHARD_ZERO2: shard}.get(strategy, world)
    assert plan.shard_size == expected_size
    assert sorted(r for g in plan.shard_groups for r in g) == list(range(world))
    mine = [g for g in plan.shard_groups if rank in g]
    assert len(mine) == 1 and mine[0][plan.shard_rank] == rank
    if len(plan.shard_groups) > 1:  # every rank is in one replica group, with the same position
        assert sorted(r for g in plan.replica_groups for r in g) == list(range(world))
        for group in plan.replica_groups:
            positions = {next(g.index(r) for g in plan.shard_groups if r in g) for r in group}
            assert len(positions) == 1 and len(group) == world // expected_size
    else:
        assert plan.replica_groups == [] and plan.num_replicas == 1


def test_group_plan_errors_name_the_fix():
    with pytest.raises(ValueError, match="hybrid_shard_size=N"):
        plan_groups(ShardingStrategy.HYBRID_SHARD, 6, 0, hybrid_shard_size=4)
    with pytest.raises(ValueError, match="disjoint groups of equal size"):
        plan_groups(ShardingStrategy.HYBRID_SHARD, 4, 0, sharding_groups=[[0, 1], [1, 2, 3]])
    assert plan_groups(ShardingStrategy.HYBRID_SHARD, 4, 3, sharding_groups=[[0, 2], [1, 3]]).replica_groups == \
        [[0, 1], [2, 3]]


def test_keywords_map_onto_strategies(gloo):
    assert FSDP(nn.Linear(2, 2)).sharding_strategy is ShardingStrategy.FULL_SHARD
    zero2 = FSDP(nn.Linear(2, 2), reshard_after_forward=False)
    assert zero2.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP and not zero2.reshard_after_forward
    assert not FSDP(nn.Linear(2, 2), sharding_strategy=2).reshard_after_forward
    with pytest.raises(ValueError, match="contradicts sharding_strategy=FULL_SHARD"):
        FSDP(nn.Linear(2, 2), sharding_strategy="FULL_SHARD", reshard_after_forward=False)
    with pytest.raises(ValueError, match="only combine with HYBRID_SHARD"):
        FSDP(nn.Linear(2, 2), sharding_strategy="NO_SHARD", sharding_groups=[[0]])
    with pytest.raises(ValueError, match="output_dtype must be"):
        FSDP(nn.Linear(2, 2), output_dtype=torch.int32)


def test_flattened_shard_mixing_optimizer_options_is_a_clear_error(gloo):
    model = FSDP(models.make_model("lm"), flatten_parameters=True)
    options = lambda n: {"weight_decay": 0.0} if harness.no_decay(n) else {}  # noqa: E731
    with pytest.raises(ValueError, match="different optimizer options.*flatten_group_fn"):
        model.optimizer_param_groups(options)
    split = FSDP(models.make_model("lm"), flatten_parameters=True,
                 flatten_group_fn=lambda name, p: harness.no_decay(name))
    groups = split.optimizer_param_groups(options)
    assert sorted(str(g.get("weight_decay")) for g in groups) == ["0.0", "None"]
    assert sum(p.numel() for g in groups for p in g["params"]) == \
        sum(p.numel() for p in models.make_model("lm").parameters())
    names = [n for n, _ in split.get_original_names_and_sharded_parameters()]
    # decayed matrices, the no-decay matrix (pos), the vectors (never flattened with matrices)
    assert names == ["flat_param_0", "flat_param_2", "flat_param_3"]


def test_flat_shards_keep_vectors_apart_from_matrices(gloo):
    """Norm scales and biases get a flat shard of their own (see ``flat_parts``), so a rule on
    dimensions forms optimizer groups without ``flatten_group_fn``."""
    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2, bias=False)),
                 flatten_parameters=True)
    groups = model.gather_groups
    assert [g.flat_name for g in groups] == ["flat_param_0", "flat_param_2"]
    assert [sorted(g.names) for g in groups] == [["0.weight", "2.weight"], ["0.bias", "1.bias", "1.weight"]]
    options = model.optimizer_param_groups(lambda n: {"weight_decay": 0.0} if n.endswith(("bias", "1.weight")) else {})
    assert sorted(str(g.get("weight_decay")) for g in options) == ["0.0", "None"]


def test_weight_decay_groups_change_training():
    """The equivalence of ``wd_groups_flat_lm_adamw`` (1e-6) means something: decaying every
    parameter instead moves the parameters by far more than that tolerance."""
    grouped = harness.train_reference("wd_groups_flat_lm_adamw", 2)["state_dict"]
    model = models.make_model("lm")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.5, eps=1e-6)
    for step in range(harness.STEPS):
        opt.zero_grad()
        losses = [models.loss_fn("lm", model(x), y) for x, y in (models.batch("lm", step, r) for r in range(2))]
        torch.stack(losses).mean().backward()
        opt.step()
    worst = max((grouped[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert worst > 1e-4


def test_only_small_groups_share_a_collective():
    """On coalescing transports groups from 1 Mi elements up gather alone (sharing copies the full
    data once more); the small ones share, and a lone small one is not 'shared' with nobody."""
    from types import SimpleNamespace

    from xla_fsdp.unit.options import SOLO_NUMEL
    from xla_fsdp.unit.group_comms import split_for_coalescing

    def groups(sizes, coalesces=True):
        comms = SimpleNamespace(coalesces=coalesces)
        return [SimpleNamespace(comms=comms, layout=SimpleNamespace(padded_numel=n), n=n) for n in sizes]

    def sizes(split):
        return tuple([g.n for g in part] for part in split)

    big, small = SOLO_NUMEL, SOLO_NUMEL - 1
    assert sizes(split_for_coalescing(groups([big, 10, small, 3 * big]))) == ([big, 3 * big], [10, small])
    assert sizes(split_for_coalescing(groups([big, 10]))) == ([big, 10], [])
    assert sizes(split_for_coalescing(groups([10, 20], coalesces=False))) == ([10, 20], [])
    assert sizes(split_for_coalescing(groups([10]))) == ([10], [])
