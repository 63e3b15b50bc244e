"""Read a sharded checkpoint: a complete, validated set of rank files, opened lazily, with each tensor
checked against its checksum as it is read. The one reader every checkpoint tool uses (consolidation,
offline and load-time resizing, HF export, DCP conversion).

Rank files are memory-mapped and reopened every ``REOPEN_BYTES`` read, so pages already used can be
released: a tool that walks the checkpoint holds about one layout entry at a time, not the model.
"""
from __future__ import annotations

import gc
import os
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from ..shard_names import clean_name, readable_key
from ..sharding import stitch_entry
from .files import (DEFAULT_SUFFIX, CheckpointError, check_consistent, find_rank_files, load_rank_file,
                    tensor_checksum, verify_archive)
from .metadata import full_optimizer_state_dict, is_per_element, param_order
from .migrate import is_torch_xla_metadata, torch_xla_layout

REOPEN_BYTES = 64 * 1024 * 1024


MISSING_OPTIMIZER_KEYS = (
    "the rank files hold optimizer state but not which shard each optimizer parameter is: the optimizer "
    "was not built from model.parameters() in order (optimizer_param_groups?), and the metadata has no "
    "'optimizer_param_keys'. Save with xla_fsdp.save_sharded_checkpoint(model, optimizer, prefix), or add "
    "shard_metadata['optimizer_param_keys'] = xla_fsdp.checkpoints.optimizer_param_keys(model, optimizer) "
    "to each rank's file")


def _parameters_order_keys(metadata: Dict[str, Any], optimizer: Any, layout: Dict[str, Any]) -> Optional[List[str]]:
    """Files written the torch_xla way (plain ``torch.save`` of the model's state dict,
    ``get_shard_metadata()`` and the optimizer's state dict) carry no optimizer map. An optimizer
    built from ``model.parameters()`` lists the shards in ``metadata['param_keys']`` order: accept
    that order only where the optimizer's indices and state shapes say so."""
    keys = metadata.get("param_keys")
    if not keys or not isinstance(optimizer, dict) or "param_groups" not in optimizer:
        return None
    order = [i for g in optimizer["param_groups"] for i in g["params"]]
    if order != list(range(len(keys))):
        return None
    for idx, fields in optimizer.get("state", {}).items():
        shard_shape = list(layout[keys[idx]]["shard_shape"])
        if any(isinstance(v, torch.Tensor) and v.dim() > 0 and list(v.shape) != shard_shape for v in fields.values()):
            return None
    return list(keys)


class RankFileReader:
    """One rank file, read memory-mapped (or whole): its archive checked first (the CRC-32 of every record,
    whoever wrote it), its tensors against the metadata's checksums as a caller takes them."""

    def __init__(self, path: str, verify: bool = True, mmap: bool = True):
        if verify:
            verify_archive(path)
        self.path = path
        self.contents: Dict[str, Any] = load_rank_file(path, mmap=mmap)

    @property
    def metadata(self) -> Dict[str, Any]:
        return self.contents["shard_metadata"]

    @property
    def extra(self) -> Optional[Dict[str, Any]]:
        return self.contents.get("extra")

    def _sums(self, section: str) -> Mapping[str, int]:
        return self.metadata.get("checksums", {}).get(section, {})

    def check(self, section: str, key: str, tensor: torch.Tensor) -> None:
        """Raise if ``tensor`` (``key`` of the model, or ``"{index}.{field}"`` of the optimizer) fails its checksum."""
        sums = self._sums(section)
        if key in sums and tensor_checksum(tensor) != sums[key]:
            raise CheckpointError(f"'{self.path}': tensor '{readable_key(key)}' is corrupted (checksum mismatch); "
                                  "restore this file from a backup or use an earlier checkpoint")

    def _missing(self, section: str, present) -> None:
        """Raise for a tensor the metadata's checksums list that the section lacks."""
        missing = [k for k in self._sums(section) if k not in present]
        if missing:
            raise CheckpointError(f"'{self.path}': tensor '{readable_key(missing[0])}' listed in the metadata is "
                                  "missing; restore this file from a backup or use an earlier checkpoint")

    def model(self) -> Dict[str, Any]:
        """The model section, every tensor checked, none the metadata lists missing."""
        self._missing("model", self.contents["model"])
        for key, value in self.contents["model"].items():
            if isinstance(value, torch.Tensor):
                self.check("model", key, value)
        return self.contents["model"]

    def optimizer(self) -> Dict[str, Any]:
        """The optimizer section, every tensor checked; an error where the file holds none."""
        osd = self.contents.get("optimizer")
        if osd is None:
            raise CheckpointError(f"'{self.path}' holds no optimizer state")
        self._missing("optimizer", {f"{i}.{f}" for i, st in osd["state"].items() for f in st})
        for idx, st in osd["state"].items():
            for field, value in st.items():
                if isinstance(value, torch.Tensor):
                    self.check("optimizer", f"{idx}.{field}", value)
        return osd


