"""PyTorch Distributed Checkpoint (DCP) directories to and from xla_fsdp rank files, offline: no
process group, no model, one tensor in memory at a time.

``export_dcp`` writes what ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives and
``dcp.save`` stores: ``{model_key: {name: tensor}, optim_key: {"state": {name: {...}},
"param_groups": [{..., "params": [name, ...]}]}}`` keyed by the original parameter names, so
PyTorch FSDP2, DDP or a plain model restores it with ``dcp.load`` at any world size. The DCP writer
asks its planner for each tensor as it writes it; the planner here builds that tensor then, from
memory-mapped slices of the rank files. ``import_dcp`` reads a DCP checkpoint (FSDP2's; torchtitan's,
model keys at the top level and optimizer state flattened; ours) one tensor at a time and writes
rank files for any world size, one parameter per shard; ``load_sharded_checkpoint`` reads those
into any wrapping by name.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._exit_cleanup import UNFINISHED as _UNFINISHED
from ..shard_names import SHARD_PREFIX, SHARD_SEPARATOR
from ..sharding import param_entry, split_entry
from .dcp_reader import SafeFileSystemReader, SafeLoadPlanner
from .reader import MISSING_OPTIMIZER_KEYS, ShardedCheckpoint
from .files import (DEFAULT_SUFFIX, CheckpointError, as_disk_full, causes, new_folders_removed_on_error,
                    prepare_output, rank_path, refuse_overwriting_inputs, stored_bytes, tensor_checksum)
from .metadata import (METADATA_VERSION, _library_versions, full_optimizer_state_dict, is_per_element,
                       learn_per_element, param_order)
from .resized_load import NameIndex, read_full
from .stream_save import PthStreamWriter


@contextlib.contextmanager
def _single_process():
    """dcp.save/load with ``no_dist=True`` warn that no process group is up: here that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


class _StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default planner, except that a tensor given as a meta placeholder is built by its
    loader when the writer asks for its data: the state dict never holds the model."""

    def __init__(self, loaders: Dict[str, Callable[[], torch.Tensor]]):
        super().__init__()
        self._loaders = loaders

    def lookup_object(self, index):
        if index.fqn in self._loaders:
            return self._loaders[index.fqn]()
        return super().lookup_object(index)


def _nest(path: str, value: Any) -> Dict[str, Any]:
    """``"app.model", v`` -> ``{"app": {"model": v}}`` (DCP joins nested keys with dots)."""
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def _merge(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    for k, v in b.items():
        a[k] = _merge(a[k], v) if isinstance(a.get(k), dict) and isinstance(v, dict) else v
    return a


def _fresh_output_dir(out_dir: str, overwrite: bool) -> str:
    """A temporary folder beside ``out_dir`` (created with its parents), after the overwrite rule:
    an empty folder or an earlier DCP checkpoint there is replaced, anything else only with
    ``overwrite``."""
    if os.path.isfile(out_dir) and not overwrite:
        raise CheckpointError(f"the output '{out_dir}' is a file: give a folder for the DCP checkpoint, or pass "
                              "--overwrite (overwrite=True) to replace the file")
    if not os.path.isfile(out_dir):
        prepare_output(out_dir, "dcp", overwrite)
    parent = os.path.dirname(os.path.abspath(out_dir))
    return tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".tmp-", dir=parent)


def _put_in_place(tmp: str, out_dir: str) -> None:
    """Move the finished folder to ``out_dir``; what was there goes only once it is in place."""
    old = None
    if os.path.lexists(out_dir):
        old = f"{out_dir}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old)
        else:
            os.unlink(old)


def export_dcp(ckpt_prefix: str, out_dir: str, model_key: str = "model", optim_key: Optional[str] = "optim",
               ckpt_suffix: str = DEFAULT_SUFFIX, overwrite: bool = False) -> str:
    """Write the checkpoint at ``ckpt_prefix`` as a DCP directory ``out_dir`` (model state, and
    optimizer state when the rank files hold it and ``optim_key`` is given); returns ``out_dir``.
    Written to a temporary folder beside it and renamed when complete; an earlier DCP checkpoint
    at ``out_dir`` is replaced then, a folder holding anything else only with ``overwrite``."""
    src = ShardedCheckpoint(ckpt_prefix, ckpt_suffix)
    refuse_overwriting_inputs([out_dir], [f.path for f in src.files])
    ckpts = src.rank_dicts()
    index = NameIndex(src.layout)

    def model_chunk(key, rank):
        return ckpts[rank]["model"][key].reshape(-1)

    loaders: Dict[str, Callable[[], torch.Tensor]] = {}
    model_sd: Dict[str, Any] = {}
    for name, dtype, shape in src.model_specs():
        if name in index.where:
            model_sd[name] = torch.empty(shape, dtype=dtype, device="meta")
            loaders[f"{model_key}.{name}"] = (lambda name=name, dtype=dtype, shape=shape:
                                              read_full(index, src.layout, model_chunk, name, shape, dtype))
    # the unwrapped model's named_parameters() order, which DCP's metadata keeps: an import reads the
    # model's parameter order from it (layout order is the wrapped model's: root units' entries first)
    order, _ = param_order(src.metadata, list(model_sd))
    model_sd = {name: model_sd[name] for name in order}
    buffers = dict(src.iter_buffers())
    model_sd.update(buffers)
    state_dict = _nest(model_key, model_sd)
    if optim_key and all(c.get("optimizer") is not None for c in ckpts):
        optim_sd = _optimizer_placeholders(src, ckpts, index, optim_key, loaders)
        state_dict = _merge(state_dict, _nest(optim_key, optim_sd))
    with new_folders_removed_on_error([out_dir]):
        _write_dcp(src, state_dict, loaders, out_dir, overwrite)
    return out_dir


def _write_dcp(src: ShardedCheckpoint, state_dict: Dict[str, Any], loaders: Dict[str, Callable[[], torch.Tensor]],
               out_dir: str, overwrite: bool) -> None:
    tmp = _fresh_output_dir(out_dir, overwrite)
    try:
        writer = dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
        with _single_process():
            dcp.save(state_dict, storage_writer=writer, planner=_StreamingSavePlanner(loaders), no_dist=True)
        _put_in_place(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # DCP wraps its writer's OSError, or reports torch's zip writer's "unexpected pos"
        full = as_disk_full(e, out_dir, stored_bytes(state_dict))
        if full is not None:
            raise full from None
        if isinstance(e, (Exception, CheckpointException)):
            raise _dcp_failure(e, f"writing the DCP checkpoint '{out_dir}' failed") from None
        raise
    finally:
        src.release()


def _optimizer_placeholders(src: ShardedCheckpoint, ckpts, index: NameIndex, optim_key: str,
                            loaders: Dict[str, Callable[[], torch.Tensor]]) -> Dict[str, Any]:
    """get_optimizer_state_dict's layout: state and param_groups keyed by original names."""
    keys = src.optimizer_param_keys
    if keys is None:
        raise CheckpointError(MISSING_OPTIMIZER_KEYS)
    position = {key: i for i, key in enumerate(keys)}
    state: Dict[str, Dict[str, Any]] = {}
    for key in keys:
        fields = ckpts[0]["optimizer"]["state"].get(position[key])
        if not fields:
            continue
        entry = src.layout[key]
        for name, shape in zip(entry["names"], entry["shapes"]):
            shape = tuple(shape)
            st: Dict[str, Any] = {}
            for field, value in fields.items():
                if is_per_element(field, value, entry["shard_shape"]):
                    st[field] = torch.empty(shape, dtype=value.dtype, device="meta")

                    def chunk(k, rank, field=field):
                        return ckpts[rank]["optimizer"]["state"][position[k]][field].reshape(-1)
                    loaders[f"{optim_key}.state.{name}.{field}"] = (
                        lambda name=name, shape=shape, dtype=value.dtype, chunk=chunk:
                        read_full(index, src.layout, chunk, name, shape, dtype))
                else:
                    st[field] = value.clone() if isinstance(value, torch.Tensor) else value
            state[name] = st
    # as get_optimizer_state_dict gives it for a plain model's optimizer built from model.parameters():
    # parameters in named_parameters() order, no param_names
    order, _ = param_order(src.metadata, [n for key in keys for n in src.layout[key]["names"]])
    return full_optimizer_state_dict(state, ckpts[0]["optimizer"]["param_groups"],
                                     lambda i: src.layout[keys[i]]["names"], order, param_names=False)


# ---------------------------------------------------------------------------------------------- import
def _read_dcp(reader: SafeFileSystemReader, fqn: str, meta) -> Any:
    """One entry of a DCP checkpoint (a tensor, or a pickled object), read alone."""
    if isinstance(meta, TensorStorageMetadata):
        target = {fqn: torch.empty(meta.size, dtype=meta.properties.dtype)}
    else:
        target = {fqn: None}
    try:
        with _single_process():
            dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(allow_partial_load=True), no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        raise _dcp_failure(e, f"reading '{fqn}' from the DCP checkpoint '{reader.path}' failed") from None
    return target[fqn]


