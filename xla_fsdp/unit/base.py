"""What every layer may know about a unit without importing the wrapper (imports run one way: the
public wrapper imports the layers below it, never the reverse). As PyTorch's FSDP2 keeps its state
apart from ``fully_shard``, "is this module a unit?" and unit walks ask this base class."""
from __future__ import annotations

import torch.nn as nn


class ShardedUnit(nn.Module):
    """Base of :class:`~xla_fsdp.XlaFullyShardedDataParallel`: a module whose parameters xla_fsdp shards."""


def is_unit(module: nn.Module) -> bool:
    return isinstance(module, ShardedUnit)

