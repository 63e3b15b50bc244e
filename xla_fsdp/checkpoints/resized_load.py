"""Load a sharded checkpoint of any world size (or any wrapping of the same model) into a live
model, each rank reading only the slices of the rank files that its own shards cover.

Every layout entry, in the checkpoint and in the model, is one flat buffer (its tensors packed in
order, zero padding at the end; a dim-0 entry is its tensor flattened row by row) cut into
``world_size`` equal contiguous chunks. So a rank's shard is one element range of that buffer, its
tensors are element ranges of original tensors, and those are element ranges of the checkpoint's
chunks, found by original name. The rank files are memory-mapped: reading a slice touches only its
pages, so a rank's memory holds its own shards, never the full model.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from ..shard_names import clean_name, readable_key
from .reader import MISSING_OPTIMIZER_KEYS, REOPEN_BYTES, ShardedCheckpoint
from .files import CheckpointError, ModelMismatchError, verify_archive
from .metadata import is_per_element

Member = Tuple[str, int, int]  # (original name, offset in the entry's flat buffer, numel)


def entry_members(entry: Mapping[str, Any]) -> List[Member]:
    """The original tensors of one layout entry and where each starts in its flat buffer."""
    members, offset = [], 0
    for name, shape in zip(entry["names"], entry["shapes"]):
        numel = math.prod(shape) if shape else 1
        members.append((name, offset, numel))
        offset += numel
    return members


def chunk_numel(entry: Mapping[str, Any]) -> int:
    return math.prod(entry["shard_shape"])


class NameIndex:
    """Original name (tied aliases included) -> (layout key, offset in its flat buffer, numel)."""

    def __init__(self, layout: Mapping[str, Mapping[str, Any]]):
        self.where: Dict[str, Tuple[str, int, int]] = {}
        for key, entry in layout.items():
            for name, offset, numel in entry_members(entry):
                for alias in [name] + list(entry.get("aliases", {}).get(name, [])):
                    self.where[alias] = (key, offset, numel)

    def locate_loaded(self, entry: Mapping[str, Any], name: str, numel: int) -> Tuple[str, int]:
        """Where the value a model's parameter ``name`` (an entry member, tied to the entry's aliases of
        it) gets comes from: as ``load_state_dict`` loads a plain model, the last of its names in module
        order that the checkpoint holds wins (a checkpoint saved with the tie undone holds each)."""
        names = [name] + list(entry.get("aliases", {}).get(name, []))
        held = [n for n in names if n in self.where]
        return self.locate(held[-1] if held else name, numel)

    def locate(self, name: str, numel: int) -> Tuple[str, int]:
        if name not in self.where:
            raise ModelMismatchError(f"the checkpoint has no parameter '{name}' (it holds e.g. "
                                  f"{sorted(self.where)[:3]}): it was saved from another model")
        key, offset, saved_numel = self.where[name]
        if saved_numel != numel:
            raise ModelMismatchError(f"parameter '{name}' has {saved_numel} elements in the checkpoint and {numel} "
                                  "in the model: it was saved from another model")
        return key, offset


def _pieces(start: int, end: int, chunk: int) -> Iterator[Tuple[int, int, int]]:
    """(chunk index, start, end within the chunk) covering flat positions [start, end)."""
    while start < end:
        index, within = divmod(start, chunk)
        take = min(end - start, chunk - within)
        yield index, within, within + take
        start += take


def assemble_shard(entry: Mapping[str, Any], rank: int, index: NameIndex, source_layout: Mapping[str, Any],
                   read_chunk, dtype: torch.dtype, out: Optional[torch.Tensor] = None,
                   skip: Sequence[str] = ()) -> torch.Tensor:
    """This rank's flat shard of a model entry, filled from the checkpoint's chunks (into ``out``,
    a flat tensor of the shard's size, when given: the members named in ``skip`` keep its values).
    ``read_chunk(key, source_rank)`` returns that rank's flat (1-D) tensor for ``key``."""
    size = chunk_numel(entry)
    members = entry_members(entry)
    if out is None:
        out = torch.zeros(size, dtype=dtype)
    else:  # the padding
        out[min(size, max(0, sum(numel for _, _, numel in members) - rank * size)):].zero_()
    lo, hi = rank * size, (rank + 1) * size
    for name, offset, numel in members:
        start, end = max(lo, offset), min(hi, offset + numel)
        if start >= end or name in skip:
            continue
        key, source_offset = index.locate_loaded(entry, name, numel)
        source_chunk = chunk_numel(source_layout[key])
        position = start - lo
        for source_rank, a, b in _pieces(source_offset + start - offset, source_offset + end - offset, source_chunk):
            out[position:position + b - a] = read_chunk(key, source_rank)[a:b]
            position += b - a
    return out.reshape(entry["shard_shape"])


def read_full(index: NameIndex, source_layout: Mapping[str, Any], read_chunk, name: str, shape, dtype: torch.dtype
              ) -> torch.Tensor:
    """One original tensor, whole, from the checkpoint's chunks (only its own slices are read)."""
    numel = math.prod(shape) if len(shape) else 1
    key, offset = index.locate(name, numel)
    out = torch.empty(numel, dtype=dtype)
    position = 0
    for source_rank, a, b in _pieces(offset, offset + numel, chunk_numel(source_layout[key])):
        out[position:position + b - a] = read_chunk(key, source_rank)[a:b]
        position += b - a
    return out.reshape(shape)


class ResizedLoad:
    """A checkpoint of another world size or wrapping, read for one rank of a live model."""

    def __init__(self, ckpt_prefix: str):
        self.source = ShardedCheckpoint(ckpt_prefix, verify=False)  # rank files checked in verify_share
        self.index = NameIndex(self.source.layout)
        self._ckpts = self.source.rank_dicts()
        self._read = 0

    def verify_share(self, flat_rank: int, ranks: int) -> None:
        """Check the zip CRC-32 of every ``ranks``-th rank file, from this rank's position: the
        ranks together check every file once (and agree on the outcome afterwards)."""
        for i, f in enumerate(self.source.files):
            if i % ranks == flat_rank:
                verify_archive(f.path)

    def _account(self, nbytes: int) -> None:
        """Unmap the rank files every REOPEN_BYTES read: the pages read so far leave this
        process's resident memory (they stay in the page cache)."""
        self._read += nbytes
        if self._read > REOPEN_BYTES:
            self.source.release()
            self._ckpts, self._read = self.source.rank_dicts(), 0

    def _model_chunk(self, key: str, source_rank: int) -> torch.Tensor:
        return self._ckpts[source_rank]["model"][key].reshape(-1)

    def _filler(self, entry, rank: int, read_chunk, skip: Sequence[str] = ()):
        def fill(out: torch.Tensor) -> None:
            assemble_shard(entry, rank, self.index, self.source.layout, read_chunk, out.dtype, out=out, skip=skip)
            self._account(out.numel() * out.element_size())
        return fill

    def plan(self, model, optimizer, rank: int, model_keys: Optional[List[str]], strict: bool = True
             ) -> Dict[str, Any]:
        """Check that the checkpoint fits the model (names, sizes, buffers, optimizer groups) and
        return what ``apply`` will fill, reading no tensor data yet but the (small) buffers. As
        ``load_state_dict``: with ``strict``, names only one side has are refused; without, the
        model's names the checkpoint lacks keep their values, and both lists are in the plan."""
        layout = model.get_shard_metadata()["layout"]
        buffers = {clean_name(k): k for k in self.source.buffer_keys}
        shards, buffer_values, missing, used = {}, {}, [], set()
        absent_in: Dict[str, List[str]] = {}
        for key in model.state_dict():
            if key in layout:
                entry = layout[key]
                absent = []
                for name, _, numel in entry_members(entry):
                    names = [name] + list(entry.get("aliases", {}).get(name, []))
                    used.update(names)
                    if any(n in self.index.where for n in names):
                        self.index.locate_loaded(entry, name, numel)  # raises: another size
                    else:
                        absent.append(name)
                missing += absent
                absent_in[key] = absent
                if len(absent) < len(entry["names"]):
                    shards[key] = (self._filler(entry, rank, self._model_chunk, absent), bool(absent))
            elif clean_name(key) in buffers:
                used.add(clean_name(key))
                buffer_values[key] = self._ckpts[0]["model"][buffers[clean_name(key)]].clone()
            elif "_fsdp_shard" not in key:
                missing.append(readable_key(key))
        unexpected = [n for n in list(self.index.where) + list(buffers) if n not in used]
        if strict and (missing or unexpected):
            raise ModelMismatchError(mismatch_line(self.source.prefix, missing, unexpected))
        plan = {"shards": shards, "buffers": buffer_values, "missing": missing, "unexpected": unexpected}
        if optimizer is not None:
            plan["optimizer"] = self._plan_optimizer(optimizer, layout, rank, model_keys, absent_in)
        return plan

    def _plan_optimizer(self, optimizer, layout, rank: int, model_keys: List[str],
                        absent_in: Mapping[str, List[str]]) -> Dict[str, Any]:
        source_keys = self.source.optimizer_param_keys
        if source_keys is None:
            raise CheckpointError(MISSING_OPTIMIZER_KEYS)
        if any(c.get("optimizer") is None for c in self._ckpts):
            raise CheckpointError(f"the checkpoint '{self.source.prefix}' holds no optimizer state")
        source_index = {key: i for i, key in enumerate(source_keys)}
        saved0 = self._ckpts[0]["optimizer"]
        state: Dict[int, Dict[str, Any]] = {}
        for i, key in enumerate(model_keys):
            entry = layout[key]
            absent = absent_in.get(key, [])
            if absent and len(absent) < len(entry["names"]):
                raise ModelMismatchError(
                    f"strict=False: the checkpoint holds only some parameters of '{readable_key(key)}' "
                    f"(not {absent[:3]}), "
                    "so its optimizer state cannot be loaded; load without the optimizer (optimizer=None)")
            if absent:  # none of its parameters is in the checkpoint: its state starts afresh
                continue
            sources = {self.index.locate_loaded(entry, name, numel)[0] for name, _, numel in entry_members(entry)}
            with_state = [k for k in sources if saved0["state"].get(source_index[k])]
            if not with_state:
                continue
            if len(with_state) != len(sources):
                raise CheckpointError(f"optimizer state covers only some parameters of '{readable_key(key)}'; "
                                      "load into the wrapping the checkpoint was saved with, or resize it offline")
            source_shape = list(self.source.layout[with_state[0]]["shard_shape"])
            st: Dict[str, Any] = {}
            for field, value in saved0["state"][source_index[with_state[0]]].items():
                if is_per_element(field, value, source_shape):
                    def read(k, r, field=field):
                        return self._ckpts[r]["optimizer"]["state"][source_index[k]][field].reshape(-1)
                    st[field] = (value.dtype, entry["shard_shape"], self._filler(entry, rank, read))
                else:
                    st[field] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
            state[i] = st
        saved_groups = saved0["param_groups"]
        if len(optimizer.param_groups) != len(saved_groups):
            raise CheckpointError(f"the optimizer has {len(optimizer.param_groups)} parameter groups, the checkpoint "
                                  f"{len(saved_groups)}: build the optimizer as when the checkpoint was saved")
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in saved_groups]
        return {"state": state, "groups": groups}

    def apply(self, plan: Dict[str, Any], model, optimizer) -> None:
        """Fill the model's shards and the optimizer's state. Host (CPU) shards are filled in place,
        one slice at a time, so the rank never holds a second copy of its state; device shards go
        through a host copy of one tensor at a time."""
        current = model.state_dict()
        with torch.no_grad():
            for key, (fill, keeps_some) in plan["shards"].items():
                target = current[key]
                if target.device.type == "cpu" and target.is_contiguous():
                    fill(target.view(-1))  # the detached shard shares the parameter's storage and version
                else:
                    staged = (target.detach().cpu().reshape(-1).clone() if keeps_some
                              else torch.empty(target.numel(), dtype=target.dtype))
                    fill(staged)
                    target.copy_(staged.view(target.shape))
        if plan["buffers"]:
            model.load_state_dict(plan["buffers"], strict=False)
        if optimizer is not None:
            self._apply_optimizer(plan["optimizer"], optimizer)

    def _apply_optimizer(self, plan: Dict[str, Any], optimizer) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        existing = [optimizer.state.get(p, {}) for p in params]
        in_place = {i for i, st in enumerate(existing) if st} == set(plan["state"]) and all(
            i < len(params) and all(
                isinstance(existing[i].get(f), torch.Tensor) and (not isinstance(spec, tuple) or (
                    existing[i][f].dtype == spec[0] and list(existing[i][f].shape) == list(spec[1])
                    and existing[i][f].device.type == "cpu" and existing[i][f].is_contiguous()))
                for f, spec in st.items())
            for i, st in plan["state"].items())
        if in_place:  # write into the optimizer's own state tensors: no second copy
            with torch.no_grad():
                for i, st in plan["state"].items():
                    for field, spec in st.items():
                        if isinstance(spec, tuple):
                            spec[2](existing[i][field].view(-1))
                        else:
                            existing[i][field].copy_(spec)
            for group, saved in zip(optimizer.param_groups, plan["groups"]):
                group.update(saved)
            return
        state = {}
        for i, st in plan["state"].items():
            state[i] = {}
            for field, spec in st.items():
                if isinstance(spec, tuple):
                    dtype, shape, fill = spec
                    tensor = torch.empty(math.prod(shape), dtype=dtype)
                    fill(tensor)
                    state[i][field] = tensor.view(shape)
                else:
                    state[i][field] = spec
        groups = copy.deepcopy(optimizer.state_dict()["param_groups"])
        for group, saved in zip(groups, plan["groups"]):
            group.update(saved)
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def extra(self) -> Optional[dict]:
        return self._ckpts[0].get("extra")

    def close(self) -> None:
        self._ckpts = None
        self.source.release()


