"""Sharding strategies (the names PyTorch FSDP and HF Accelerate use) and the rank groups they imply.

A strategy decides two things: whether full parameters are freed after forward (ZeRO-3) or kept
until after backward (ZeRO-2), and how ranks are grouped. Ranks in one *shard group* split every
parameter between them; ranks at the same position of different shard groups form a *replica
group* and all-reduce their gradient shards. Pure functions (no process group needed to test
them), except :func:`plan_for_unit`, which asks the runtime for this rank's place.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence


class ShardingStrategy(enum.Enum):
    """Numbered as PyTorch FSDP and Accelerate's ``fsdp_sharding_strategy`` (1-5)."""

    FULL_SHARD = 1          # ZeRO-3: shard over all ranks, free full parameters after forward
    SHARD_GRAD_OP = 2       # ZeRO-2: shard over all ranks, keep full parameters until after backward
    NO_SHARD = 3            # DDP-like: every rank holds everything, gradients all-reduced
    HYBRID_SHARD = 4        # ZeRO-3 inside each shard group, gradients all-reduced across groups
    HYBRID_SHARD_ZERO2 = 5  # ZeRO-2 inside each shard group, gradients all-reduced across groups

    @property
    def reshard_after_forward(self) -> bool:
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)


def parse_strategy(value: Any) -> ShardingStrategy:
    """Accept our enum, PyTorch's ``ShardingStrategy`` members, names (any case, with or without
    PyTorch's leading underscore) and Accelerate's numbers 1-5 (int or string)."""
    if isinstance(value, ShardingStrategy):
        return value
    if isinstance(value, enum.Enum):  # torch.distributed.fsdp.ShardingStrategy
        value = value.name
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return ShardingStrategy(value)
        except ValueError:
            pass
    elif isinstance(value, str):
        key = value.strip().upper().lstrip("_")
        if key in ShardingStrategy.__members__:
            return ShardingStrategy[key]
    names = ", ".join(f"{s.value}={s.name}" for s in ShardingStrategy)
    raise ValueError(f"xla_fsdp: unknown sharding_strategy {value!r}; use one of {names}")


@dataclass(frozen=True)
class GroupPlan:
    """Who shards with whom, seen from one rank (global ranks throughout)."""

    shard_groups: List[List[int]]
    replica_groups: List[List[int]]   # [] when gradients need no cross-group all-reduce
    shard_rank: int
    shard_size: int

    @property
    def num_replicas(self) -> int:
        return len(self.replica_groups[0]) if self.replica_groups else 1


def _check_partition(groups: Sequence[Sequence[int]], world_size: int) -> None:
    flat = [r for g in groups for r in g]
    if sorted(flat) != list(range(world_size)) or len({len(g) for g in groups}) != 1:
        raise ValueError(f"xla_fsdp: sharding groups {list(map(list, groups))} must split ranks 0..{world_size - 1} "
                         "into disjoint groups of equal size")


def transpose_groups(shard_groups: Sequence[Sequence[int]]) -> List[List[int]]:
    """Replica groups: the i-th rank of every shard group together."""
    return [list(ranks) for ranks in zip(*shard_groups)]


def plan_groups(strategy: ShardingStrategy, world_size: int, rank: int,
                hybrid_shard_size: Optional[int] = None,
                sharding_groups: Optional[Sequence[Sequence[int]]] = None) -> GroupPlan:
    """The shard and replica groups for ``strategy`` on ``world_size`` ranks.

    Hybrid strategies shard within ``sharding_groups`` when given, else within consecutive blocks of
    ``hybrid_shard_size`` ranks (one host's devices, by default chosen by the caller).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"xla_fsdp: rank {rank} outside world size {world_size}")
    if strategy is ShardingStrategy.NO_SHARD:
        shard_groups = [[r] for r in range(world_size)]
    elif strategy.is_hybrid:
        if sharding_groups:
            shard_groups = [list(g) for g in sharding_groups]
        else:
            if not hybrid_shard_size or hybrid_shard_size < 1 or world_size % hybrid_shard_size:
                raise ValueError(f"xla_fsdp: {strategy.name} needs a shard group size dividing the world size "
                                 f"{world_size}, got hybrid_shard_size={hybrid_shard_size}; pass "
                                 "hybrid_shard_size=N (ranks per shard group) or sharding_groups=[[...], ...]")
            k = hybrid_shard_size
            shard_groups = [list(range(i, i + k)) for i in range(0, world_size, k)]
    else:
        shard_groups = [list(range(world_size))]
    _check_partition(shard_groups, world_size)
    mine = next(g for g in shard_groups if rank in g)
    replica_groups = transpose_groups(shard_groups) if len(shard_groups) > 1 else []
    return GroupPlan(shard_groups, replica_groups, mine.index(rank), len(mine))


def plan_for_unit(strategy: Optional[Any], reshard_after_forward: Optional[bool], transport: str,
                  sharding_groups, sharding_rank, sharding_world_size, hybrid_shard_size):
    """A wrapper's keywords -> (strategy, reshard_after_forward, shard groups, shard rank, shard
    size, replica groups); asks the runtime for this rank's place.

    Without ``sharding_strategy`` the torch_xla keywords keep their meaning: ``reshard_after_forward``
    picks ZeRO-3/ZeRO-2 and ``sharding_groups`` shards within groups with no cross-group reduction
    (model-parallel layouts reduce across groups themselves)."""
    if strategy is None:
        raf = True if reshard_after_forward is None else reshard_after_forward
        chosen = ShardingStrategy.FULL_SHARD if raf else ShardingStrategy.SHARD_GRAD_OP
        return chosen, raf, sharding_groups, sharding_rank, sharding_world_size, None
    chosen = parse_strategy(strategy)
    if reshard_after_forward is not None and reshard_after_forward != chosen.reshard_after_forward:
        raise ValueError(f"xla_fsdp: reshard_after_forward={reshard_after_forward} contradicts "
                         f"sharding_strategy={chosen.name}; give one of them")
    if sharding_groups is not None and not chosen.is_hybrid:
        raise ValueError(f"xla_fsdp: sharding_groups only combine with HYBRID_SHARD/HYBRID_SHARD_ZERO2 "
                         f"(got {chosen.name}); leave sharding_strategy unset for torch_xla's meaning")
    from .collectives import global_rank_and_size, ranks_per_host
    rank, world = global_rank_and_size(transport)
    if chosen.is_hybrid and sharding_groups is None and hybrid_shard_size is None:
        hybrid_shard_size = ranks_per_host(transport)
    plan = plan_groups(chosen, world, rank, hybrid_shard_size, sharding_groups)
    if sharding_world_size is not None and (sharding_world_size, sharding_rank) != (plan.shard_size, plan.shard_rank):
        raise ValueError(f"xla_fsdp: sharding_rank/sharding_world_size {sharding_rank}/{sharding_world_size} do "
                         f"not match this rank's place {plan.shard_rank}/{plan.shard_size} in {plan.shard_groups}")
    groups = plan.shard_groups if len(plan.shard_groups) > 1 else None
    return (chosen, chosen.reshard_after_forward, groups, plan.shard_rank if groups else None,
            plan.shard_size if groups else None, plan.replica_groups or None)
