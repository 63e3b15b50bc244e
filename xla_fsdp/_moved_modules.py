"""Module paths of earlier releases, still importable: ``import xla_fsdp.config`` gives the module
that now lives at ``xla_fsdp.integrations.accelerate_config`` (the same object, so patches and
``isinstance`` checks see one module), with a DeprecationWarning naming the new path. Served by an
import hook, so the old names take no room in the package's file list."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {  # old path -> new path
    "xla_fsdp.backward": "xla_fsdp.unit.backward",
    "xla_fsdp.checkpoint": "xla_fsdp.remat",
    "xla_fsdp.config": "xla_fsdp.integrations.accelerate_config",
    "xla_fsdp.grad_norm": "xla_fsdp.unit.grad_norm",
    "xla_fsdp.metadata": "xla_fsdp.checkpoints.metadata",
    "xla_fsdp.module_view": "xla_fsdp.unit.module_view",
    "xla_fsdp.param_group": "xla_fsdp.unit.param_group",
    "xla_fsdp.param_names": "xla_fsdp.unit.param_names",
    "xla_fsdp.schedule": "xla_fsdp.unit.schedule",
    "xla_fsdp.state_dict": "xla_fsdp.checkpoints.shard_merge",
    "xla_fsdp.tied": "xla_fsdp.unit.tied",
    "xla_fsdp.unit_base": "xla_fsdp.unit.base",
    "xla_fsdp.unit_init": "xla_fsdp.unit.construction",
    "xla_fsdp.unit_options": "xla_fsdp.unit.options",
    "xla_fsdp.usage": "xla_fsdp.unit.gradient_usage",
    "xla_fsdp.xla_patched_linear": "xla_fsdp.unit.patched_linear",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self._own_specs = {}

    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; import it from there", DeprecationWarning,
                      stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        self._own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        # the import system stamped the old path's spec on the module: give it back its own
        module.__spec__ = self._own_specs[module.__name__]


def install() -> None:
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
