"""xla_fsdp: Fully Sharded Data Parallel (ZeRO-2/ZeRO-3) for PyTorch/XLA, with a torch.distributed
fallback, as a drop-in for ``torch_xla.distributed.fsdp``.

Importing it changes nothing outside the package; what it changes later, and why, is listed (and
undone) by :mod:`xla_fsdp.patches`."""
from ._version import __version__

from .checkpoints import (consolidate_sharded_model_checkpoints, latest_checkpoint, load_pretrained,
                          load_sharded_checkpoint, resize_checkpoint, resume_training,
                          save_sharded_checkpoint, save_training_checkpoint)
from .collectives.xla import sync
from .collectives.xla_launch import enable_xla_cpu_devices, launch
from .compat import replace_torch_xla_fsdp
from .fully_sharded_data_parallel import XlaFullyShardedDataParallel
from .remat import checkpoint_module
from .strategy import ShardingStrategy
from .unit.construction import storage_only

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ShardingStrategy",
    "XlaFullyShardedDataParallel",
    "checkpoint_module",
    "consolidate_sharded_model_checkpoints",
    "enable_xla_cpu_devices",
    "fully_shard",
    "latest_checkpoint",
    "launch",
    "load_pretrained",
    "load_sharded_checkpoint",
    "replace_torch_xla_fsdp",
    "resize_checkpoint",
    "resume_training",
    "save_sharded_checkpoint",
    "save_training_checkpoint",
    "storage_only",
    "sync",
    "__version__",
]


#: FSDP2's names (:mod:`xla_fsdp.fsdp2`), imported on first use: importing torch.distributed.fsdp
#: costs ~70 ms and makes a temp folder (torch.distributed.nn's) in every process
_FSDP2_NAMES = ("CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "fully_shard")


def __getattr__(name: str):
    if name in _FSDP2_NAMES:
        from . import fsdp2
        return getattr(fsdp2, name)
    raise AttributeError(f"module 'xla_fsdp' has no attribute {name!r}")
