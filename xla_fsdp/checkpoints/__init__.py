"""Sharded checkpoints: per-rank files, consolidation, offline resizing, torch_xla migration."""
from .consolidate import consolidate_sharded_model_checkpoints, write_consolidated
from .reader import ShardedCheckpoint
from .full_state import (full_optim_state_dict, full_state_dict, load_full_optim_state_dict,
                         load_full_state_dict)
from .files import CheckpointError, find_rank_files, rank_path
from .pretrained import LoadResult, load_pretrained
from .resizing import resize_checkpoint
from .resume import (ResumedState, TrainingCheckpoint, latest_checkpoint, resume_training,
                     save_training_checkpoint)
from .sharded import load_sharded_checkpoint, optimizer_param_keys, save_sharded_checkpoint

__all__ = [
    "CheckpointError", "LoadResult", "ResumedState", "ShardedCheckpoint", "TrainingCheckpoint",
    "consolidate_sharded_model_checkpoints", "find_rank_files", "full_optim_state_dict", "full_state_dict",
    "load_full_optim_state_dict", "latest_checkpoint", "load_full_state_dict", "load_pretrained",
    "load_sharded_checkpoint", "optimizer_param_keys", "rank_path", "resize_checkpoint",
    "resume_training", "save_sharded_checkpoint", "save_training_checkpoint", "write_consolidated"
]
