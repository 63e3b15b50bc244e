"""xla_fsdp: Fully Sharded Data Parallel (ZeRO-2/ZeRO-3) for PyTorch/XLA, with a torch.distributed
fallback, as a drop-in for ``torch_xla.distributed.fsdp``."""
from .collectives.xla import configure_cpu_environment as _configure_cpu_environment

# Before any XLA runtime starts: the XLA:CPU pool settings multi-device runs need (see collectives/xla.py).
_configure_cpu_environment()

from ._version import __version__  # noqa: E402

from .checkpoints import (consolidate_sharded_model_checkpoints, latest_checkpoint,  # noqa: E402
                          load_sharded_checkpoint, reshard_checkpoint, resume_training, save_sharded_checkpoint,
                          save_training_checkpoint)
from .collectives.xla import sync  # noqa: E402
from .compat import replace_torch_xla_fsdp  # noqa: E402
from .fully_sharded_data_parallel import XlaFullyShardedDataParallel  # noqa: E402
from .remat import checkpoint_module  # noqa: E402
from .strategy import ShardingStrategy  # noqa: E402

__all__ = [
    "ShardingStrategy",
    "XlaFullyShardedDataParallel",
    "checkpoint_module",
    "consolidate_sharded_model_checkpoints",
    "latest_checkpoint",
    "load_sharded_checkpoint",
    "replace_torch_xla_fsdp",
    "reshard_checkpoint",
    "resume_training",
    "save_sharded_checkpoint",
    "save_training_checkpoint",
    "sync",
    "__version__",
]