class ShardedCheckpoint:
    """A complete, validated set of rank files (each a :class:`RankFileReader`), read lazily."""

    def __init__(self, ckpt_prefix: str, ckpt_suffix: str = DEFAULT_SUFFIX, verify: bool = True):
        self.prefix = ckpt_prefix
        self.files = find_rank_files(ckpt_prefix, ckpt_suffix)
        self.world_size = len(self.files)
        self._readers: Optional[List[RankFileReader]] = None
        self._verify = verify  # once, when first opened
        self._read_since_open = 0
        ckpts = self.rank_dicts()
        self.metadatas = [c["shard_metadata"] for c in ckpts]
        check_consistent(self.files, self.metadatas)
        md0 = self.metadatas[0]
        self.from_torch_xla = is_torch_xla_metadata(md0)
        self.layout: Dict[str, Any] = (torch_xla_layout(md0, ckpts[0]["model"]) if self.from_torch_xla
                                       else md0["layout"])
        for f, ckpt in zip(self.files, ckpts):
            missing = [k for k in self.layout if k not in ckpt["model"]]
            if missing:
                raise CheckpointError(f"'{f.path}' lacks shards named in the metadata: "
                                      f"{[readable_key(k) for k in missing[:3]]}")
        self.buffer_keys = [k for k in ckpts[0]["model"] if k not in self.layout and "_fsdp_shard" not in k]
        # Optimizer state is indexed in parameters() order. torch_xla records no map, but its
        # state_dict lists the shards in that same order (both walk the modules alike).
        self.optimizer_param_keys = md0.get("optimizer_param_keys") or (
            [k for k in ckpts[0]["model"] if k in self.layout] if self.from_torch_xla
            else _parameters_order_keys(md0, ckpts[0].get("optimizer"), self.layout))

    @property
    def metadata(self) -> Dict[str, Any]:
        return self.metadatas[0]

    def rank_dicts(self) -> List[Dict[str, Any]]:
        """Every rank file's dict, memory-mapped (opened again after :meth:`release`)."""
        if self._readers is None:
            self._readers = [RankFileReader(f.path, verify=self._verify) for f in self.files]
            self._verify = False
            self._read_since_open = 0
        return [r.contents for r in self._readers]

    def release(self) -> None:
        """Drop the memory maps (pages read so far stop counting against this process)."""
        self._readers = None
        gc.collect()

    def _account(self, nbytes: int) -> None:
        self._read_since_open += nbytes
        if self._read_since_open > REOPEN_BYTES:
            self.release()

    def shards(self, key: str) -> List[torch.Tensor]:
        """Every rank's tensor ``key`` of the model section, each checked against its checksum."""
        self.rank_dicts()
        out = []
        for reader in self._readers:
            t = reader.contents["model"][key]
            reader.check("model", key, t)
            out.append(t)
        return out

    def optimizer_states(self, index: int) -> List[Dict[str, Any]]:
        """Every rank's optimizer state for parameter ``index``, checked against checksums."""
        self.rank_dicts()
        out = []
        for reader in self._readers:
            st = reader.contents["optimizer"]["state"].get(index, {})
            for field, v in st.items():
                if isinstance(v, torch.Tensor):
                    reader.check("optimizer", f"{index}.{field}", v)
            out.append(st)
        return out

    # ------------------------------------------------------------------ model
    def model_specs(self) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
        """(name, dtype, shape) of every tensor of the full state dict, in output order."""
        ckpt0 = self.rank_dicts()[0]["model"]
        specs = []
        for key, entry in self.layout.items():
            dtype = ckpt0[key].dtype
            for name, shape in zip(entry["names"], entry["shapes"]):
                specs.append((name, dtype, tuple(shape)))
                for alias in entry.get("aliases", {}).get(name, []):
                    specs.append((alias, dtype, tuple(shape)))
        buffer_info = self.metadata.get("buffer_info", {})
        for key in self.buffer_keys:
            t = ckpt0[key]
            dtype = buffer_info.get(key, {}).get("_orig_dtype", t.dtype)
            specs.append((clean_name(key), dtype, tuple(t.shape)))
        return specs

    def iter_model(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(original name, full tensor) for parameters (tied aliases repeated), then buffers."""
        for key, entry in self.layout.items():
            shards = self.shards(key)
            tensors = stitch_entry(entry, shards)
            self._account(sum(s.numel() * s.element_size() for s in shards))
            for name, tensor in zip(entry["names"], tensors):
                yield name, tensor
                for alias in entry.get("aliases", {}).get(name, []):
                    yield alias, tensor
        yield from self.iter_buffers()

    def iter_buffers(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(original name, buffer in its original dtype): buffers are whole on every rank."""
        buffer_info = self.metadata.get("buffer_info", {})
        for key in self.buffer_keys:
            t = self.shards(key)[0].clone()
            original = buffer_info.get(key, {}).get("_orig_dtype")
            yield clean_name(key), (t.to(original) if original is not None else t)

    # ------------------------------------------------------------------ optimizer
    def full_optimizer_state(self) -> Dict[str, Any]:
        """A plain ``torch.optim`` state dict keyed by original parameter names, for the unwrapped
        model's optimizer: ``state`` and every group's ``params`` in the unwrapped model's
        ``named_parameters()`` order (``optimizer.load_state_dict`` maps by position), each group
        with ``param_names``; the groups as the wrapped optimizer had them."""
        ckpts = self.rank_dicts()
        if any(c.get("optimizer") is None for c in ckpts):
            raise CheckpointError("the checkpoint holds no optimizer state")
        keys = self.optimizer_param_keys
        if keys is None:
            raise CheckpointError(MISSING_OPTIMIZER_KEYS)
        state: Dict[str, Any] = {}
        for idx, key in enumerate(keys):
            entry = self.layout[key]
            per_rank = self.optimizer_states(idx)
            full: Dict[str, List[Any]] = {}
            for field, value in per_rank[0].items():
                if is_per_element(field, value, entry["shard_shape"]):
                    full[field] = stitch_entry(entry, [st[field] for st in per_rank])
                else:
                    full[field] = [value.clone() if isinstance(value, torch.Tensor) else value] * len(entry["names"])
            for i, name in enumerate(entry["names"]):
                state[name] = {field: values[i] for field, values in full.items()}
        order, recorded = param_order(self.metadata, [n for key in keys for n in self.layout[key]["names"]])
        if not recorded:
            warnings.warn(f"'{self.prefix}': the rank files do not record the model's parameter order (written by "
                          "torch_xla, imported, or by an older xla_fsdp); the optimizer state lists the parameters "
                          "in an order inferred from their names: check each group's 'param_names' against "
                          "[n for n, _ in model.named_parameters()] before optimizer.load_state_dict", stacklevel=2)
        return full_optimizer_state_dict(state, ckpts[0]["optimizer"]["param_groups"],
                                         lambda idx: self.layout[keys[idx]]["names"], order)

    # ------------------------------------------------------------------ verification
    def verify(self) -> List[str]:
        """Check every tensor against its checksum and its layout; return a line per rank file."""
        report = []
        for f, md in zip(self.files, self.metadatas):
            ckpt = RankFileReader(f.path, verify=False).contents
            sums = md.get("checksums", {})
            checked = 0
            for key, expected in sums.get("model", {}).items():
                if key not in ckpt["model"]:
                    raise CheckpointError(f"'{f.path}': tensor '{readable_key(key)}' is missing")
                if tensor_checksum(ckpt["model"][key]) != expected:
                    raise CheckpointError(f"'{f.path}': tensor '{readable_key(key)}' is corrupted (checksum mismatch)")
                checked += 1
            osd = ckpt.get("optimizer") or {}
            for name, expected in sums.get("optimizer", {}).items():
                idx, field = name.split(".", 1)
                value = osd.get("state", {}).get(int(idx), {}).get(field)
                if value is None or tensor_checksum(value) != expected:
                    raise CheckpointError(f"'{f.path}': optimizer tensor '{name}' is corrupted or missing")
                checked += 1
            for key, entry in self.layout.items():
                if list(ckpt["model"][key].shape) != list(entry["shard_shape"]):
                    raise CheckpointError(
                        f"'{f.path}': shard '{readable_key(key)}' has shape {list(ckpt['model'][key].shape)}, "
                        f"metadata says {entry['shard_shape']}"
                    )
            unverified = md.get("unverified_source")
            report.append(f"{os.path.basename(f.path)}: ok ({checked} checksums"
                          f"{'' if sums else ', none recorded'})" + (
                              f"; its values are unverified: the checksums were made when it was imported from the "
                              f"{unverified}, which keeps none, so damage there before the import passes"
                              if unverified else ""))
            del ckpt
        return report
