"""The one launcher core of the test helpers: runs a per-rank function on N ranks of either transport,
XLA:CPU devices (threads of one spawned process, :func:`on_xla`) or gloo processes (:func:`on_gloo`,
and :class:`GlooPool`, processes kept for a session). Every per-rank function is called the same way
on both, ``fn(rank, *args)``, where ``rank`` is a :class:`Rank`: its index, the world size, its
device, how to sync and how to wait for the other ranks. So there is one spawn loop, one XLA launch
and one teardown (harness, differential and fsdp2_programs run their programs through here)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import queue
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional
from unittest import mock

import torch

import xla_fsdp

#: how long an XLA:CPU rank thread waits at a barrier for the others: longer is a hang (a rank failed)
BARRIER_TIMEOUT_S = 600


def _no_sync() -> None:
    pass


@dataclasses.dataclass(frozen=True)
class Rank:
    """What a per-rank function is handed. ``sync``: ``xla_fsdp.sync`` on XLA, nothing on gloo;
    ``barrier``: ``dist.barrier`` on gloo, a barrier of the device threads on XLA (with a timeout);
    ``transport``: ``"xla"`` or ``"torch"``."""
    rank: int
    world_size: int
    device: torch.device
    sync: Callable[[], None]
    barrier: Callable[[], None]
    transport: str

    @classmethod
    def of_torch_group(cls, device: Optional[torch.device] = None, sync: Callable[[], None] = _no_sync) -> "Rank":
        """This process's rank in the initialized ``torch.distributed`` group (``device``: the CPU
        unless given)."""
        import torch.distributed as dist
        return cls(dist.get_rank(), dist.get_world_size(), device or torch.device("cpu"), sync, dist.barrier,
                   "torch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_process_group() -> None:
    """``destroy_process_group``, then collect what still holds a group (an FSDP2 mesh, a unit's
    sharding groups, a model in a reference cycle): gloo's worker threads stop only when the group
    object goes, and one that releases a finished collective's tensors while Python is exiting
    aborts the process ("terminate called without an active exception": the thread takes the GIL
    during finalization and is unwound through a noexcept destructor; pytorch/pytorch#190489). Call
    it after the model is out of scope, as the workers here do."""
    import gc

    import torch.distributed as dist
    dist.destroy_process_group()
    gc.collect()


@contextlib.contextmanager
def one_rank_group(store: Any) -> Iterator[None]:
    """A gloo group of one rank in this process for the block (a file store at ``store``), unless a
    group is initialized already (the caller's: left to it)."""
    import torch.distributed as dist
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        if own:
            end_process_group()


# ----------------------------------------------------------------------------- XLA:CPU devices
def run_multiprocess(fn: Callable[..., Any], *args: Any) -> Dict[int, Any]:
    """torch_xla's ``pjrt.run_multiprocess`` (results by rank) with what several XLA:CPU devices need
    (``xla_fsdp.enable_xla_cpu_devices``), installed for this call only, as ``xla_fsdp.launch`` does."""
    from torch_xla._internal import pjrt
    with xla_fsdp.patches.scope():
        xla_fsdp.enable_xla_cpu_devices()
        # the device process starts from the fork server, as the test's process would spawn it
        with mock.patch.object(pjrt, "_run_thread_per_device", AsCalledHere(pjrt._run_thread_per_device)):
            return pjrt.run_multiprocess(_recording_compile_time, fn, *args,
                                         start_method=process_context().get_start_method())


_STARTED = [time.monotonic()]  # when this process started its rank's work (AsCalledHere)
#: where each XLA device process the suite starts notes its compilation time (conftest sets it and
#: prints the sum at the end of the session: how much of the XLA cases' time is compiling)
COMPILE_LOG = "XLA_FSDP_COMPILE_LOG"
_COMPILE_LOG_LOCK = threading.Lock()


def _recording_compile_time(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    finally:
        _record_compile_time()


def _record_compile_time() -> None:
    """This process's XLA compilations so far (count, seconds), its CPU seconds and how long it has run, into
    ``$XLA_FSDP_COMPILE_LOG/<pid>.json``; every rank thread writes, the latest figures stay."""
    folder = os.environ.get(COMPILE_LOG)
    if not folder:
        return
    import json
    import resource

    import torch_xla.debug.metrics as met
    data = met.metric_data("CompileTime")  # (count, total nanoseconds, samples), or None
    usage = resource.getrusage(resource.RUSAGE_SELF)
    figures = {"compiles": data[0] if data else 0, "compile_s": data[1] / 1e9 if data else 0.0,
               "cpu_s": usage.ru_utime + usage.ru_stime, "wall_s": time.monotonic() - _STARTED[0]}
    path = os.path.join(folder, f"{os.getpid()}.json")
    with _COMPILE_LOG_LOCK:
        with open(path + ".tmp", "w") as f:
            json.dump(figures, f)
        os.replace(path + ".tmp", path)


@contextlib.contextmanager
def xla_cpu_devices(world_size: int) -> Iterator[None]:
    """``PJRT_DEVICE=CPU CPU_NUM_DEVICES=world_size`` for the processes spawned inside; the
    environment is left as found (later subprocesses must not inherit the device count)."""
    saved = {k: os.environ.get(k) for k in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(world_size))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_BARRIERS: Dict[int, threading.Barrier] = {}
_BARRIERS_LOCK = threading.Lock()


def _xla_rank(fn: Callable[..., Any], args: tuple) -> Any:
    import torch_xla
    import torch_xla.runtime as xr
    world_size = xr.world_size()
    with _BARRIERS_LOCK:  # the ranks are threads of this process
        barrier = _BARRIERS.setdefault(world_size, threading.Barrier(world_size))
    rank = Rank(xr.global_ordinal(), world_size, torch_xla.device(), xla_fsdp.sync,
                functools.partial(barrier.wait, BARRIER_TIMEOUT_S), "xla")
    return fn(rank, *args)


def on_xla(fn: Callable[..., Any], world_size: int, *args: Any) -> List[Any]:
    """``fn(rank, *args)`` on ``world_size`` XLA:CPU devices (threads of one spawned process); the
    results by rank."""
    with xla_cpu_devices(world_size):
        results = run_multiprocess(_xla_rank, fn, args)
    return [results[r] for r in range(world_size)]


# ----------------------------------------------------------------------------- gloo processes
def _join_torch_group(rank: int, world_size: int, port: int) -> Rank:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    return Rank.of_torch_group()


def _remove_torch_distributed_nn_temp_dir() -> None:
    """The temp folder torch.distributed.nn makes at import (torch 2.9; newer ones do not), which a
    process leaving by ``os._exit`` does not remove."""
    instantiator = sys.modules.get("torch.distributed.nn.jit.instantiator")
    temp_dir = getattr(instantiator, "_TEMP_DIR", None)
    if temp_dir is not None:
        temp_dir.cleanup()


def _exit_without_teardown() -> None:
    """Leaves the process without Python's teardown: FSDP2 hands gloo its own tensors, and gloo's
    thread may free them as Python exits, aborting the rank after its results are written
    (pytorch/pytorch#190489; xla_fsdp's collectives keep theirs until gloo lets go:
    collectives/torch_dist.py). ``os._exit`` skips the finalizer of the temp folder
    torch.distributed.nn makes at import, so it is removed here."""
    _remove_torch_distributed_nn_temp_dir()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _gloo_rank(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, out_dir: str,
               hard_exit: bool, errors_as_results: bool) -> None:
    me = _join_torch_group(rank, world_size, port)
    try:
        try:
            result = fn(me, *args)
        except Exception as e:  # noqa: BLE001 - the caller reads every rank's error
            if not errors_as_results:
                raise
            result = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:  # the rank's models gone first (see end_process_group)
        end_process_group()
    if hard_exit:
        _exit_without_teardown()


def on_gloo(fn: Callable[..., Any], world_size: int, *args: Any, hard_exit: bool = False,
            weights_only: bool = True, errors_as_results: bool = False) -> List[Any]:
    """``fn(rank, *args)`` on ``world_size`` gloo processes started from the fork server
    (:func:`process_context`); the results by rank (saved by each rank and read back here, with
    ``weights_only`` as the caller's results need). ``hard_exit``: each rank leaves with ``os._exit``
    after its group is destroyed (FSDP2's tensors, see :func:`_exit_without_teardown`).
    ``errors_as_results``: a rank that raises returns its error and traceback as a string (tests of
    what every rank raises) instead of failing the spawn."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(AsCalledHere(_gloo_rank),
                           args=(world_size, free_port(), fn, args, out_dir, hard_exit, errors_as_results),
                           nprocs=world_size, start_method=process_context().get_start_method())
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=weights_only)
                for r in range(world_size)]


# ----------------------------------------------------------------------------- the fork server
#: what every rank process needs, imported once per test process in the fork server instead of in
#: every rank (a spawned rank spent about 2 s of CPU importing torch and these again, torch_xla 2 s
#: more: most of a small test's time)
PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "xla_fsdp", "ranks", "training_program",
           "models", "harness"]
XLA_PRELOAD = ["torch_xla", "torch_xla.core.xla_model", "torch_xla.runtime", "torch_xla.debug.metrics",
               "torch_xla._internal.pjrt"]
_SERVER_DIR = "fork-server"


def process_context() -> Any:
    """The multiprocessing context rank processes start from: a fork server, a clean process that
    has imported :data:`PRELOAD` (and torch_xla where installed) and run nothing else, which forks
    each rank. Cheap as a fork, without a fork's hazards: the test's own process has run autograd and
    holds threads (a device process forked from it fails in autograd's device queues), the server
    never does. A rank starts as the test's process would have spawned it (:class:`AsCalledHere`)
    and leaves by ``os._exit`` (multiprocessing's way for forked processes: no ``atexit`` handlers)."""
    import importlib.util
    import multiprocessing.forkserver as forkserver
    context = torch.multiprocessing.get_context("forkserver")
    if forkserver._forkserver._forkserver_pid is None:  # not started yet: its temp files kept apart
        has_xla = importlib.util.find_spec("torch_xla") is not None
        context.set_forkserver_preload(PRELOAD + (XLA_PRELOAD if has_xla else []))
        saved = os.environ.get("TMPDIR")
        server_tmp = os.path.join(tempfile.gettempdir(), _SERVER_DIR)
        os.makedirs(server_tmp, exist_ok=True)
        os.environ["TMPDIR"] = server_tmp
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = saved
    return context


class AsCalledHere:
    """``target`` run in a rank process with this process's environment, working folder and temp
    folder at the time of the call, as a spawned process would have them (the fork server's are
    those of its own start); torch_xla's environment defaults are applied again, as its import does."""

    def __init__(self, target: Callable[..., Any]):
        self.target, self.env, self.cwd = target, dict(os.environ), os.getcwd()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _STARTED[0] = time.monotonic()
        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        tempfile.tempdir = None  # found again from TMPDIR
        torch_xla = sys.modules.get("torch_xla")
        if torch_xla is not None:
            torch_xla._setup_default_env()
            torch_xla._setup_xla_flags()
        return self.target(*args, **kwargs)


def start_process(target: Callable[..., Any], *args: Any) -> Any:
    """One spawned process running ``target(*args)``, started: for tests whose subject is a process's
    own life (a peer replaced mid-run, a process that joins groups one after another), which
    :func:`on_gloo`'s fixed set of ranks cannot express."""
    process = torch.multiprocessing.get_context("spawn").Process(target=target, args=args)
    process.start()
    return process


def _pool_rank(rank: int, world_size: int, port: int, fn: Callable[..., Any], inbox, outbox) -> None:
    me = _join_torch_group(rank, world_size, port)
    while True:
        item = inbox.get()
        if item is None:
            break
        try:
            outbox.put((rank, fn(me, item)))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the example
            outbox.put((rank, f"{type(e).__name__}: {e}"))
    end_process_group()  # the items' models and groups gone while Python runs


class GlooPool:
    """``world_size`` gloo processes kept for a whole test session, each calling ``fn(rank, item)``
    for every item it is sent; a rank that fails or hangs gets the whole group replaced."""

    TIMEOUT_S = 30  # an item (a differential program) takes about a second: longer is a hang

    def __init__(self, fn: Callable[..., Any], world_size: int):
        self.fn, self.world_size = fn, world_size
        self._procs: List[Any] = []

    def _start(self) -> None:
        ctx = torch.multiprocessing.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [ctx.Process(target=_pool_rank, daemon=True,
                                   args=(r, self.world_size, port, self.fn, self._inboxes[r], self._outbox))
                       for r in range(self.world_size)]
        for proc in self._procs:
            proc.start()

    def run(self, item: Any) -> List[Any]:
        if not self._procs:
            self._start()
        for inbox in self._inboxes:
            inbox.put(item)
        results: Dict[int, Any] = {}
        timeout = self.TIMEOUT_S
        while len(results) < self.world_size:
            try:
                rank, result = self._outbox.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise AssertionError(f"ranks {sorted(set(range(self.world_size)) - set(results))} did not finish "
                                     f"within {timeout} s ({item}); other ranks: {results}") from None
            results[rank] = result
            if isinstance(result, str):
                timeout = 10  # the others may be stuck in a collective with the failed rank
        errors = {r: v for r, v in results.items() if isinstance(v, str)}
        if errors:
            self.close()
            raise AssertionError(f"ranks failed: {errors} ({item})")
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        if not self._procs:
            return
        for inbox, proc in zip(self._inboxes, self._procs):
            if proc.is_alive():
                inbox.put(None)
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs = []
