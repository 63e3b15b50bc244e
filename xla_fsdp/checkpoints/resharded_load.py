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
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from ..shard_names import clean_name, readable_key
from .consolidate import MISSING_OPTIMIZER_KEYS, ShardedCheckpoint
from .files import CheckpointError, verify_archive

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

    def locate(self, name: str, numel: int) -> Tuple[str, int]:
        if name not in self.where:
            raise CheckpointError(f"the checkpoint has no parameter '{name}' (it holds e.g. "
                                  f"{sorted(self.where)[:3]}): it was saved from another model")
        key, offset, saved_numel = self.where[name]
        if saved_numel != numel:
            raise CheckpointError(f"parameter '{name}' has {saved_numel} elements in the checkpoint and {numel} "
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
                   read_chunk, dtype: torch.dtype) -> torch.Tensor:
    """This rank's flat shard of a model entry, filled from the checkpoint's chunks.
    ``read_chunk(key, source_rank)`` returns that rank's flat (1-D) tensor for ``key``."""
    size = chunk_numel(entry)
    out = torch.zeros(size, dtype=dtype)
    lo, hi = rank * size, (rank + 1) * size
    for name, offset, numel in entry_members(entry):
        start, end = max(lo, offset), min(hi, offset + numel)
        if start >= end:
            continue
        key, source_offset = index.locate(name, numel)
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


class ReshardedLoad:
    """A checkpoint of another world size or wrapping, read for one rank of a live model."""

    def __init__(self, ckpt_prefix: str):
        self.source = ShardedCheckpoint(ckpt_prefix, verify=False)  # rank files checked in verify_share
        self.index = NameIndex(self.source.layout)
        self._ckpts = self.source._open()

    def verify_share(self, flat_rank: int, ranks: int) -> None:
        """Check the zip CRC-32 of every ``ranks``-th rank file, from this rank's position: the
        ranks together check every file once (and agree on the outcome afterwards)."""
        for i, f in enumerate(self.source.files):
            if i % ranks == flat_rank:
                verify_archive(f.path)

    def _model_chunk(self, key: str, source_rank: int) -> torch.Tensor:
        return self._ckpts[source_rank]["model"][key].reshape(-1)

    def model_state(self, model, rank: int) -> Dict[str, torch.Tensor]:
        """The model's sharded state dict for ``rank``: shards assembled by name, buffers by name."""
        layout = model.get_shard_metadata()["layout"]
        current = model.state_dict()
        state: Dict[str, torch.Tensor] = {}
        buffers = {clean_name(k): k for k in self.source.buffer_keys}
        for key, value in current.items():
            if key in layout:
                state[key] = assemble_shard(layout[key], rank, self.index, self.source.layout, self._model_chunk,
                                            value.dtype)
            elif clean_name(key) in buffers:
                state[key] = self._ckpts[0]["model"][buffers[clean_name(key)]].clone()
            elif "_fsdp_shard" not in key:
                raise CheckpointError(f"the checkpoint '{self.source.prefix}' has no buffer '{readable_key(key)}'")
        return state

    def optimizer_state(self, model, optimizer, rank: int, model_keys: List[str]) -> Dict[str, Any]:
        """The optimizer's state dict for ``rank``: state shaped like a shard assembled as the
        parameters are, scalars (``step``) copied, hyperparameters of the saved groups."""
        source_keys = self.source.optimizer_param_keys
        if source_keys is None:
            raise CheckpointError(MISSING_OPTIMIZER_KEYS)
        saved = [c.get("optimizer") for c in self._ckpts]
        if any(s is None for s in saved):
            raise CheckpointError(f"the checkpoint '{self.source.prefix}' holds no optimizer state")
        source_index = {key: i for i, key in enumerate(source_keys)}
        layout = model.get_shard_metadata()["layout"]
        state: Dict[int, Dict[str, Any]] = {}
        for i, key in enumerate(model_keys):
            entry = layout[key]
            sources = {self.index.locate(name, numel)[0] for name, _, numel in entry_members(entry)}
            with_state = [k for k in sources if saved[0]["state"].get(source_index[k])]
            if not with_state:
                continue
            if len(with_state) != len(sources):
                raise CheckpointError(f"optimizer state covers only some parameters of '{readable_key(key)}'; "
                                      "load into the wrapping the checkpoint was saved with, or reshard offline")
            fields = saved[0]["state"][source_index[with_state[0]]]
            st: Dict[str, Any] = {}
            for field, value in fields.items():
                source_shape = list(self.source.layout[with_state[0]]["shard_shape"])
                if isinstance(value, torch.Tensor) and list(value.shape) == source_shape:
                    def read(k, r, field=field):
                        return saved[r]["state"][source_index[k]][field].reshape(-1)
                    st[field] = assemble_shard(entry, rank, self.index, self.source.layout, read, value.dtype)
                else:
                    st[field] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
            state[i] = st
        groups = copy.deepcopy(optimizer.state_dict()["param_groups"])
        saved_groups = saved[0]["param_groups"]
        if len(groups) != len(saved_groups):
            raise CheckpointError(f"the optimizer has {len(groups)} parameter groups, the checkpoint "
                                  f"{len(saved_groups)}: build the optimizer as when the checkpoint was saved")
        for group, saved_group in zip(groups, saved_groups):
            group.update({k: copy.deepcopy(v) for k, v in saved_group.items() if k != "params"})
        return {"state": state, "param_groups": groups}

    def extra(self) -> Optional[dict]:
        return self._ckpts[0].get("extra")

    def close(self) -> None:
        self._ckpts = None
        self.source.release()


def needs_resharding(ckpt_prefix: str, model, own_metadata: Optional[Mapping[str, Any]]) -> bool:
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
