"""Shard metadata: everything needed to rebuild full tensors from per-rank state dicts.

Keeps torch_xla's five keys (so its consumers keep working) and adds a versioned, self-describing
``layout`` section: every shard's original names, shapes, padding, mode and tied aliases.
"""
from __future__ import annotations

import copy
import functools
import importlib.metadata
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, TypedDict

import torch

METADATA_VERSION = 1


@functools.lru_cache(maxsize=1)
def _library_versions() -> Dict[str, str]:
    versions = {"torch": str(torch.__version__)}  # a plain str: TorchVersion fails torch.load(weights_only=True)
    try:  # from the installed metadata: importing torch_xla just for its version costs seconds
        versions["torch_xla"] = importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError:
        pass
    from .._version import __version__
    versions["xla_fsdp"] = __version__
    return versions


class RankFileMetadata(TypedDict, total=False):
    """A rank file's ``shard_metadata``, as every writer fills it (``rank_writer`` adds ``checksums``)."""
    # torch_xla's five keys: its consumers keep working
    shard_info: Dict[str, Dict[str, Any]]  # unit path -> shard name -> {_orig_size, _orig_name}
    flatten_info: Dict[str, Any]  # flat shard -> (original names, shapes, numels)
    buffer_info: Dict[str, Any]
    world_size: int
    rank: int
    # ours
    version: int  # METADATA_VERSION
    layout: Dict[str, Any]  # shard key -> mode, names, shapes, aliases, padded_numel, shard_shape, requires_grad
    flatten_parameters: bool
    shard_param_on_dim_0: bool
    shard_size_multiple: int
    sharding_groups: Any
    sharding_strategy: str
    replica_groups: Any
    replica_rank: int
    transport: str
    library_versions: Dict[str, str]
    param_keys: List[str]  # shard keys in parameters() order
    model_param_order: List[str]  # original names in the unwrapped model's named_parameters() order
    run_id: str  # one id for the files of one save
    optimizer_param_keys: Optional[List[str]]  # the shard of each optimizer state index
    resharded_from: int  # a resize's input world size
    imported_from: str  # an import's source ("dcp:<dir>", "pretrained:<path>")
    unverified_source: str  # an import's source, whose values the checksums were taken of as read
    checksums: Dict[str, Dict[str, int]]


def imported_metadata(*, world_size: int, rank: int, layout: Dict[str, Any], run_id: str, param_keys: List[str],
                      model_param_order: List[str], optimizer_param_keys: Optional[List[str]], imported_from: str,
                      unverified_source: str) -> RankFileMetadata:
    """The metadata of an imported rank file (one padded flat shard per parameter, no sharding groups)."""
    return RankFileMetadata(
        version=METADATA_VERSION, world_size=world_size, rank=rank, layout=layout, run_id=run_id,
        shard_size_multiple=1, flatten_parameters=False, shard_param_on_dim_0=False, buffer_info={},
        param_keys=param_keys, model_param_order=model_param_order, optimizer_param_keys=optimizer_param_keys,
        imported_from=imported_from, unverified_source=unverified_source, library_versions=_library_versions())


def resized_metadata(source: Mapping[str, Any], *, world_size: int, rank: int, layout: Dict[str, Any], run_id: str,
                     shard_size_multiple: int, optimizer_param_keys: Optional[List[str]], resharded_from: int
                     ) -> RankFileMetadata:
    """The metadata of a rank file resized from one with ``source``'s metadata (its other keys kept)."""
    metadata = copy.deepcopy(dict(source))
    metadata.pop("checksums", None)
    metadata.update(world_size=world_size, rank=rank, layout=layout, run_id=run_id, version=1,
                    shard_size_multiple=shard_size_multiple, resharded_from=resharded_from,
                    optimizer_param_keys=optimizer_param_keys)
    return metadata


