"""Read the FSDP configuration the ecosystem already writes (HF Accelerate / Transformers).

``from_accelerate(cfg, model)`` turns an Accelerate ``fsdp_config`` (a dict, a YAML file, or a whole
``accelerate config`` file holding one) into this package's wrapper keywords. Class names are
resolved against the model's own modules, so no import paths are needed, and every key is checked:
unknown keys and class names are errors that name the alternatives, never silently ignored.
"""
from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Set, Type, Union

import torch
import torch.nn as nn

from ..strategy import parse_strategy
from ..unit.offload import offload_requested

STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")

# Keys Accelerate writes that tune CUDA streams or PyTorch FSDP internals: nothing to do on XLA or in
# this design (parameters are always the originals' shards; forward prefetching follows ``prefetch``).
NO_EFFECT = {
    "forward_prefetch", "use_orig_params",
    "sync_module_states", "cpu_ram_efficient_loading", "limit_all_gathers", "version",
    "activation_checkpointing", "reshard_after_forward_policy",
}
KNOWN = {
    "auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params", "sharding_strategy",
    "state_dict_type", "offload_params", "xla", "xla_fsdp_settings", "xla_fsdp_grad_ckpt",
    "xla_fsdp_v2", "reshard_after_forward", "_mixed_precision", "backward_prefetch", "backward_prefetch_policy",
} | NO_EFFECT
PREFETCH_POLICIES = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")


@dataclass
class FsdpSettings:
    """Wrapper keywords from a config, plus what the config says about checkpoints."""

    kwargs: Dict[str, Any]
    state_dict_type: str = "SHARDED_STATE_DICT"
    no_effect: Dict[str, Any] = field(default_factory=dict)  # accepted keys that change nothing here
    spmd: bool = False  # xla_fsdp_v2: the SPMD mode (one process per host, shards by annotation)

    def wrap(self, model: nn.Module):
        """``XlaFullyShardedDataParallel(model, **kwargs)``, or in SPMD mode
        ``xla_fsdp.spmd.SpmdFullyShardedDataParallel(model, **kwargs)``."""
        if self.spmd:
            from ..spmd import SpmdFullyShardedDataParallel
            return SpmdFullyShardedDataParallel(model, **self.kwargs)
        from ..fully_sharded_data_parallel import XlaFullyShardedDataParallel
        return XlaFullyShardedDataParallel(model, **self.kwargs)


def _load(cfg: Union[str, os.PathLike, Mapping[str, Any]]) -> Dict[str, Any]:
    if isinstance(cfg, (str, os.PathLike)):
        import yaml
        if not os.path.exists(cfg):
            raise FileNotFoundError(f"xla_fsdp: no config file '{cfg}'")
        with open(cfg) as f:
            cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, Mapping):
        raise TypeError(f"xla_fsdp: an FSDP config is a mapping or a YAML path, got {type(cfg).__name__}")
    whole = "fsdp_config" in cfg  # a whole `accelerate config` file, or just its fsdp_config
    inner = dict(cfg["fsdp_config"] if whole else cfg)
    # Accelerate prefixes keys with "fsdp_"; Transformers' Trainer accepts them without.
    out = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in inner.items()}
    if whole and str(cfg.get("mixed_precision", "no")).lower() in ("bf16", "fp16"):
        out["_mixed_precision"] = str(cfg["mixed_precision"]).lower()
    return out


def _class_names(value: Any) -> List[str]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return [str(v) for v in value]


def _resolve_classes(names: List[str], model: nn.Module) -> Set[Type[nn.Module]]:
    found = {type(m).__name__: type(m) for m in model.modules()}
    classes = set()
    for name in names:
        if name not in found:
            close = difflib.get_close_matches(name, found, n=3)
            hint = f" Did you mean {close}?" if close else f" The model has: {sorted(found)[:12]}"
            raise ValueError(f"xla_fsdp: transformer_layer_cls_to_wrap names '{name}', which is no module "
                             f"class of this model.{hint}")
        classes.add(found[name])
    return classes


def _dtype(value: Any) -> Any:
    if isinstance(value, str) and value.startswith(("torch.", "float", "bfloat")):
        name = value.split(".")[-1]
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"xla_fsdp: unknown dtype '{value}' in xla_fsdp_settings")
        return dtype
    return value


def _xla_settings(settings: Mapping[str, Any]) -> Dict[str, Any]:
    import inspect
    from ..fully_sharded_data_parallel import XlaFullyShardedDataParallel
    allowed = set(inspect.signature(XlaFullyShardedDataParallel.__init__).parameters) - {"self", "module"}
    out = {}
    for key, value in settings.items():
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=3)
            raise ValueError(f"xla_fsdp: xla_fsdp_settings has unknown keyword '{key}'"
                             + (f"; did you mean {close}?" if close else ""))
        out[key] = _dtype(value) if key in ("compute_dtype", "buffer_dtype", "output_dtype",
                                             "param_storage_dtype") else value
    return out


