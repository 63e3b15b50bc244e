"""The changes xla_fsdp makes to torch, torch_xla, Accelerate, the HF Trainer and the process
environment, in one registry, each undoable. What is not in it is listed at the end.

Importing xla_fsdp changes nothing. A few changes are needed at run time, and each is installed by
the code that needs it, through this module, with its reason:

- several XLA:CPU devices as threads of one process (tests, laptops; not TPU):
  :func:`xla_fsdp.enable_xla_cpu_devices`, called by :func:`xla_fsdp.launch`, ``python -m
  xla_fsdp.compat`` (in each process, once it imports torch_xla) and the examples;
- the first XLA unit built: torch_xla's ``xm.optimizer_step`` must not all-reduce FSDP shard gradients
  again (``XLA_FSDP_PATCH_TORCH_XLA=0`` keeps it out);
- the first unit built: one optimizer step pre-hook that refuses an optimizer built before wrapping;
- ``replace_torch_xla_fsdp()``: Accelerate's and the HF Trainer's XLA FSDP paths (the Trainer's once the
  program imports it: :func:`after_import`).
- the first unit on XLA: plain ``nn.Linear`` modules it takes get a forward of their own, per instance
  (``unit/patched_linear.py``; ``_use_xla_patched_linear=False`` keeps it out), listed once, undone
  for every such instance;
- exit handlers, registered once per process: the torch transport waits (up to 10 s) until gloo/NCCL
  let go of its collectives' tensors (``collectives/torch_dist.py``), and the checkpoint folder locks
  this process holds are released (``checkpoints/folder_lock.py``).

:func:`installed` lists what is in place, :func:`uninstall` puts the originals back (all, or what one
:func:`scope` added).

Not in the registry, so neither listed by :func:`installed` nor undone by :func:`uninstall`:

- changes to the objects a program hands to xla_fsdp that make them sharded, which live and go with
  those objects: children replaced by units (``wrap.recursive_wrap``); the original parameters, emptied
  and marked (``unit/gather_group.py``); the forward ``checkpoint_module`` replaces (``remat.py``); the
  class and unit ``fully_shard`` gives a module (``fsdp2.py``); the step post-hook and attributes the
  optimizer check adds to each optimizer (``unit/optimizer_check.py``);
- SIGINT handlers set for the length of a call and restored when it returns
  (``collectives/xla_launch.py``, ``checkpoints/safe_file.py``);
- what the program asks for by name: ``xla_fsdp.spmd.enable()`` calls torch_xla's ``use_spmd()``
  (``spmd/mesh.py``), and resuming a training checkpoint sets the random generators' states
  (``checkpoints/resume.py``).
"""
from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional

_MISSING = object()
_LOCK = threading.RLock()


@dataclass
class Patch:
    """One change: ``target`` names it (``module.attribute``, ``$ENV_VAR`` or ``hook: ...``)."""
    target: str
    reason: str
    undo: Callable[[], None]
    original: Any = None


_INSTALLED: List[Patch] = []


def _name(owner: Any) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return getattr(owner, "__name__", repr(owner))


def _find(target: str) -> Optional[Patch]:
    return next((p for p in _INSTALLED if p.target == target), None)


def is_installed(target: str) -> bool:
    with _LOCK:
        return _find(target) is not None


def replace(owner: Any, attribute: str, value: Any, reason: str) -> bool:
    """Set ``owner.attribute = value`` unless xla_fsdp already replaced it; returns whether it did."""
    target = f"{_name(owner)}.{attribute}"
    with _LOCK:
        if _find(target) is not None:
            return False
        before = owner.__dict__.get(attribute, _MISSING) if isinstance(owner, type) else \
            getattr(owner, attribute, _MISSING)

        def undo() -> None:
            if before is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, before)

        setattr(owner, attribute, value)
        _INSTALLED.append(Patch(target, reason, undo, None if before is _MISSING else before))
        return True


def original(owner: Any, attribute: str) -> Any:
    """The attribute as it was before xla_fsdp replaced it (the current one when it did not)."""
    with _LOCK:
        patch = _find(f"{_name(owner)}.{attribute}")
    return patch.original if patch is not None else getattr(owner, attribute)