def shard_metadata(root) -> RankFileMetadata:
    from ..shard_names import WRAPPED, clean_name as _clean_name
    from ..unit.param_names import names_in_model_order, unit_paths

    shard_info: Dict[str, Dict[str, Any]] = {}
    flatten_info: Dict[str, Any] = {}
    buffer_info: Dict[str, Any] = {}
    layout: Dict[str, Any] = {}
    keys = {id(p): name for name, p in root.named_parameters()}  # each shard's key in root.state_dict()
    for module_path, unit in unit_paths(root):
        # a wrapper's path (its shards are its own attributes), or in place the module's
        unit_path = module_path[:-len(WRAPPED)].rstrip(".") if module_path.split(".")[-1] == WRAPPED else module_path
        key_prefix = unit_path + "." if unit_path else ""
        name_prefix = _clean_name(unit_path)
        name_prefix = name_prefix + "." if name_prefix else ""
        shard_info[unit_path] = {}
        for _, group in unit.named_gather_groups():
            shard_name = keys[id(group.param)][len(key_prefix):]
            if group.flat:
                orig_name = f"{WRAPPED}.{group.flat_name}"
                orig_size = torch.Size([group.layout.numel])
                flatten_info[key_prefix + orig_name] = (
                    [f"{WRAPPED}.{n}" for n in group.names], [torch.Size(s) for s in group.layout.shapes],
                    list(group.layout.numels))
            else:
                orig_name = f"{WRAPPED}.{group.refs[0].fqn}"
                orig_size = torch.Size(group.full_shape)
            shard_info[unit_path][shard_name] = {"_orig_size": orig_size, "_orig_name": orig_name}
            layout[key_prefix + shard_name] = {
                "mode": "dim0" if group.dim0 else ("flat" if group.flat else "param"),
                "names": [name_prefix + n for n in group.names],
                "shapes": [list(s) for s in (group.layout.shapes if group.flat or not group.dim0
                                             else [group.layout.shape])],
                "aliases": {name_prefix + r.fqn: [name_prefix + a for a in r.aliases]
                            for r in group.refs if r.aliases},
                "padded_numel": group.layout.padded_numel,
                "shard_shape": list(group.shard.shape),
                "requires_grad": group.requires_grad,
            }
        for buffer_key, info in unit.buffer_info.items():
            buffer_info[f"{module_path}.{buffer_key}" if module_path else buffer_key] = dict(info)
    return {
        "shard_info": shard_info,
        "flatten_info": flatten_info,
        "buffer_info": buffer_info,
        "world_size": root.world_size,
        "rank": root.rank,
        "version": METADATA_VERSION,
        "layout": layout,
        "flatten_parameters": bool(root.flatten_parameters),
        "shard_param_on_dim_0": root.shard_param_on_dim_0,
        "shard_size_multiple": root.shard_size_multiple,
        "sharding_groups": root.comms.groups,
        "sharding_strategy": root.sharding_strategy.name,
        "replica_groups": root.comms.replica_groups,
        "replica_rank": root.comms.replica_rank,
        "transport": root.comms.name,
        "library_versions": dict(_library_versions()),
        # shard state-dict keys in parameters() order: maps optimizer state indices to shards
        "param_keys": [name for name, _ in root.named_parameters()],
        # original names in the unwrapped model's named_parameters() order: full optimizer state
        # dicts list their parameters so, for the unwrapped model's optimizer (load_state_dict maps by position)
        "model_param_order": names_in_model_order(root),
    }


def param_order(metadata: Mapping[str, Any], names: Iterable[str]) -> Tuple[List[str], bool]:
    """(``names``, original parameter names, in the unwrapped model's ``named_parameters()`` order;
    whether the metadata recorded that order). Files without ``model_param_order`` (torch_xla's,
    xla_fsdp's from before it was recorded, imported ones) get :func:`inferred_param_order`."""
    recorded = metadata.get("model_param_order")
    if recorded is None:
        return inferred_param_order(names), False
    position = {n: i for i, n in enumerate(recorded)}
    return sorted(names, key=lambda n: position.get(n, len(position))), True


