"""The Hugging Face Trainer's XLA FSDP paths hand the model they wrapped to the Trainer, as transformers
4.x did, so its optimizer is built on the wrapped model's shards."""
from __future__ import annotations

import functools
from types import ModuleType


def patch_trainer_wrap(trainer_module: ModuleType) -> bool:
    """transformers 5.x's ``Trainer._wrap_model`` returns the XLA FSDP model (v1 and FSDPv2) without
    making it ``self.model``, which 4.x's did; ``_prepare_for_training`` then takes the branch for a model
    wrapped outside Accelerate and never builds the optimizer it delayed for FSDP, and the first step
    fails (``'NoneType' object has no attribute 'param_groups'``, with torch_xla's FSDP as with ours).
    Here the wrapped model becomes ``self.model`` again, so the Trainer prepares it with Accelerate
    (whose clipping then finds it) and builds its optimizer from it. A no-op on 4.x, which does that
    itself. Returns whether the Trainer was there to patch."""
    trainer_cls = getattr(trainer_module, "Trainer", None)
    if trainer_cls is None or not hasattr(trainer_cls, "_wrap_model"):
        return False
    from .. import patches

    original = patches.original(trainer_cls, "_wrap_model")

    @functools.wraps(original)
    def _wrap_model(self, model, *args, **kwargs):
        wrapped = original(self, model, *args, **kwargs)
        if getattr(self, "is_fsdp_xla_enabled", False) and wrapped is not model and self.optimizer is None:
            self.model = wrapped
        return wrapped

    return patches.replace(trainer_cls, "_wrap_model", _wrap_model,
                           "the HF Trainer builds its optimizer on the model its XLA FSDP path wrapped "
                           "(transformers 5.x never builds it there)")
