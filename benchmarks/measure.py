"""What each rank measures: bytes moved by collectives, persistent state bytes, peak RSS, compiles."""
from __future__ import annotations

import functools
import re
import resource
import threading
from typing import Dict

import torch

_COUNTS: Dict[int, int] = {}   # thread id -> bytes (XLA ranks are threads of one process)
_LOCK = threading.Lock()
_INSTALLED = False


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _add(n: int) -> None:
    with _LOCK:
        key = threading.get_ident()
        _COUNTS[key] = _COUNTS.get(key, 0) + n


def _counting(fn, size):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _add(size(*args, **kwargs))
        return fn(*args, **kwargs)
    return wrapper


def _group_size(groups, default: int) -> int:
    return len(groups[0]) if groups else default


def install_collective_counters() -> None:
    """Count the full-size bytes of every collective issued through torch.distributed or
    torch_xla's xla_model (all-gather: the gathered output; reduce-scatter: the input; all-reduce:
    the tensor). DDP's C++ reducer and SPMD's compiler-inserted collectives are not visible here."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    import torch.distributed as dist
    dist.all_gather_into_tensor = _counting(dist.all_gather_into_tensor, lambda out, inp, *a, **k: _nbytes(out))
    dist.reduce_scatter_tensor = _counting(dist.reduce_scatter_tensor, lambda out, inp, *a, **k: _nbytes(inp))
    dist.all_reduce = _counting(dist.all_reduce, lambda t, *a, **k: _nbytes(t))
    try:
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr
    except ImportError:
        return
    xm.all_gather = _counting(xm.all_gather, lambda value, dim=0, groups=None, *a, **k:
                              _nbytes(value) * _group_size(groups, xr.world_size()))
    xm.reduce_scatter = _counting(xm.reduce_scatter, lambda op, inp, *a, **k: _nbytes(inp))
    xm.all_reduce = _counting(xm.all_reduce, lambda op, inputs, *a, **k: _nbytes(inputs))


def collective_bytes() -> int:
    return _COUNTS.get(threading.get_ident(), 0)


def reset_collective_bytes() -> None:
    with _LOCK:
        _COUNTS[threading.get_ident()] = 0


def _tiles(t: torch.Tensor) -> int:
    """SPMD: how many devices a tensor's tiles are spread over (1 when replicated or not SPMD)."""
    if t.device.type != "xla":
        return 1
    try:
        import torch_xla
        spec = torch_xla._XLAC._get_xla_sharding_spec(t)
    except Exception:
        return 1
    m = re.search(r"devices=\[([\d,]+)\]", spec or "")
    if not m or "replicated" in spec:
        return 1
    dims = [int(x) for x in m.group(1).split(",")]
    if "last_tile_dim_replicate" in spec:
        dims = dims[:-1]
    n = 1
    for d in dims:
        n *= d
    return n


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Params + grads + optimizer state this rank holds (eager storages counted once; SPMD tensors
    divided by their tile count)."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        if t.device.type == "xla":
            total += t.numel() * t.element_size() // _tiles(t)
            return
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        add(local)
        if p.grad is not None:
            add(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
    for st in opt.state.values():
        for v in st.values():
            add(v.to_local() if hasattr(v, "to_local") else v)
    return total


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def xla_compiles() -> int:
    try:
        import torch_xla.debug.metrics as met
    except ImportError:
        return 0
    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0