def inferred_param_order(names: Iterable[str]) -> List[str]:
    """``names`` in module order as far as names tell it: a module's own parameters before its
    submodules', numbered submodules (``nn.Sequential``, ``nn.ModuleList``) by number, others in
    the order first seen. The unwrapped model may register its submodules in another order."""
    names = list(names)
    first_seen: Dict[str, int] = {}
    for i, name in enumerate(names):
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            first_seen.setdefault(".".join(parts[:depth]), i)

    def key(name: str):
        parts = name.split(".")
        path = [(1, (0, int(p), 0) if p.isdigit() else (1, 0, first_seen[".".join(parts[:d + 1])]))
                for d, p in enumerate(parts[:-1])]
        return path + [(0, (0, 0, first_seen[name]))]
    return sorted(names, key=key)


def full_optimizer_state_dict(state: Mapping[str, Any], saved_groups: List[Mapping[str, Any]],
                              names_of: Callable[[int], List[str]], order: List[str],
                              param_names: bool = True) -> Dict[str, Any]:
    """A ``torch.optim`` state dict for the unwrapped model, keyed by original names: ``state``
    (name -> fields) and each of ``saved_groups`` (the wrapped optimizer's groups, ``params`` the
    indices whose names ``names_of`` gives) with its parameters in ``order``, the unwrapped model's
    ``named_parameters()`` order. ``optimizer.load_state_dict`` maps saved parameters to its own by
    position, so an optimizer of the unwrapped model built from ``model.parameters()`` (or from
    groups, each in model order) gets every parameter's own state. Each group carries
    ``param_names``, as torch writes it for optimizers built from ``named_parameters()``."""
    position = {n: i for i, n in enumerate(order)}

    def rank(name: str) -> int:
        return position.get(name, len(position))
    groups = []
    for group in saved_groups:
        names = sorted((n for i in group["params"] for n in names_of(i)), key=rank)
        new = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        if param_names:
            new["param_names"] = names
        new["params"] = list(names)
        groups.append(new)
    return {"state": OrderedDict((n, state[n]) for n in sorted(state, key=rank)), "param_groups": groups}


def is_per_element(field: str, value: Any, shape: Iterable[int], learnt: Mapping[str, bool] = {}) -> bool:
    """Whether the optimizer state ``field`` holds one value per element of a tensor of ``shape`` (a
    shard's ``shard_shape``, or an original parameter's): Adam's moments and SGD's momentum do,
    ``step`` and other scalars do not. A tensor field shaped like it is per element; a 0-d shape cannot
    tell by itself (every field of a 0-d parameter is 0-d), so there the fields of the parameters that
    are not 0-d decide (``learnt``, :func:`learn_per_element`), and a field none of them holds counts
    as per element unless it is ``step``. A shard is never 0-d (a 0-d parameter's is one padded row)."""
    if not isinstance(value, torch.Tensor) or list(value.shape) != list(shape):
        return False
    if value.dim() > 0:
        return True
    return learnt.get(field, field != "step")


def learn_per_element(field_shapes: Mapping[str, Mapping[str, Any]], shapes: Mapping[str, Any]) -> Dict[str, bool]:
    """Per field name, whether it is per element, from the parameters that are not 0-d (``field_shapes``:
    name -> field -> the tensor's shape, None for a value that is no tensor; ``shapes``: name -> the
    parameter's shape): shaped like its parameter there, it is; 0-d there, it is not."""
    verdict: Dict[str, bool] = {}
    for name, fields in field_shapes.items():
        shape = shapes.get(name)
        if not shape:
            continue
        for field, field_shape in fields.items():
            if field_shape is None:
                continue
            if list(field_shape) == list(shape):
                verdict[field] = True
            elif len(field_shape) == 0:
                verdict.setdefault(field, False)
    return verdict


def tensor_shapes(state: Mapping[str, Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """``learn_per_element``'s ``field_shapes`` of a state keyed by name (name -> field -> value)."""
    return {n: {f: list(v.shape) if isinstance(v, torch.Tensor) else None for f, v in fields.items()}
            for n, fields in state.items()}
