"""Pretrained weights straight into a sharded model, each rank reading only the rows of its own shards.

A source is a set of named full tensors on disk: a Hugging Face folder (``model.safetensors`` or shards
with ``model.safetensors.index.json``), one ``.safetensors`` file, a consolidated ``.pth``/``.bin``, or a
DCP folder. A read takes an element range of one tensor: from a safetensors file with ``preadv`` straight
into the shard (no mapping: the file's pages never count in the rank's memory), from a ``.pth`` through a
memory map (the pages of the rank's own rows); a DCP folder is read one whole tensor at a time.
xla_fsdp's own rank files go through ``load_sharded_checkpoint``, which resizes them the same way.

The target is any of: the wrapper or ``fully_shard`` units (their layout says which element range of
each original tensor this rank holds), PyTorch's FSDP2 (a ``DTensor`` sharded on dim 0: its local rows),
or a plain module (every tensor whole: the unsharded reference). Names are the model's own
``state_dict()`` names; a tied parameter is loaded once, from whichever of its names the source holds
(the last in module order, as ``load_state_dict``), and values are cast to the parameter's dtype.
"""
from __future__ import annotations

import math
import os
import re
from typing import Callable, Dict, Iterable, List, NamedTuple, Sequence, Tuple

import torch
import torch.nn as nn

from ..shard_names import clean_name
from ..unit.shard_param import rows_of
from .files import CheckpointError, ModelMismatchError
from .importing import import_rank_files, inputs_of
from .resized_load import entry_members, mismatch_line
from .sources import SafetensorsSource, TensorSource, open_source  # noqa: F401 - the sources' classes, here too


class LoadResult(NamedTuple):
    """As ``load_state_dict``'s result: the model's names the source lacks (they kept their values) and
    the source's names the model lacks (not loaded). Both empty unless ``strict=False``."""
    missing_keys: List[str]
    unexpected_keys: List[str]


class _Slot(NamedTuple):
    """One tensor this rank holds: where its values go, and which part of which originals they are."""
    target: torch.Tensor
    members: List[Tuple[List[str], Tuple[int, ...], int, int, int]]  # (names, full shape, start, end, position)


