"""What each rank measures: bytes moved by collectives, persistent state bytes, peak RSS, compiles."""
from __future__ import annotations

import functools
import re
import resource
import threading
import time
from typing import Dict, List

import torch

_COUNTS: Dict[str, int] = {}   # rank key -> bytes
_GATHERS: Dict[str, int] = {}  # rank key -> all-gather calls
_LOCK = threading.Lock()
_INSTALLED = False


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _rank_key(tensor=None) -> str:
    """XLA ranks are threads, and XLA backward runs on autograd's device threads: key XLA counts by
    the tensor's device (one per rank); eager ranks are processes."""
    if isinstance(tensor, (list, tuple)) and tensor:
        tensor = tensor[0]
    if isinstance(tensor, torch.Tensor) and tensor.device.type == "xla":
        return str(tensor.device)
    return "process"


_NESTED = threading.local()  # per thread: inside a counted XLA call (its inner collectives are part of it)


def _counting(fn, names, size, gather: bool = False, outermost: bool = False):
    """Wrap ``fn`` so every call adds ``size(**bound)`` bytes (and, for an all-gather, one call);
    ``names`` are its leading parameters. ``outermost``: not counted when made inside another
    ``outermost`` call of this thread (xm's pinned all-gather and the all-reduce it is made of)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if outermost and getattr(_NESTED, "inside", False):
            return fn(*args, **kwargs)
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        n, key = size(bound)
        with _LOCK:
            _COUNTS[key] = _COUNTS.get(key, 0) + n
            if gather:
                _GATHERS[key] = _GATHERS.get(key, 0) + 1
        if not outermost:
            return fn(*args, **kwargs)
        _NESTED.inside = True
        try:
            return fn(*args, **kwargs)
        finally:
            _NESTED.inside = False
    return wrapper


def install_collective_counters() -> None:
    """Count the full-size bytes of every collective issued through torch.distributed or traced
    through torch_xla's collective bindings (all-gather: the gathered output; reduce-scatter: the
    input; all-reduce: the tensor). DDP's C++ reducer and SPMD's compiler-inserted collectives are
    not visible here.

    On XLA the count is taken at ``torch_xla._XLAC`` (what ``xm.all_gather`` & co. call, once per
    call, and what xla_fsdp calls directly), so torch_xla's FSDP and xla_fsdp are counted at the
    same level. Also counted: xm's pinned all-gather, which it builds from an all-reduce (one
    all-gather, its inner all-reduce not counted again). Not visible: an ``xm.all_reduce`` of one
    tensor over every device with a pinned layout and scale 1 (torch_xla lowers it through
    ``torch.ops._c10d_functional``), and user collectives xla_fsdp runs as host exchanges on XLA:CPU
    rank threads (no device collective)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED = True
    import torch.distributed as dist
    dist.all_gather_into_tensor = _counting(dist.all_gather_into_tensor, ("output_tensor", "input_tensor"),
                                            lambda b: (_nbytes(b.get("output_tensor")), "process"), gather=True)
    dist.reduce_scatter_tensor = _counting(dist.reduce_scatter_tensor, ("output", "input"),
                                           lambda b: (_nbytes(b.get("input")), "process"))
    # FSDP1 gathers CPU tensors with the list form (c10d has no gloo all_gather_into_tensor path there).
    dist.all_gather = _counting(dist.all_gather, ("tensor_list", "tensor"),
                                lambda b: (_nbytes(b.get("tensor_list")), "process"), gather=True)
    dist.all_reduce = _counting(dist.all_reduce, ("tensor",), lambda b: (_nbytes(b.get("tensor")), "process"))
    try:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr
    except ImportError:
        return

    def gathered(b):  # the bindings take the shard count as xm computes it: the group size
        return _nbytes(b.get("value")) * int(b["shard_count"]), _rank_key(b.get("value"))

    def reduced(b):
        return _nbytes(b.get("input")), _rank_key(b.get("input"))

    xlac = torch_xla._XLAC
    # the leading positional parameters of each binding (torch_xla 2.9; they take no keywords)
    for name, names, size, gather in (
            ("_xla_all_gather", ("value", "dim", "shard_count"), gathered, True),
            ("_xla_all_gather_out", ("output", "value", "token", "dim", "shard_count"), gathered, True),
            ("_xla_all_gather_coalesced", ("value", "token", "dim", "shard_count"), gathered, True),
            ("_xla_all_gather_coalesced_out", ("output", "value", "token", "dim", "shard_count"), gathered, True),
            ("_xla_reduce_scatter", ("reduce_type", "input"), reduced, False),
            ("_xla_reduce_scatter_out", ("reduce_type", "output", "input"), reduced, False),
            ("_xla_reduce_scatter_coalesced", ("reduce_type", "input"), reduced, False),
            ("_xla_reduce_scatter_coalesced_out", ("reduce_type", "output", "input"), reduced, False),
            ("_xla_all_reduce", ("reduce_type", "input"), reduced, False),
            ("_xla_all_reduce_inplace", ("reduce_type", "input"), reduced, False)):
        if hasattr(xlac, name):
            setattr(xlac, name, _counting(getattr(xlac, name), names, size, gather=gather, outermost=True))

    def pinned(b):  # xm's pinned all-gather: an all-reduce of the input padded to the group's size
        groups = b.get("groups")
        size = len(groups[0]) if groups else xr.world_size()
        return _nbytes(b.get("value")) * size, _rank_key(b.get("value"))
    if hasattr(xm, "_all_gather_using_all_reduce"):
        xm._all_gather_using_all_reduce = _counting(xm._all_gather_using_all_reduce, ("value", "dim", "groups"),
                                                    pinned, gather=True, outermost=True)


