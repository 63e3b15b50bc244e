"""The optimizer check every optimizer step runs once a unit exists: an optimizer built before wrapping
(it holds emptied originals) is refused, and one whose update depends on a parameter's shape is
warned about once (its steps on shards differ from unsharded training)."""
from __future__ import annotations

import warnings
from typing import Any

import torch

#: optimizers whose update of a parameter depends on its shape or on its values as a whole, not element by element
_SHAPE_DEPENDENT = ("Adafactor", "LBFGS", "Lamb", "LAMB", "Lars", "LARS", "Shampoo", "Muon")


def _warn_if_shape_dependent(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer that factors a matrix by its rows and columns (Adafactor), scales a whole
    parameter by its norm (LAMB, LARS) or works on whole matrices (Shampoo, Muon) sees 1-D (or dim-0)
    shards here, so its steps differ from unsharded training: said once, at its first step."""
    name = type(optimizer).__name__
    holds_shards = any(getattr(p, "_xla_fsdp_reduced", False) for g in optimizer.param_groups for p in g["params"])
    if holds_shards and any(n in name for n in _SHAPE_DEPENDENT):
        warnings.warn(
            f"xla_fsdp: {name} updates a parameter from its shape or its values as a whole, but it holds xla_fsdp's "
            "shards (1-D or dim-0 blocks of each parameter), so its steps differ from unsharded training. Use an "
            "element-wise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...), which are exact; see docs/usage.md.",
            stacklevel=3)


def install_optimizer_check() -> None:
    """Once per process: every optimizer step first makes sure the optimizer does not hold
    parameters that xla_fsdp replaced with shards. An optimizer built before wrapping holds the
    emptied originals: its steps would change nothing, and training would go on, silently wrong."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from .. import patches

    def check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        count = sum(len(g["params"]) for g in optimizer.param_groups)
        if getattr(optimizer, "_xla_fsdp_checked", None) == count:
            return
        stale = sum(1 for g in optimizer.param_groups for p in g["params"] if getattr(p, "_xla_fsdp_sharded", False))
        if stale:
            raise RuntimeError(
                f"xla_fsdp: this {type(optimizer).__name__} was built before the model was wrapped: {stale} of its "
                f"{count} parameters are originals that XlaFullyShardedDataParallel replaced with shards, so step() "
                "would change nothing. Build the optimizer after wrapping, from the wrapped model: "
                "optimizer = torch.optim.AdamW(fsdp_model.parameters(), ...)")
        _warn_if_shape_dependent(optimizer)
        optimizer._xla_fsdp_checked = count

    patches.add_hook("hook: torch.optim optimizer step pre-hook (xla_fsdp optimizer check)",
                     lambda: register_optimizer_step_pre_hook(check),
                       "an optimizer built before wrapping holds emptied originals: refuse its step")
