"""A Hugging Face model folder from a sharded checkpoint: ``model-0000i-of-0000N.safetensors``
files of at most ``max_shard_size`` bytes each and ``model.safetensors.index.json``, named as the
unwrapped model's ``state_dict()``, streamed (one entry's tensors in memory at a time), so
``from_pretrained(folder)`` loads it once a ``config.json`` is beside it.

Tied weights are written once, under the first name the model registers them by (GPT-2's
``transformer.wte.weight``, not ``lm_head.weight``), as ``save_pretrained`` does: safetensors
cannot share storage between names, and transformers re-ties the others on load.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
from typing import Dict, List, Optional, Tuple

import torch

from .reader import ShardedCheckpoint
from .files import CheckpointError, FileSet, atomic_write, prepare_output, refuse_overwriting_inputs
from .stream_save import SafetensorsStreamWriter

INDEX_NAME = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_size(text: str) -> int:
    """``"2GB"`` -> 2 * 10**9, ``"500MiB"`` -> 500 * 2**20, ``"4096"`` -> 4096 (transformers' units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not m or m.group(2) not in _UNITS:
        raise CheckpointError(f"cannot read the size '{text}': write it like 2GB, 500MB or 500MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def plan_files(specs: List[Tuple[str, torch.dtype, Tuple[int, ...]]], max_bytes: int) -> List[List[str]]:
    """Tensor names per file, in order: a file is closed before it would exceed ``max_bytes``; a
    tensor larger than that gets a file of its own (as transformers does)."""
    files: List[List[str]] = [[]]
    size = 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def write_hf_safetensors(ckpt: ShardedCheckpoint, out_dir: str, max_shard_size: str = "5GB",
                         dtype: Optional[str] = None, hf_config: Optional[str] = None,
                         overwrite: bool = False) -> List[str]:
    """Write the model folder; returns the written safetensors paths. ``dtype`` casts floating
    tensors; ``hf_config`` (a ``config.json`` or a folder holding one) is copied beside them. The
    folder is created; files of an earlier export there are replaced, anything else only with
    ``overwrite``. Nothing is created before every argument is checked."""
    cast = DTYPES[dtype] if dtype else None
    max_bytes = parse_size(max_shard_size)
    config_source = None
    if hf_config:
        config_source = os.path.join(hf_config, "config.json") if os.path.isdir(hf_config) else hf_config
        if not os.path.isfile(config_source):
            raise CheckpointError(f"no config.json at '{hf_config}'")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"the output folder '{out_dir}' is a file: give a folder for the Hugging Face model")
    primary = _primary_names(ckpt)
    specs = [(n, cast if cast is not None and d.is_floating_point else d, s)
             for n, d, s in ckpt.model_specs() if n in primary]
    files = plan_files(specs, max_bytes)
    names = [os.path.join(out_dir, f"model-{i + 1:05d}-of-{len(files):05d}.safetensors") for i in range(len(files))]
    config_path = os.path.join(out_dir, "config.json")
    refuse_overwriting_inputs(names + [os.path.join(out_dir, INDEX_NAME)] + ([config_path] if hf_config else []),
                              [f.path for f in ckpt.files] + ([config_source] if config_source else []))
    for path in names:
        prepare_output(path, "safetensors", overwrite)
    for path in [os.path.join(out_dir, INDEX_NAME)] + ([config_path] if hf_config else []):
        prepare_output(path, "json", overwrite)
    spec_of = {n: (n, d, s) for n, d, s in specs}
    file_of = {n: i for i, members in enumerate(files) for n in members}
    tensors = ((n, t) for n, t in ckpt.iter_model() if n in primary)
    pending: Dict[str, torch.Tensor] = {}
    with FileSet() as outputs:  # every file and the index, or none of them
        for i, members in enumerate(files):
            def write(tmp: str, i=i, members=members) -> None:
                with SafetensorsStreamWriter(tmp, [spec_of[n] for n in members], {"format": "pt"}) as w:
                    for name in members:
                        while name not in pending:  # the stream runs in the same order as the plan
                            n, t = next(tensors)
                            pending[n] = t if cast is None or not t.is_floating_point() else t.to(cast)
                        w.add(name, pending.pop(name))
            outputs.write(names[i], write, sum(_nbytes(spec_of[n]) for n in members))
        total = sum(_nbytes(spec) for spec in specs)
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: os.path.basename(names[file_of[n]]) for n, _, _ in specs}}
        outputs.write(os.path.join(out_dir, INDEX_NAME), lambda tmp: _write_json(tmp, index))
    for stale in glob.glob(os.path.join(glob.escape(out_dir), "model-*-of-*.safetensors")):
        if stale not in names:  # an earlier export with another number of files
            os.unlink(stale)
    if config_source:
        atomic_write(config_path, lambda tmp: shutil.copyfile(config_source, tmp))
    ckpt.release()
    return names


def _nbytes(spec: Tuple[str, torch.dtype, Tuple[int, ...]]) -> int:
    return math.prod(spec[2]) * torch.empty((), dtype=spec[1]).element_size()


def _primary_names(ckpt: ShardedCheckpoint) -> set:
    """Every name of the full state dict except the later names of tied parameters."""
    aliases = {a for entry in ckpt.layout.values() for names in entry.get("aliases", {}).values() for a in names}
    return {n for n, _, _ in ckpt.model_specs() if n not in aliases}


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