def collective_bytes(device=None) -> int:
    return _COUNTS.get(_rank_key(torch.empty(0, device=device) if device is not None else None), 0)


def all_gather_calls(device=None) -> int:
    """All-gathers issued since the last reset (on XLA: traced into the step, one per gathered tensor
    or coalesced group)."""
    return _GATHERS.get(_rank_key(torch.empty(0, device=device) if device is not None else None), 0)


def reset_collective_bytes(device=None) -> None:
    key = _rank_key(torch.empty(0, device=device) if device is not None else None)
    with _LOCK:
        _COUNTS[key] = _GATHERS[key] = 0


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


def xla_compile_seconds() -> List[float]:
    """Seconds of each XLA compilation so far in this process (torch_xla's CompileTime samples; the
    metric keeps its last 1024)."""
    try:
        import torch_xla.debug.metrics as met
    except ImportError:
        return []
    data = met.metric_data("CompileTime")
    return [v / 1e9 for _, v in data[2]] if data else []


def xla_ops_traced() -> int:
    """ATen ops dispatched to XLA so far in this process (every rank thread's; torch_xla counts each
    as ``xla::<op>``): the tracing work of a step counted, free of the machine's timing noise."""
    try:
        import torch_xla.debug.metrics as met
    except ImportError:
        return 0
    return sum(met.counter_value(name) or 0 for name in met.counter_names() if name.startswith("xla::"))


def xla_transfers_to_host() -> int:
    """Device-to-host copies so far in this process (every rank thread's): a collective run as a host
    exchange makes one per rank, one in the compiled step makes none."""
    try:
        import torch_xla.debug.metrics as met
    except ImportError:
        return 0
    data = met.metric_data("TransferFromDeviceTime")
    return int(data[0]) if data else 0


class BackwardThreadTime:
    """The CPU time of the thread autograd runs a backward in, when that is not the calling thread.

    On XLA (TPU or XLA:CPU) autograd runs backward in its own thread for the device, so the tracing
    of backward (the gradient hooks, the reduce-scatters) is not in the calling thread's CPU time,
    yet the step waits for it. Measured from the first node of ``loss``'s graph to the last final
    callback queued before backward ended (the package's own end-of-backward work included).
    ``seconds`` is 0.0 when backward ran in the calling thread (already in its time, eager ranks),
    None when the end ran in another thread than the start (not measurable)."""

    def __init__(self, loss: torch.Tensor):
        self.seconds: "float | None" = 0.0
        self._caller = threading.get_ident()
        if loss.grad_fn is not None:
            loss.grad_fn.register_prehook(self._begin)

    def _begin(self, grad_outputs):
        me = threading.get_ident()
        if me == self._caller:
            return None
        start = time.thread_time()
        engine = torch.autograd.Variable._execution_engine

        def end() -> None:
            self.seconds = time.thread_time() - start if threading.get_ident() == me else None

        # queued from a final callback: after every callback queued during backward
        engine.queue_callback(lambda: engine.queue_callback(end))
        return None