def set_item(mapping: Any, key: str, value: Any, target: str, reason: str) -> bool:
    """``mapping[key] = value`` (``sys.modules`` entries), undone by putting back what was there."""
    with _LOCK:
        if _find(target) is not None:
            return False
        before = mapping.get(key, _MISSING)

        def undo() -> None:
            if before is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = before

        mapping[key] = value
        _INSTALLED.append(Patch(target, reason, undo, None if before is _MISSING else before))
        return True


def set_env_default(name: str, value: str, reason: str) -> bool:
    """``os.environ.setdefault(name, value)``, undone by removing it again; returns whether it set it."""
    target = f"${name}"
    with _LOCK:
        if name in os.environ:
            return False
        os.environ[name] = value
        _INSTALLED.append(Patch(target, reason, lambda: os.environ.pop(name, None)))
        return True


def add_hook(target: str, register: Callable[[], Any], reason: str) -> bool:
    """Call ``register()`` (which returns a ``RemovableHandle``) unless ``target`` is installed;
    ``handle.remove()`` undoes it. Returns whether it registered."""
    with _LOCK:
        if _find(target) is not None:
            return False
        handle = register()
        _INSTALLED.append(Patch(target, reason, handle.remove))
        return True


def at_exit(target: str, handler: Callable[[], None], reason: str) -> bool:
    """``atexit.register(handler)`` unless ``target`` is installed; ``atexit.unregister`` undoes it.
    Returns whether it registered."""
    with _LOCK:
        if _find(target) is not None:
            return False
        atexit.register(handler)
        _INSTALLED.append(Patch(target, reason, lambda: atexit.unregister(handler)))
        return True


def record(target: str, undo: Callable[[], None], reason: str) -> bool:
    """List a change the caller makes itself (to each instance of a class it is handed, say) under
    ``target``, once; ``undo()`` puts every such change back. Returns whether it was not listed yet."""
    with _LOCK:
        if _find(target) is not None:
            return False
        _INSTALLED.append(Patch(target, reason, undo))
        return True


class _ThenApply(importlib.abc.Loader):
    """A module's own loader, followed by ``apply(module)`` once the module has run."""

    def __init__(self, loader: Any, apply: Callable[[Any], Any]):
        self.loader, self.apply = loader, apply

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.apply(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for whoever reads the module
        if name == "loader":  # (not set yet: a copy being built)
            raise AttributeError(name)
        return getattr(self.loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: finds ``name`` through the other finders, and gives its spec a loader
    that calls ``apply`` after the module's own code; answers nothing for any other module."""

    def __init__(self, name: str, apply: Callable[[Any], Any]):
        self.name, self.apply, self.finding = name, apply, False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name or self.finding:
            return None
        self.finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.finding = False
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenApply(spec.loader, self.apply)
        return spec


def after_import(module: str, apply: Callable[[Any], Any], reason: str) -> bool:
    """``apply(module)`` now if ``module`` is imported, else right after its import (a finder on
    ``sys.meta_path``, taken out again by :func:`uninstall`): for changes to a library the program may
    import later. ``apply`` lists its own changes. Returns whether it was not listed yet."""
    target = f"after import: {module}"
    with _LOCK:
        if _find(target) is not None:
            return False
        finder = _AfterImport(module, apply)
        _INSTALLED.append(Patch(target, reason, lambda: sys.meta_path.remove(finder) if finder in sys.meta_path
                                else None))
        if module in sys.modules:
            apply(sys.modules[module])
        else:
            sys.meta_path.insert(0, finder)
        return True


def installed() -> List[Patch]:
    """What xla_fsdp has changed outside itself, oldest first."""
    with _LOCK:
        return list(_INSTALLED)


def uninstall(patches: Optional[List[Patch]] = None) -> None:
    """Undo ``patches`` (default: every one), newest first."""
    with _LOCK:
        chosen = list(_INSTALLED) if patches is None else [p for p in patches if p in _INSTALLED]
        for patch in reversed(chosen):
            patch.undo()
            _INSTALLED.remove(patch)


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Undo, on leaving, what was installed inside (what was in place before stays)."""
    with _LOCK:
        before = list(_INSTALLED)
    try:
        yield
    finally:
        with _LOCK:
            added = [p for p in _INSTALLED if p not in before]
        uninstall(added)