def _dcp_failure(error: BaseException, what: str) -> CheckpointError:
    """One line for a failure inside DCP: ours as it is, else the first exception DCP collected."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CheckpointError):
            return e
        if not isinstance(e, CheckpointException):
            first = (str(e).strip().splitlines() or [""])[0]
            return CheckpointError(f"{what}: {type(e).__name__}: {first} (the folder is damaged or incomplete: "
                                   "copy it again from its source)")
        todo += causes(e)
    return CheckpointError(f"{what}: {error}")


# Top-level entries that torchtitan saves beside the model's (its model keys sit at the top level).
NON_MODEL_ROOTS = ("optim", "optimizer", "lr_scheduler", "lr_schedulers", "dataloader", "train_state")


def _find_prefix(names: List[str], wanted: Optional[str], candidates: Tuple[str, ...]) -> str:
    if wanted == "":  # the model's entries at the top level (torchtitan)
        return wanted
    if wanted is not None:
        if not any(n.startswith(wanted + ".") for n in names):
            raise CheckpointError(f"the DCP checkpoint has no entries under '{wanted}.' (it has e.g. "
                                  f"{sorted(names)[:4]}); name the right one with --model_key/--optim_key")
        return wanted
    for c in candidates:
        if any(n.startswith(c + ".") for n in names):
            return c
    raise CheckpointError(f"cannot tell where the model state is in the DCP checkpoint (entries e.g. "
                          f"{sorted(names)[:4]}); name it with --model_key")


def _model_prefix(entries: Dict[str, Any], wanted: Optional[str]) -> str:
    """``model`` or ``app.model`` (the tutorials' AppState); else, when tensors sit at the top level
    beside torchtitan's ``optimizer``/``lr_scheduler``/... entries, the top level (``""``)."""
    names = list(entries)
    if wanted is None and not any(n.startswith(c + ".") for n in names for c in ("model", "app.model")):
        if any(isinstance(m, TensorStorageMetadata) and n.partition(".")[0] not in NON_MODEL_ROOTS
               for n, m in entries.items()):
            return ""
    return _find_prefix(names, wanted, ("model", "app.model"))


def _model_entries(entries: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    if prefix:
        return {n[len(prefix) + 1:]: m for n, m in entries.items() if n.startswith(prefix + ".")}
    return {n: m for n, m in entries.items()
            if isinstance(m, TensorStorageMetadata) and n.partition(".")[0] not in NON_MODEL_ROOTS}


def import_dcp(dcp_dir: str, world_size: int, out_prefix: str, model_key: Optional[str] = None,
               optim_key: Optional[str] = None, overwrite: bool = False) -> List[str]:
    """Write rank files for ``world_size`` ranks at ``out_prefix`` from the DCP checkpoint in
    ``dcp_dir``: one shard per parameter (padded flat), buffers whole on every rank, and the
    optimizer state found under ``optim_key`` (default: ``optim`` or ``optimizer``, beside the
    model's ``model`` or ``app.model``). Returns the paths."""
    if world_size < 1:
        raise CheckpointError(f"world size must be >= 1, got {world_size}")
    if not os.path.isfile(os.path.join(dcp_dir, ".metadata")):
        raise CheckpointError(f"'{dcp_dir}' is not a DCP checkpoint folder (no .metadata file)")
    reader = SafeFileSystemReader(dcp_dir)
    entries = reader.read_metadata().state_dict_metadata
    names = list(entries)
    model_prefix = _model_prefix(entries, model_key)
    parent = model_prefix.rpartition(".")[0]
    optim_candidates = tuple(f"{parent}.{c}" if parent else c for c in ("optim", "optimizer"))
    try:
        optim_prefix = _find_prefix(names, optim_key, optim_candidates)
    except CheckpointError:
        if optim_key is not None:
            raise
        optim_prefix = None
    out_paths = [rank_path(out_prefix, r, world_size) for r in range(world_size)]
    refuse_overwriting_inputs(out_paths, [os.path.join(dcp_dir, f) for f in os.listdir(dcp_dir)])
    with new_folders_removed_on_error(out_paths):
        _write_rank_files(reader, entries, dcp_dir, out_paths, model_prefix, optim_prefix, overwrite)
    return out_paths


def _write_rank_files(reader: SafeFileSystemReader, entries: Dict[str, Any], dcp_dir: str, out_paths: List[str],
                      model_prefix: str, optim_prefix: Optional[str], overwrite: bool) -> None:
    world_size = len(out_paths)
    for path in out_paths:  # folders created; an earlier output replaced, anything else only with overwrite
        prepare_output(path, "torch", overwrite)
    model_entries = _model_entries(entries, model_prefix)
    groups = _read_param_groups(reader, entries, optim_prefix) if optim_prefix else None
    trained = [p for g in groups for p in g["params"]] if groups else None
    params = [n for n, m in model_entries.items() if isinstance(m, TensorStorageMetadata)
              and (n in trained if trained is not None else m.properties.dtype.is_floating_point)]
    keys = {n: SHARD_PREFIX + n.replace(".", SHARD_SEPARATOR) for n in params}
    with _RankFileWriters(out_paths) as out:
        layout: Dict[str, Any] = {}
        for name in params:  # one full tensor in memory at a time
            full = _read_dcp(reader, _join(model_prefix, name), model_entries[name])
            entry, shards = _split(full, world_size)
            layout[keys[name]] = dict(entry, names=[name])
            out.add_model(keys[name], shards)
        for name, meta in model_entries.items():
            if name not in keys:  # buffers: whole on every rank
                value = _read_dcp(reader, _join(model_prefix, name), meta)
                out.add_model(name, [value] * world_size)
        optimizer_keys = None
        if groups is not None:
            optimizer_keys = [keys[p] for g in groups for p in g["params"]]
            _import_optimizer(reader, entries, optim_prefix, groups, keys, layout, out)
        run_id = uuid.uuid4().hex[:16]
        out.finish(lambda r: {"version": METADATA_VERSION, "world_size": world_size, "rank": r, "layout": layout,
                              "run_id": run_id, "shard_size_multiple": 1, "flatten_parameters": False,
                              "shard_param_on_dim_0": False, "buffer_info": {}, "param_keys": list(keys.values()),
                              # the saver's state_dict() order, which DCP's metadata keeps
                              "model_param_order": list(params),
                              "optimizer_param_keys": optimizer_keys,
                              "imported_from": f"dcp:{os.path.abspath(dcp_dir)}",
                              # DCP keeps no checksums: ours are of the values as read, damaged or not
                              "unverified_source": f"DCP checkpoint {os.path.abspath(dcp_dir)}",
                              "library_versions": _library_versions()})


class _RankFileWriters:
    """All ranks' files written side by side, one tensor at a time (``stream_save``), each under a
    temporary name until every file is complete, then fsynced and renamed."""

    def __init__(self, paths: List[str]):
        self.paths = paths
        self.tmps = [f"{p}.{uuid.uuid4().hex[:8]}.tmp" for p in paths]
        self.writers: List[PthStreamWriter] = []
        self.model: List[Dict[str, Any]] = [{} for _ in paths]
        self.optimizer: List[Optional[Dict[str, Any]]] = [None for _ in paths]
        self.sums: List[Dict[str, Dict[str, int]]] = [{"model": {}, "optimizer": {}} for _ in paths]

    def __enter__(self):
        for path, tmp in zip(self.paths, self.tmps):
            if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise CheckpointError(f"cannot write '{path}': its folder does not exist")
            _UNFINISHED.add(tmp)
            self.writers.append(PthStreamWriter(tmp))
        return self

    def add_model(self, key: str, per_rank: List[torch.Tensor]) -> None:
        for r, (writer, tensor) in enumerate(zip(self.writers, per_rank)):
            self.model[r][key] = writer.add(None, tensor)
            self.sums[r]["model"][key] = tensor_checksum(tensor)

    def add_optimizer(self, index: int, field: str, per_rank: List[Any]) -> None:
        for r, (writer, value) in enumerate(zip(self.writers, per_rank)):
            if self.optimizer[r] is None:
                self.optimizer[r] = {"state": {}, "param_groups": []}
            if isinstance(value, torch.Tensor):
                self.sums[r]["optimizer"][f"{index}.{field}"] = tensor_checksum(value)
                value = writer.add(None, value)
            self.optimizer[r]["state"].setdefault(index, {})[field] = value

    def set_param_groups(self, groups: List[Dict[str, Any]]) -> None:
        for r in range(len(self.paths)):
            if self.optimizer[r] is None:
                self.optimizer[r] = {"state": {}, "param_groups": []}
            self.optimizer[r]["param_groups"] = groups

    def finish(self, metadata_of_rank: Callable[[int], Dict[str, Any]]) -> None:
        for r, writer in enumerate(self.writers):
            metadata = dict(metadata_of_rank(r), checksums=self.sums[r])
            obj = {"model": self.model[r], "shard_metadata": metadata, "optimizer": self.optimizer[r]}
            writer.set_structure(lambda refs, obj=obj: obj)
            try:
                writer.close()
            except OSError as e:
                full = as_disk_full(e, self.paths[r], writer.nbytes)
                if full is not None:
                    raise full from e
                raise
        for tmp in self.tmps:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        for tmp, path in zip(self.tmps, self.paths):
            os.replace(tmp, path)
            _UNFINISHED.discard(tmp)
        self.writers = []

    def __exit__(self, exc_type, *rest):
        for tmp in self.tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)
            _UNFINISHED.discard(tmp)
        return False


def _split(full: torch.Tensor, world_size: int) -> Tuple[Dict[str, Any], List[torch.Tensor]]:
    return split_entry(param_entry(full.shape), [full], world_size, 1)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _read_param_groups(reader, entries, optim_prefix: str) -> List[Dict[str, Any]]:
    """The param groups with parameter names, as ``get_optimizer_state_dict`` writes them: a list
    (``param_groups.0.lr``, ``param_groups.0.params``) or, with ``flatten_optimizer_state_dict``
    (torchtitan), per parameter (``param_groups.<name>.lr``); parameters whose hyperparameters are
    equal then share a group, in the order the checkpoint lists them."""
    prefix = f"{optim_prefix}.param_groups."
    listed: Dict[int, Dict[str, Any]] = {}
    per_param: Dict[str, Dict[str, Any]] = {}
    for fqn, meta in entries.items():
        if fqn.startswith(prefix):
            rest = fqn[len(prefix):]
            number, _, field = rest.partition(".")
            if number.isdigit():
                listed.setdefault(int(number), {})[field] = _read_dcp(reader, fqn, meta)
            else:
                name, _, field = rest.rpartition(".")  # hyperparameter names hold no dots
                per_param.setdefault(name, {})[field] = _read_dcp(reader, fqn, meta)
    if per_param and not listed:
        groups: List[Dict[str, Any]] = []
        for name, hyper in per_param.items():
            same = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == hyper), None)
            if same is None:
                groups.append(dict(hyper, params=[name]))
            else:
                same["params"].append(name)
        return groups
    if not listed or any("params" not in g for g in listed.values()):
        raise CheckpointError(f"the DCP checkpoint's optimizer state under '{optim_prefix}' has no param_groups "
                              "with parameter names (write it with get_state_dict / get_optimizer_state_dict)")
    return [listed[i] for i in sorted(listed)]


