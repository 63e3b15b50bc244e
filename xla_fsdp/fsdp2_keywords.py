"""``fully_shard``'s keywords on XLA (``fsdp2.py``): FSDP2's arguments read as a unit's keywords
(``reshard_after_forward`` as FSDP2 reads it, ``MixedPrecisionPolicy`` as compute and reduce dtypes,
``CPUOffloadPolicy`` as host offload), or an error naming what works instead."""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Dict, List, Union

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_list(modules: List[Any]) -> None:
    """A list of modules shards as one unit per module: each must be a module, none inside another,
    no parameter in two of them (one unit per parameter)."""
    owner: Dict[int, str] = {}
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"xla_fsdp.fully_shard takes a module or a list of modules, not {type(m).__name__} "
                            f"(item {i} of the list)")
        label = f"{type(m).__name__} (item {i})"
        for other in modules[:i]:
            if any(sub is other for sub in m.modules()) or any(sub is m for sub in other.modules()):
                raise ValueError(f"xla_fsdp.fully_shard: the list's modules {label} and "
                                 f"{type(other).__name__} contain one another; list disjoint modules")
        for name, p in m.named_parameters(remove_duplicate=False):
            if id(p) in owner and owner[id(p)] != label:
                raise NotImplementedError(
                    f"xla_fsdp.fully_shard on XLA shards each module of a list as its own unit, and {label} shares "
                    f"parameter '{name}' with {owner[id(p)]}: call fully_shard on their common parent instead")
            owner[id(p)] = label


def check_upstream_takes(keywords: Dict[str, Any], upstream: Callable[..., Any]) -> None:
    """The TypeError PyTorch's ``fully_shard`` raises for a keyword the installed PyTorch lacks."""
    known = inspect.signature(upstream).parameters
    for name in keywords:
        if name not in known:
            raise TypeError(f"fully_shard() got an unexpected keyword argument '{name}' (the installed PyTorch, "
                            f"{torch.__version__}, does not take it)")


def unit_options(module: nn.Module, mesh: Any, reshard_after_forward: Any, shard_placement_fn: Any,
                  mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy,
                  ignored_params: Any) -> Dict[str, Any]:
    """FSDP2's arguments as the unit's keywords, or an error naming what works instead."""
    _check_mesh(mesh)
    _check_ignored(module, ignored_params)
    if shard_placement_fn is not None:
        _check_placements(module, shard_placement_fn)
    post_forward_size = None
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        reshard_after_forward = _int_reshard(reshard_after_forward, _world_size(mesh))
        if not isinstance(reshard_after_forward, bool):
            post_forward_size, reshard_after_forward = reshard_after_forward, True
    # param_dtype None (FSDP2's default): each parameter computes in its own dtype, bf16 ones in bf16
    param_dtype = mp_policy.param_dtype
    reduce_dtype = mp_policy.reduce_dtype
    for name, dtype in (("param_dtype", param_dtype or torch.float32), ("reduce_dtype", reduce_dtype or torch.float32),
                        ("output_dtype", mp_policy.output_dtype or torch.float32)):
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"xla_fsdp.fully_shard: MixedPrecisionPolicy.{name} must be float32, bfloat16 or "
                             f"float16, got {dtype}")
    if reduce_dtype not in (None, param_dtype, torch.float32):
        raise NotImplementedError(
            f"xla_fsdp.fully_shard on XLA: reduce_dtype={reduce_dtype} with param_dtype={param_dtype} is not "
            "supported; reduce in param_dtype (reduce_dtype=None) or in float32")
    return dict(
        reshard_after_forward=None if reshard_after_forward is None else bool(reshard_after_forward),
        # FSDP2 keeps the root's parameters after forward only when reshard_after_forward is unset
        disable_reshard_on_root=reshard_after_forward is None,
        flatten_parameters=False, shard_param_on_dim_0=True,
        compute_dtype=param_dtype, fp32_reduce_scatter=reduce_dtype == torch.float32 != param_dtype,
        output_dtype=mp_policy.output_dtype,
        cpu_offload=offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else False,
        post_forward_size=post_forward_size,  # taken out again by fully_shard
    )


def _check_ignored(module: nn.Module, ignored_params: Any) -> None:
    """FSDP2's ``ignored_params`` are the module's parameters it leaves alone: not sharded, their
    gradients not reduced. fully_shard marks each so the unit does not take it (unit/construction.py)."""
    if not ignored_params:
        return
    own = {id(p) for p in module.parameters()}
    for p in ignored_params:
        if not isinstance(p, nn.Parameter) or id(p) not in own:
            raise ValueError("xla_fsdp.fully_shard: ignored_params must hold parameters of the module passed to "
                             f"fully_shard; got {type(p).__name__} of shape {tuple(getattr(p, 'shape', ()))}")


def _check_mesh(mesh: Any) -> None:
    if mesh is None:
        return
    if getattr(mesh, "ndim", 1) != 1:
        raise NotImplementedError(
            "xla_fsdp.fully_shard on XLA: a 2-D mesh (HSDP) is not supported; use "
            "XlaFullyShardedDataParallel(sharding_strategy='HYBRID_SHARD', hybrid_shard_size=N)")
    import torch_xla.runtime as xr
    if mesh.size() != xr.world_size():
        raise NotImplementedError(
            f"xla_fsdp.fully_shard on XLA: the mesh has {mesh.size()} devices, the job {xr.world_size()}; a 1-D "
            "mesh over every device (or mesh=None) is supported")


def _check_placements(module: nn.Module, fn: Callable[[nn.Parameter], Any]) -> None:
    from torch.distributed.tensor import Shard
    for name, param in module.named_parameters():
        placement = fn(param)
        if placement is not None and placement != Shard(0):
            raise NotImplementedError(
                f"xla_fsdp.fully_shard on XLA: shard_placement_fn gave {placement} for {name}; only Shard(0) "
                "(the default) is supported")


def check_reshard_value(value: Any) -> None:
    if isinstance(value, bool):
        return
    raise ValueError(
        f"xla_fsdp: set_reshard_after_forward takes True or False, as FSDP2's does, not {value!r}; an int (the "
        "size of the groups that keep the parameters' pieces from forward to backward) goes to "
        "fully_shard(module, reshard_after_forward=N)")


def _world_size(mesh: Any) -> int:
    if mesh is not None:
        return mesh.size()
    import torch_xla.runtime as xr
    return xr.world_size()


def _int_reshard(value: Any, world_size: int) -> Union[bool, int]:
    """FSDP2's int ``reshard_after_forward``, as FSDP2 reads it: the world size means True, 1 means
    False (with FSDP2's warning), and a factor in between is the size of the groups of consecutive
    ranks that keep the parameters' pieces from forward to backward (returned as the int)."""
    if not isinstance(value, int) or value < 1 or value > world_size or world_size % value:
        raise ValueError(f"xla_fsdp.fully_shard: reshard_after_forward as an int must be a factor of the world "
                         f"size {world_size}, not {value!r} (or pass True or False)")
    if value == world_size:
        return True
    if value == 1:
        warnings.warn("reshard_after_forward=1 (int) means resharding parameters to world size 1, instead of "
                      "reshard_after_forward=True (bool)", stacklevel=4)
        return False
    return value
