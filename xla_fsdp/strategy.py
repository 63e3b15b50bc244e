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
from typing import Any, Dict, List, Optional, Sequence


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


def groups_from_torch(process_group: Any, device_mesh: Any, strategy: Optional[Any]) -> Optional[List[List[int]]]:
    """PyTorch FSDP's ``process_group`` (one group, or ``(shard_group, replicate_group)`` for the
    hybrid strategies) or ``device_mesh`` (1-D, or 2-D ``(replicate, shard)``) as xla_fsdp's shard
    groups: ``None`` when one group spans every rank. A tuple's shard groups are gathered from the
    ranks (a collective: every rank constructs the wrapper, as with PyTorch FSDP)."""
    import torch.distributed as dist
    if process_group is not None and device_mesh is not None:
        raise ValueError("xla_fsdp: give process_group or device_mesh, not both")
    world = dist.get_world_size()

    def ranks_of(group: Any) -> List[int]:
        if group is None or group is dist.GroupMember.WORLD:
            return list(range(world))
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"xla_fsdp: rank {dist.get_rank()} is not in the process group it was given; every "
                             "rank passes a group that holds it")
        return dist.get_process_group_ranks(group)

    if device_mesh is not None:
        ranks = device_mesh.mesh
        if ranks.dim() not in (1, 2):
            raise ValueError(f"xla_fsdp: device_mesh must be 1-D (shard) or 2-D (replicate, shard), got "
                             f"{ranks.dim()}-D")
        groups = [ranks.tolist()] if ranks.dim() == 1 else ranks.tolist()
    elif isinstance(process_group, (tuple, list)):
        if len(process_group) != 2:
            raise ValueError("xla_fsdp: process_group as a tuple is (shard_group, replicate_group)")
        shard_group, replicate_group = process_group
        everyone: List[Any] = [None] * world
        dist.all_gather_object(everyone, ranks_of(shard_group))
        groups = [list(g) for g in sorted({tuple(g) for g in everyone})]
        mine = next(g for g in groups if dist.get_rank() in g)
        replicas = next(r for r in transpose_groups(groups) if dist.get_rank() in r) if len(groups) > 1 else []
        if replicate_group is not None and len(groups) > 1 and \
                sorted(ranks_of(replicate_group)) != sorted(replicas):
            raise ValueError(f"xla_fsdp: the replicate group {ranks_of(replicate_group)} is "
                             f"not the ranks at this rank's place in the other shard groups ({replicas}; shard "
                             f"group {mine})")
    else:
        groups = [ranks_of(process_group)]
    if len(groups) == 1:
        if sorted(groups[0]) != list(range(world)):
            raise ValueError(f"xla_fsdp: a process group of some ranks ({groups[0]}) is not supported alone; "
                             "for hybrid sharding pass (shard_group, replicate_group) or a 2-D device_mesh, or "
                             "list every group with sharding_groups=[[...], ...]")
        return None
    if strategy is None or not parse_strategy(strategy).is_hybrid:
        raise ValueError(f"xla_fsdp: shard groups {groups} from process_group/device_mesh need "
                         "sharding_strategy=HYBRID_SHARD or HYBRID_SHARD_ZERO2")
    return groups


def resolve_torch_group_keywords(keywords: Dict[str, Any]) -> None:
    """The wrapper's keywords, in place: PyTorch FSDP's ``process_group``/``device_mesh`` become
    ``sharding_groups``."""
    process_group, device_mesh = keywords.pop("process_group"), keywords.pop("device_mesh")
    if process_group is None and device_mesh is None:
        return
    if keywords["sharding_groups"] is not None:
        raise ValueError("xla_fsdp: give sharding_groups or process_group/device_mesh, not both")
    keywords["sharding_groups"] = groups_from_torch(process_group, device_mesh, keywords["sharding_strategy"])