def _names_by_tensor(module: nn.Module) -> Dict[int, List[str]]:
    """Every name (tied ones included, in module order) of each parameter and persistent buffer."""
    names: Dict[int, List[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    persistent = set(module.state_dict(keep_vars=True))
    for name, b in module.named_buffers(remove_duplicate=False):
        if name in persistent:
            names.setdefault(id(b), []).append(name)
    return names


def _local_rows(p: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
    """PyTorch's FSDP2 parameter (a DTensor sharded on dim 0, or replicated): its local tensor and the
    element range of the full tensor it holds."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if not all(isinstance(pl, (Shard, Replicate)) and (not isinstance(pl, Shard) or pl.dim == 0)
               for pl in p.placements):
        raise CheckpointError(f"a DTensor placed {p.placements} cannot be loaded here: only FSDP2's dim-0 shards "
                              "(Shard(0), Replicate for HSDP)")
    local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    row = math.prod(p.shape[1:]) if p.dim() else 1
    start = (offset[0] if p.dim() else 0) * row
    return p.to_local(), start, start + math.prod(local_shape)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed
        return False
    return isinstance(tensor, DTensor)


def _plain_slots(module: nn.Module) -> Tuple[List[_Slot], Known]:
    slots, known = [], []
    state = module.state_dict(keep_vars=True)
    for names in _names_by_tensor(module).values():
        tensor = state[names[0]] if names[0] in state else module.get_parameter(names[0])
        shape = tuple(tensor.shape)
        known.append((names, shape))
        if _is_dtensor(tensor):
            local, start, end = _local_rows(tensor)
            slots.append(_Slot(local, [(names, shape, start, end, 0)]))
        else:
            slots.append(_Slot(tensor, [(names, shape, 0, math.prod(shape) if shape else 1, 0)]))
    return slots, known


Known = List[Tuple[List[str], Tuple[int, ...]]]  # every tensor of the model: its names and full shape


def _unit_slots(model) -> Tuple[List[_Slot], Known]:
    """xla_fsdp's units: each layout entry is one flat buffer cut into equal chunks; this rank's chunk
    is an element range, which covers element ranges of the entry's original tensors."""
    from ..unit.base import root_unit
    root = root_unit(model)
    metadata = root.get_shard_metadata()
    layout, rank = metadata["layout"], root.rank
    state = root.state_dict(keep_vars=True)
    slots, known = [], []
    for key, entry in layout.items():
        size = math.prod(entry["shard_shape"])
        lo, hi = rank * size, (rank + 1) * size
        members = []
        for (name, offset, numel), shape in zip(entry_members(entry), entry["shapes"]):
            names = [name] + list(entry.get("aliases", {}).get(name, []))
            known.append((names, tuple(shape)))
            start, end = max(lo, offset), min(hi, offset + numel)
            if start < end:
                members.append((names, tuple(shape), start - offset, end - offset, start - lo))
        slots.append(_Slot(rows_of(state[key]), members))  # (fully_shard's ShardParam: the rows it holds)
    held = {n for names, _ in known for n in names}  # fully_shard's state_dict() names a tied alias again
    for key, value in state.items():
        if key not in layout and "_fsdp_shard" not in key and clean_name(key) not in held:
            shape = tuple(value.shape)
            known.append(([clean_name(key)], shape))
            slots.append(_Slot(value, [([clean_name(key)], shape, 0, math.prod(shape) if shape else 1, 0)]))
    return slots, known


def _slots(model: nn.Module) -> Tuple[List[_Slot], Known]:
    from ..unit.base import is_unit
    if is_unit(model):
        return _unit_slots(model)
    if any(is_unit(m) for m in model.modules()):
        raise CheckpointError("the model's root is not sharded, only some of its modules: load into the root unit "
                              "(wrap or fully_shard the root as well, as training does)")
    return _plain_slots(model)


# ----------------------------------------------------------------------------- the load
def _ignored(model: nn.Module, attr: str) -> List[str]:
    """A Hugging Face model's patterns of names to ignore when missing or unexpected (its class attributes)."""
    patterns: List[str] = []
    for m in model.modules():
        found = getattr(type(m), attr, None)
        if found:
            patterns += list(found)
    return patterns


def _plan(model: nn.Module, source: TensorSource, known: Known) -> Tuple[Dict[Tuple[str, ...], str], List[str],
                                                                         List[str]]:
    """Which source name each of the model's tensors (by its names) reads, the missing and the unexpected
    names; raises on a wrong shape. Decided from the whole model, so every rank decides alike."""
    chosen: Dict[Tuple[str, ...], str] = {}
    missing: List[str] = []
    used: set = set()
    for names, shape in known:
        held = [n for n in names if n in source.shapes]
        used.update(held)
        if not held:
            missing.append(names[0])
            continue
        name = held[-1]  # as load_state_dict: the last of a tied parameter's names in module order wins
        if tuple(source.shapes[name]) != tuple(shape):
            raise ModelMismatchError(
                f"'{name}' has shape {list(source.shapes[name])} in '{source.path}' and {list(shape)} in the model: "
                "the model was built from another config than the checkpoint's; build it from the checkpoint's "
                "config")
        chosen[tuple(names)] = name
    unexpected = [n for n in source.shapes if n not in used]
    ignore_missing = _ignored(model, "_keys_to_ignore_on_load_missing")
    ignore_unexpected = _ignored(model, "_keys_to_ignore_on_load_unexpected")
    missing = [n for n in missing if not any(re.search(p, n) for p in ignore_missing)]
    unexpected = [n for n in unexpected if not any(re.search(p, n) for p in ignore_unexpected)]
    return chosen, missing, unexpected


@torch.no_grad()
def load_pretrained(model: nn.Module, path: str, *, strict: bool = True) -> LoadResult:
    """Load pretrained weights from ``path`` into ``model``: each rank reads only the rows of its own shards.

    ``path``: a Hugging Face ``save_pretrained`` folder (``model.safetensors``, or shards with
    ``model.safetensors.index.json``), one ``.safetensors`` file, a consolidated ``.pth``/``.bin``
    (a state dict, or ``{"model": ...}``), a DCP folder, or the prefix of xla_fsdp rank files (any
    world size: see ``load_sharded_checkpoint``). ``model``: wrapped (any layout), ``fully_shard``-ed
    (xla_fsdp's or PyTorch's), or plain; built on the meta device and wrapped, or on the CPU.
    Call it on every rank.

    Names are the model's ``state_dict()`` names; a tied parameter needs one of its names in the source
    (Hugging Face's tied ``lm_head.weight`` is not saved), and a Hugging Face model's
    ``_keys_to_ignore_on_load_missing``/``_unexpected`` are honoured. Strict as ``load_state_dict``: names
    only one side has are a ``ModelMismatchError`` listing them, before anything is loaded;
    ``strict=False`` loads the names both have and returns them. Values are cast to each parameter's
    dtype (a bf16 file into fp32 parameters). A wrong shape or a damaged file is a ``CheckpointError``
    naming it."""
    if not os.path.exists(path) and _is_rank_file_prefix(path):
        from ..unit.base import root_unit
        from .sharded import LoadedCheckpoint, load_sharded_checkpoint
        loaded = load_sharded_checkpoint(root_unit(model), None, path, strict=False)
        assert isinstance(loaded, LoadedCheckpoint)
        if strict and (loaded.missing_keys or loaded.unexpected_keys):
            raise ModelMismatchError(mismatch_line(path, loaded.missing_keys, loaded.unexpected_keys))
        return LoadResult(loaded.missing_keys, loaded.unexpected_keys)
    source = open_source(path)
    try:
        slots, known = _slots(model)
        chosen, missing, unexpected = _plan(model, source, known)
        if strict and (missing or unexpected):
            raise ModelMismatchError(mismatch_line(path, missing, unexpected) + _tie_hint(model, missing))
        staging = _Staging()
        for slot in slots:
            _fill(slot, [chosen.get(tuple(names), "") for names, *_ in slot.members], source.read_into, staging)
    finally:
        source.close()
    return LoadResult(missing, unexpected)


def _tie_hint(model: nn.Module, missing: Sequence[str]) -> str:
    """A Hugging Face model whose config ties its head to its embeddings, built without the tie (on the meta
    device the constructor does not make it): the head is then missing from its own checkpoint."""
    tied = {k for m in model.modules() for k in (getattr(type(m), "_tied_weights_keys", None) or [])}
    config = next((getattr(m, "config", None) for m in model.modules() if hasattr(m, "config")), None)
    if config is not None and getattr(config, "tie_word_embeddings", False) and any(
            any(n == k or n.endswith("." + k) for k in tied) for n in missing):
        return " (the model's config ties these weights to its embeddings: call model.tie_weights() before wrapping)"
    return ""


class _Staging:
    """One host buffer a load reuses for every device tensor: on XLA:CPU a fresh host tensor per tensor left
    freed chunks resident in the rank thread's malloc arena (0.2 GiB per rank of 0.5 GiB loaded)."""

    def __init__(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._bytes.numel() < nbytes:
            self._bytes = torch.empty(0, dtype=torch.uint8)  # the old one is freed before the new one is made
            self._bytes = torch.empty(nbytes, dtype=torch.uint8)
        return self._bytes[:nbytes].view(dtype).zero_()


def _fill(slot: _Slot, names: Sequence[str], read_into: Callable[[str, int, int, torch.Tensor], None],
          staging: _Staging) -> None:
    """This rank's values of one tensor, one member's range at a time: written in place for a host tensor,
    through the host staging buffer for a device one. A device tensor every member of which is loaded is
    built there from zeros (its padding's value), not read back first, and then takes the transferred
    tensor as its data (``set_``): on XLA ``copy_`` into it kept a second buffer, and reading it back made
    the device tensor, a host copy and its clone (the load on 4 XLA:CPU devices added 3.1x the bound)."""
    todo = [(n, m) for n, m in zip(names, slot.members) if n]
    if not todo:
        return
    target = slot.target.detach()
    on_host = target.device.type == "cpu" and target.is_contiguous()
    whole = len(todo) == len(slot.members)
    if on_host:
        flat = target.view(-1)
    elif whole:
        flat = staging.zeros(target.numel(), target.dtype)
    else:
        flat = target.cpu().reshape(-1).clone()
    for name, (_, _, start, end, position) in todo:
        read_into(name, start, end, flat[position:position + end - start])
    if on_host:
        return
    moved = flat.view(target.shape).to(target.device)
    if whole and slot.target._base is None and target.device.type == "xla":
        slot.target.set_(moved)  # (the caller holds no_grad: the shard's version moves, as with copy_)
    else:
        target.copy_(moved)


def _is_rank_file_prefix(path: str) -> bool:
    import glob
    return bool(glob.glob(glob.escape(path) + "_rank-*-of-*.pth"))


def source_names(path: str) -> Iterable[str]:
    """The tensor names a source holds (for tools)."""
    source = open_source(path)
    try:
        return list(source.shapes)
    finally:
        source.close()


def import_pretrained(path: str, world_size: int, out_prefix: str, overwrite: bool = False) -> List[str]:
    """Write rank files for ``world_size`` ranks at ``out_prefix`` from the pretrained weights at ``path``
    (any source :func:`load_pretrained` reads but rank files), one tensor in memory at a time: one shard per
    floating-point tensor (padded flat), other tensors whole on every rank (``importing``). The ordinary
    loaders read them into any wrapping by name (``load_sharded_checkpoint``, ``resume_training`` with no
    optimizer state). Returns the paths."""
    if world_size < 1:
        raise CheckpointError(f"world size must be >= 1, got {world_size}")
    source = open_source(path)
    try:
        return import_rank_files(source.import_plan(), world_size, out_prefix, inputs_of(path), overwrite)
    finally:
        source.close()
