"""How xla_fsdp spells names inside a wrapped model, and how to read them back: plain strings, no
imports, so any layer (checkpoint files, messages) can use them."""
from __future__ import annotations

WRAPPED = "_fsdp_wrapped_module"  # attribute holding a unit's module, as in torch_xla
TORCH_XLA_FLATTEN_WRAPPER = "_fpw_module"  # torch_xla's FlattenParamsWrapper step in its checkpoints' keys
SHARD_SEPARATOR = "_FSDP_SHARD_SEPARATOR_"  # stands for "." in a shard's attribute name, as in torch_xla
SHARD_PREFIX = "_fsdp_shard" + SHARD_SEPARATOR


def clean_name(name: str) -> str:
    """A module path or state-dict key as the unwrapped model spells it: without the wrappers'
    ``_fsdp_wrapped_module`` (and torch_xla's ``_fpw_module``) steps."""
    return ".".join(p for p in name.split(".") if p and p not in (WRAPPED, TORCH_XLA_FLATTEN_WRAPPER))


def readable_key(key: str) -> str:
    """A state-dict key as the user knows it: a shard's ``_fsdp_shard_FSDP_SHARD_SEPARATOR_...``
    attribute spelled with dots, without the wrappers' steps (for messages)."""
    parts = []
    for part in key.split("."):
        if part.startswith(SHARD_PREFIX):
            part = part[len(SHARD_PREFIX):].replace(SHARD_SEPARATOR, ".")
        parts.append(part)
    return clean_name(".".join(parts))