def mismatch_line(prefix: str, missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """One line for a checkpoint whose names differ from the model's, as ``load_state_dict`` words it."""
    parts = ([f"the model's {_few(missing)} are not in it ({len(missing)} missing)"] if missing else []) + (
        [f"it holds {_few(unexpected)} that the model has not ({len(unexpected)} unexpected)"] if unexpected else [])
    return (f"the checkpoint '{prefix}' was saved from another model: {'; '.join(parts)}; build the model as it was "
            "saved (its config, --model), or pass strict=False to load the names both have")


def _few(names: Sequence[str]) -> str:
    return ", ".join(f"'{n}'" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def needs_resizing(ckpt_prefix: str, model, own_metadata: Optional[Mapping[str, Any]]) -> bool:
    """Whether the checkpoint differs from the model in world size or layout (then it is read by
    name); decided from what every rank sees alike."""
    if own_metadata is None:
        return True
    if own_metadata.get("world_size") != model.world_size:
        return True
    layout = model.get_shard_metadata()["layout"]
    saved = own_metadata.get("layout", {})
    return set(saved) != set(layout) or any(
        saved[k]["names"] != v["names"] or saved[k]["shapes"] != v["shapes"] or saved[k]["mode"] != v["mode"]
        or saved[k].get("padded_numel") != v.get("padded_numel") for k, v in layout.items())
