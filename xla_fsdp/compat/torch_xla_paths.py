"""torch_xla's FSDP module names (``torch_xla.distributed.fsdp`` and its ``wrap``, ``utils``,
``state_dict_utils``, ``xla_fully_sharded_data_parallel``, ``consolidate_sharded_ckpts``, and FSDPv2's
``torch_xla.experimental.spmd_fully_sharded_data_parallel``) served by
xla_fsdp, swapped in place in ``sys.modules`` so modules that imported them before see xla_fsdp too."""
from __future__ import annotations

import sys
import types
from typing import Any, Dict

from .. import patches
from .. import wrap as _wrap
from ..checkpoints import consolidate_sharded_model_checkpoints
from ..checkpoints.shard_merge import consolidate_sharded_state_dicts
from ..fully_sharded_data_parallel import XlaFullyShardedDataParallel
from ..integrations.accelerate_clipping import patch_accelerate_clipping
from ..integrations.hf_trainer_spmd import patch_trainer_for_spmd
from ..integrations.hf_trainer_wrap import patch_trainer_wrap
from ..remat import checkpoint_module
from . import torch_xla_utils


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def torch_xla_modules() -> Dict[str, types.ModuleType]:
    """torch_xla's FSDP module names and the xla_fsdp modules that stand in for them."""
    from .. import consolidate_sharded_ckpts
    base = "torch_xla.distributed.fsdp"
    utils = _module(f"{base}.utils", checkpoint_module=checkpoint_module,
                    **{name: getattr(torch_xla_utils, name) for name in torch_xla_utils.__all__})
    state_dict_utils = _module(
        f"{base}.state_dict_utils",
        consolidate_sharded_state_dicts=consolidate_sharded_state_dicts,
        consolidate_sharded_model_checkpoints=consolidate_sharded_model_checkpoints,
    )
    fsdp_module = _module(
        f"{base}.xla_fully_sharded_data_parallel", XlaFullyShardedDataParallel=XlaFullyShardedDataParallel
    )
    package = _module(base, XlaFullyShardedDataParallel=XlaFullyShardedDataParallel,
                      consolidate_sharded_state_dicts=consolidate_sharded_state_dicts,
                      consolidate_sharded_model_checkpoints=consolidate_sharded_model_checkpoints,
                      checkpoint_module=checkpoint_module, wrap=_wrap, utils=utils, state_dict_utils=state_dict_utils,
                      xla_fully_sharded_data_parallel=fsdp_module, consolidate_sharded_ckpts=consolidate_sharded_ckpts,
                      __all__=["XlaFullyShardedDataParallel", "consolidate_sharded_state_dicts",
                               "consolidate_sharded_model_checkpoints", "checkpoint_module"])
    package.__path__ = []  # a package: its submodules are the entries below
    from ..spmd import SpmdFullyShardedDataParallel  # FSDPv2, the Hugging Face Trainer's xla_fsdp_v2 path
    spmd_name = "torch_xla.experimental.spmd_fully_sharded_data_parallel"
    spmd_module = _module(spmd_name)

    def spmd_class(name: str) -> Any:  # read when the Trainer (already imported) asks for FSDPv2
        if name != "SpmdFullyShardedDataParallel":
            raise AttributeError(f"module {spmd_name!r} has no attribute {name!r}")
        patch_trainer_for_spmd()
        return SpmdFullyShardedDataParallel
    spmd_module.__getattr__ = spmd_class
    return {spmd_name: spmd_module,
            base: package, f"{base}.wrap": _wrap, f"{base}.utils": utils, f"{base}.state_dict_utils": state_dict_utils,
            f"{base}.xla_fully_sharded_data_parallel": fsdp_module,
            f"{base}.consolidate_sharded_ckpts": consolidate_sharded_ckpts}


def replace_torch_xla_fsdp() -> None:
    """Make ``torch_xla.distributed.fsdp`` (and its modules) resolve to xla_fsdp in this process,
    route Accelerate's gradient clipping of an xla_fsdp model to the model's own (see
    :func:`patch_accelerate_clipping`), and let the HF Trainer build its optimizer on the model it wrapped
    (:func:`patch_trainer_wrap`, once the program imports the Trainer)."""
    import torch_xla.distributed
    import torch_xla.experimental
    why = "torch_xla's FSDP names served by xla_fsdp (replace_torch_xla_fsdp)"
    for name, module in torch_xla_modules().items():
        patches.set_item(sys.modules, name, module, f"sys.modules[{name!r}]", why)
    patches.replace(torch_xla.distributed, "fsdp", sys.modules["torch_xla.distributed.fsdp"], why)
    patches.replace(torch_xla.experimental, "spmd_fully_sharded_data_parallel",
                    sys.modules["torch_xla.experimental.spmd_fully_sharded_data_parallel"], why)
    patch_accelerate_clipping()
    patches.after_import("transformers.trainer", patch_trainer_wrap,
                         "the HF Trainer's XLA FSDP path builds its optimizer on the model it wrapped")
    # Such programs build their model in every device thread from the CPU generator the threads of
    # one process share (XLA:CPU), so their models differ at random: the threads take rank 0's.
    from ..unit import options
    patches.replace(options, "defaults", options.ProcessDefaults(threads_take_rank_0=True),
                    "unchanged torch_xla programs build their model in every XLA:CPU device thread from one CPU "
                    "generator: the threads take rank 0's parameters (replace_torch_xla_fsdp)")
