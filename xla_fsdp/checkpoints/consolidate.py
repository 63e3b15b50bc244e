"""Consolidate a sharded checkpoint into one full state dict, streaming one layout entry at a time.

The :class:`~.reader.ShardedCheckpoint` stitches each entry's full tensors from the memory-mapped rank
files; they are written and dropped. Peak memory stays near the largest entry plus the reader's
reopen window, not the model size (with ``--optimizer``, the whole optimizer state is held).
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Dict, Tuple

import torch

from .files import CheckpointError, FileSet, find_rank_files, prepare_output, refuse_overwriting_inputs, stored_bytes
from .reader import ShardedCheckpoint
from .stream_save import PthStreamWriter, SafetensorsStreamWriter

def default_save_path(ckpt_prefix: str, fmt: str = "pth") -> str:
    return ckpt_prefix + ("_consolidated.pth" if fmt == "pth" else "_consolidated.safetensors")


def write_consolidated(ckpt: ShardedCheckpoint, save_path: str, fmt: str = "pth",
                       include_optimizer: bool = False, overwrite: bool = False) -> str:
    """Stream the full state dict to ``save_path`` (atomically) in ``fmt`` ('pth' or 'safetensors').
    Its folders are created; an earlier file of that format there is replaced, anything else only
    with ``overwrite`` (:func:`~xla_fsdp.checkpoints.files.prepare_output`)."""
    if fmt not in ("pth", "safetensors"):
        raise ValueError(f"unknown format {fmt!r}: use 'pth' or 'safetensors'")
    opt_path = save_path + ".optimizer.pth"  # safetensors holds no optimizer state: beside it
    outputs = [save_path] + ([opt_path] if include_optimizer and fmt == "safetensors" else [])
    refuse_overwriting_inputs(outputs, [f.path for f in ckpt.files])
    for path in outputs:
        prepare_output(path, "torch" if fmt == "pth" or path == opt_path else "safetensors", overwrite)
    if fmt == "pth":
        optimizer = ckpt.full_optimizer_state() if include_optimizer else None

        def write(tmp: str) -> None:
            with PthStreamWriter(tmp) as w:
                for name, tensor in ckpt.iter_model():
                    w.add(name, tensor)
                optimizer_refs = w.add_nested(optimizer) if optimizer else None
                w.set_structure(
                    lambda t: {"model": OrderedDict(t), **({"optimizer": optimizer_refs} if optimizer else {})}
                )
    elif fmt == "safetensors":
        specs = ckpt.model_specs()

        def write(tmp: str) -> None:
            with SafetensorsStreamWriter(tmp, specs, {"format": "pt"}) as w:
                for name, tensor in ckpt.iter_model():
                    w.add(name, tensor)
    model_bytes = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                      for _, dtype, shape in ckpt.model_specs())
    in_file = model_bytes + (stored_bytes(optimizer) if fmt == "pth" and optimizer else 0)
    with FileSet() as outputs:  # the model file and the optimizer's beside it: both or neither
        outputs.write(save_path, write, in_file)
        if include_optimizer and fmt == "safetensors":
            outputs.torch_save({"optimizer": ckpt.full_optimizer_state()}, opt_path)
    ckpt.release()
    return save_path


#: how long a rank thread waits for the rank files its peers are still writing
PEER_FILES_WAIT_S = 300.0


def _wait_for_peer_files(ckpt_prefix: str, ckpt_suffix: str) -> None:
    """Called from a rank thread (several XLA:CPU devices in one process), wait while the set of
    rank files lacks some: the peers write them (``xm.save`` writes each whole, under a temporary
    name first). torch_xla's MNIST FSDP test consolidates on rank 0 right after rank 0's own
    ``xm.save``, which in torch_xla 2.9 meets no peer after writing, so the set was often not
    complete yet (3 runs in 3 at 4 devices). Elsewhere (a process of its own, the CLIs) a missing
    file is reported at once."""
    from ..collectives.xla_launch import in_rank_thread
    if not in_rank_thread():
        return
    deadline = time.monotonic() + PEER_FILES_WAIT_S
    while time.monotonic() < deadline:
        try:
            find_rank_files(ckpt_prefix, ckpt_suffix)
            return
        except CheckpointError as e:
            if "is missing rank files" not in str(e):
                return  # reported as it is by the load
        time.sleep(0.05)


def consolidate_sharded_model_checkpoints(ckpt_prefix: str, ckpt_suffix: str = "*.pth", save_path: str = "",
                                          save_model: bool = True) -> Tuple[Dict[str, torch.Tensor], str]:
    """torch_xla's signature and return value: ``(full_state_dict, actual_save_path)``.

    The rank files are found with ``ckpt_prefix + ckpt_suffix`` but only ``_rank-*-of-*.pth`` names
    count (a consolidated file is never re-read). With ``save_model`` the full state dict is
    streamed to ``save_path`` (default ``ckpt_prefix + '_consolidated.pth'``) as ``{'model': ...}``
    and returned memory-mapped from it.
    """
    _wait_for_peer_files(ckpt_prefix, ckpt_suffix)
    ckpt = ShardedCheckpoint(ckpt_prefix, ckpt_suffix)
    if not save_model:
        full = OrderedDict(ckpt.iter_model())
        ckpt.release()
        return full, ""
    path = save_path or default_save_path(ckpt_prefix)
    write_consolidated(ckpt, path)
    return torch.load(path, mmap=True, weights_only=True)["model"], path