def from_accelerate(cfg: Union[str, os.PathLike, Mapping[str, Any]], model: nn.Module) -> FsdpSettings:
    """Wrapper keywords for ``model`` from an Accelerate/Transformers ``fsdp_config``.

    Maps ``fsdp_auto_wrap_policy`` (TRANSFORMER_BASED_WRAP with ``fsdp_transformer_layer_cls_to_wrap``
    class names, SIZE_BASED_WRAP with ``fsdp_min_num_params``, NO_WRAP), ``fsdp_sharding_strategy``
    (1-5 or names), ``fsdp_state_dict_type``, ``fsdp_offload_params`` (``cpu_offload``),
    ``xla_fsdp_settings`` (this wrapper's keywords, dtypes as strings allowed) and
    ``xla_fsdp_grad_ckpt`` (rematerialize every auto-wrapped unit) and ``xla_fsdp_v2`` (the SPMD
    mode: ``wrap`` builds ``xla_fsdp.spmd.SpmdFullyShardedDataParallel``).
    """
    from ..remat import checkpoint_module
    from ..fully_sharded_data_parallel import XlaFullyShardedDataParallel
    from ..wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    raw = _load(cfg)
    unknown = sorted(set(raw) - KNOWN)
    if unknown:
        hints = {k: difflib.get_close_matches(k, KNOWN, n=1) for k in unknown}
        raise ValueError(f"xla_fsdp: unknown FSDP config keys {unknown} (closest known: {hints}); "
                         f"known keys: {sorted(KNOWN)}")
    spmd = str(raw.get("xla_fsdp_v2", False)).lower() == "true"  # a YAML bool or the environment's "true"
    kwargs: Dict[str, Any] = {}
    if "_mixed_precision" in raw:  # accelerate's top-level mixed_precision: bf16 | fp16
        kwargs["compute_dtype"] = torch.bfloat16 if raw["_mixed_precision"] == "bf16" else torch.float16
    policy = str(raw.get("auto_wrap_policy") or ("TRANSFORMER_BASED_WRAP" if raw.get("transformer_layer_cls_to_wrap")
                                                   else "SIZE_BASED_WRAP" if raw.get("min_num_params") else "NO_WRAP"))
    policy = policy.upper()
    if policy not in AUTO_WRAP_POLICIES:
        raise ValueError(f"xla_fsdp: fsdp_auto_wrap_policy '{policy}' is not one of {AUTO_WRAP_POLICIES}")
    if policy == "TRANSFORMER_BASED_WRAP":
        names = _class_names(raw.get("transformer_layer_cls_to_wrap") or [])
        if not names:
            raise ValueError("xla_fsdp: TRANSFORMER_BASED_WRAP needs fsdp_transformer_layer_cls_to_wrap "
                             "(class names, e.g. BertLayer)")
        kwargs["auto_wrap_policy"] = functools.partial(transformer_auto_wrap_policy,
                                                       transformer_layer_cls=_resolve_classes(names, model))
    elif policy == "SIZE_BASED_WRAP":
        min_params = int(raw.get("min_num_params") or 1e8)
        kwargs["auto_wrap_policy"] = functools.partial(size_based_auto_wrap_policy, min_num_params=min_params)
    if "sharding_strategy" in raw:
        kwargs["sharding_strategy"] = parse_strategy(raw["sharding_strategy"])
    if "reshard_after_forward" in raw and "sharding_strategy" not in raw:
        kwargs["reshard_after_forward"] = bool(raw["reshard_after_forward"])
    for key in ("backward_prefetch", "backward_prefetch_policy"):
        if key in raw:  # either prefetch policy gathers ahead here (eager transports); XLA schedules itself
            policy_name = str(raw[key] or "NO_PREFETCH").upper()
            if policy_name not in PREFETCH_POLICIES:
                raise ValueError(f"xla_fsdp: fsdp_{key} '{raw[key]}' is not one of {PREFETCH_POLICIES}")
            kwargs["prefetch"] = policy_name != "NO_PREFETCH"
    settings = _xla_settings(raw.get("xla_fsdp_settings") or {})
    if "offload_params" in raw:  # master parameters, gradients and optimizer state in host memory
        offload = str(raw["offload_params"]).lower()  # a YAML bool, or Accelerate's environment form "true"
        if offload not in ("true", "false"):
            raise ValueError(f"xla_fsdp: fsdp_offload_params is true or false, got {raw['offload_params']!r}")
        offload = offload == "true"
        if "cpu_offload" in settings and offload_requested(settings["cpu_offload"])[0] != offload:
            raise ValueError(f"xla_fsdp: fsdp_offload_params={str(offload).lower()} contradicts xla_fsdp_settings "
                             f"cpu_offload={settings['cpu_offload']!r}; set one of them")
        kwargs["cpu_offload"] = offload
    kwargs.update(settings)
    if raw.get("xla_fsdp_grad_ckpt"):
        if "auto_wrap_policy" not in kwargs:
            raise ValueError("xla_fsdp: xla_fsdp_grad_ckpt rematerializes auto-wrapped units; set an "
                             "fsdp_auto_wrap_policy too")
        kwargs["auto_wrapper_callable"] = lambda m, *a, **kw: XlaFullyShardedDataParallel(
            checkpoint_module(m), *a, **kw)
    state_dict_type = str(raw.get("state_dict_type", "SHARDED_STATE_DICT")).upper()
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"xla_fsdp: fsdp_state_dict_type '{state_dict_type}' is not one of {STATE_DICT_TYPES}")
    no_effect = {k: v for k, v in raw.items() if k in NO_EFFECT}
    return FsdpSettings(kwargs, state_dict_type, no_effect, spmd)