def _field_shapes(entries, optim_prefix: str, names) -> Dict[str, Dict[str, Any]]:
    """``learn_per_element``'s field shapes of the optimizer state, from the DCP's metadata alone."""
    shapes: Dict[str, Dict[str, Any]] = {}
    for name in names:
        prefix = f"{optim_prefix}.state.{name}."
        shapes[name] = {fqn[len(prefix):]: list(meta.size) if isinstance(meta, TensorStorageMetadata) else None
                        for fqn, meta in entries.items() if fqn.startswith(prefix)}
    return shapes


def _import_optimizer(reader, entries, optim_prefix: str, groups, keys: Dict[str, str], layout: Dict[str, Any],
                      out: "_RankFileWriters") -> None:
    """Optimizer state into the rank files: fields shaped like the parameter split as it is,
    others (``step``) copied; indices in the param groups' order, as ``torch.optim`` numbers them."""
    world_size = len(out.paths)
    order = [p for g in groups for p in g["params"]]
    shape_of = {name: layout[keys[name]]["shapes"][0] for name in order}
    learnt = learn_per_element(_field_shapes(entries, optim_prefix, order), shape_of)  # nothing read for it
    for i, name in enumerate(order):
        prefix = f"{optim_prefix}.state.{name}."
        for fqn, meta in entries.items():
            if not fqn.startswith(prefix):
                continue
            value = _read_dcp(reader, fqn, meta)
            if is_per_element(fqn[len(prefix):], value, shape_of[name], learnt):
                out.add_optimizer(i, fqn[len(prefix):], _split(value, world_size)[1])
            else:
                out.add_optimizer(i, fqn[len(prefix):], [value] * world_size)
    param_groups, start = [], 0
    for g in groups:
        param_groups.append({**{k: v for k, v in g.items() if k != "params"},
                             "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    out.set_param_groups(param_groups)
