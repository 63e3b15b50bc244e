"""The Hugging Face Trainer's FSDPv2 path (``fsdp_config={"xla": True, "xla_fsdp_v2": True}``) on
xla_fsdp's SPMD mode, with checkpoints that hold the weights under their real names."""
from __future__ import annotations

import functools
import sys

#: the Trainer's checkpoint methods that branch on ``is_fsdp_xla_v1_enabled``
CHECKPOINT_METHODS = ("_save_tpu", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler")


def patch_trainer_for_spmd() -> bool:
    """The Trainer saves an FSDPv2 model with ``save_pretrained(state_dict=wrapper.state_dict())``
    (no branch of its own: huggingface/transformers#36004), which with xla_fsdp would write shard
    names nobody can load. When the Trainer's model is xla_fsdp's SPMD class, its checkpoint
    methods take their XLA FSDP (v1) branch instead, which fits xla_fsdp at any world size:
    per-rank files with shard metadata (here one, the SPMD mode's single logical rank) for the
    model and the optimizer, and a consolidated ``save_pretrained`` checkpoint, which is also what
    a resumed run loads before wrapping. Applied when a program reads FSDPv2's class through
    ``xla_fsdp.compat`` (the Trainer imports it as it wraps); returns whether the Trainer was there."""
    trainer_module = sys.modules.get("transformers.trainer")
    if trainer_module is None:
        return False
    from .. import patches
    from ..spmd import SpmdFullyShardedDataParallel

    trainer_cls = trainer_module.Trainer
    for name in CHECKPOINT_METHODS:
        original = patches.original(trainer_cls, name) if hasattr(trainer_cls, name) else None
        if original is None:
            continue

        def take_v1_branch(self, *args, _original=original, **kwargs):
            if isinstance(getattr(self, "model", None), SpmdFullyShardedDataParallel):
                self.is_fsdp_xla_v1_enabled = True
            return _original(self, *args, **kwargs)

        patches.replace(trainer_cls, name, functools.wraps(original)(take_v1_branch),
                        "the HF Trainer saves an xla_fsdp SPMD model through its XLA FSDP (v1) branch")
    return True
