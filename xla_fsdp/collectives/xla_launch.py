"""Starting ranks on several XLA:CPU devices (threads of one process): what torch_xla alone lacks
there, installed by :func:`launch` / :func:`enable_xla_cpu_devices` and nowhere else.

Rank threads that fail or are interrupted stop together. ``torch_xla.launch`` reports a rank's error
only once every rank thread has returned, so one rank that raised (a missing file, a bad batch) left
the others waiting in a host exchange for 10 minutes, or in a device rendezvous until XLA aborted the
process and the error was never shown. Here the failing rank prints its traceback at once and wakes
its peers, which raise an error naming it (:func:`.host_exchange.report_rank_failure`).

Ctrl-C did not stop the rank threads either (training ran to its end, minutes later, then printed
a traceback): in the device process it now removes unfinished checkpoint writes and exits 130 at
once; the launching process passes the signal on to its device processes.
"""
from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import sys
import threading
import traceback
from typing import Any, Callable, Tuple

from .. import patches
from .._exit_cleanup import remove_unfinished_writes
from .host_exchange import report_rank_failure
from .thread_safety import count_host_fallbacks_first

ENV_DEFAULTS_CPU = {
    # Executions blocked in a rendezvous occupy pool threads: size the pools above the device count
    # so the other ranks' executions can still start (the default is the number of cores).
    "XLA_THREAD_POOL_SIZE": "32",
    # The async client runs executions on a worker pool sized by the cores; with more devices than
    # cores a waiting rank starves the others. The synchronous client uses torch_xla's own pool.
    "PJRT_CPU_ASYNC_CLIENT": "false",
}
WHY = "several XLA:CPU devices as threads of one process (xla_fsdp.enable_xla_cpu_devices)"


def enable_xla_cpu_devices() -> bool:
    """Make several XLA:CPU devices work as the ranks of one process: in this process and in the device
    processes ``torch_xla.launch`` / ``xmp.spawn`` / ``pjrt.run_multiprocess`` start from it.

    Call it before the XLA runtime starts (before ``torch_xla.launch``); :func:`launch` calls it for
    you. Does nothing (returns False) unless ``PJRT_DEVICE=CPU`` (or unset, with ``CPU_NUM_DEVICES``):
    TPUs need none of it. What it
    changes (see :mod:`xla_fsdp.patches`, which undoes it): XLA:CPU pool settings where unset,
    ``torch_xla.sync``/``xm.mark_step`` (a sync that does not deadlock rank threads),
    ``xm.all_gather``/``reduce_scatter``/``all_reduce``/``rendezvous`` (host exchanges between rank
    threads), ``torch.distributed``'s ``init_process_group``/``get_rank``/``destroy_process_group``
    (one ``xla`` group the threads share), ``torch.serialization.safe_globals`` (safe across threads),
    and the start of the device processes (failures and Ctrl-C stop every rank)."""
    # torch_xla itself defaults to CPU when PJRT_DEVICE is unset; CPU_NUM_DEVICES then asks for several
    device = os.environ.get("PJRT_DEVICE") or ("CPU" if os.environ.get("CPU_NUM_DEVICES") else "")
    if device.upper() != "CPU":
        return False
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    from .thread_safety import install_shared_safe_globals
    from .xla import install_safe_sync
    from .xla_process_group import install_shared_xla_group
    from .xla_user import install_user_collectives
    from torch_xla._internal import pjrt

    for key, value in ENV_DEFAULTS_CPU.items():
        patches.set_env_default(key, value, "XLA:CPU pools sized for rank threads that wait in collectives")
    install_safe_sync()
    if install_user_collectives():
        install_shared_xla_group()
    install_shared_safe_globals()
    patches.replace(pjrt, "_run_thread_per_device", run_thread_per_device_stoppable,
                    "device processes enable XLA:CPU rank threads; a failed or interrupted rank stops them all")
    patches.replace(pjrt, "run_multiprocess", functools.wraps(pjrt.run_multiprocess)(_run_multiprocess_forwarding),
                    "Ctrl-C in the launching process reaches its device processes")
    return True


def launch(fn: Callable[..., Any], args: Tuple = (), start_method: str = "spawn",
           debug_single_process: bool = False) -> None:
    """``torch_xla.launch`` for xla_fsdp programs: on XLA:CPU the ranks get what several devices in
    one process need (:func:`enable_xla_cpu_devices`), for this launch only; on TPU it is
    ``torch_xla.launch``."""
    import torch_xla
    with patches.scope():
        enable_xla_cpu_devices()
        torch_xla.launch(fn, args, start_method=start_method, debug_single_process=debug_single_process)


_RANK_THREAD = threading.local()


def in_rank_thread() -> bool:
    """Whether this thread runs a rank of a device process started by :func:`launch` (or by
    ``torch_xla.launch`` once :func:`enable_xla_cpu_devices` ran)."""
    return getattr(_RANK_THREAD, "running", False)


def _reporting_failures(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` (one rank thread's body), printing a failure at once and releasing the rank's peers."""
    def run() -> Any:
        _RANK_THREAD.running = True
        try:
            return fn()
        except BaseException as error:
            import torch_xla.runtime as xr

            from .xla_user import is_threaded_cpu
            if is_threaded_cpu():
                rank = xr.global_ordinal()
                if not isinstance(error, SystemExit):  # the program's own exit: its message is printed once,
                    # by the launching process, as Python prints it (no traceback per rank)
                    detail = (f"{type(error).__name__}: {error}\n" if getattr(error, "user_facing", False)
                              else traceback.format_exc())
                    sys.stderr.write(f"xla_fsdp: rank {rank} failed; stopping the other ranks:\n{detail}")
                    sys.stderr.flush()
                report_rank_failure(rank, error)
            raise

    return run


def run_thread_per_device_stoppable(local_rank, local_world_size, fn, initializer_fn):
    """torch_xla's device-process body (it starts the rank threads), where SIGINT ends the process."""
    from torch_xla._internal import pjrt

    enable_xla_cpu_devices()  # a device process started afresh: the parent's changes are not in it
    original = patches.original(pjrt, "_run_thread_per_device")
    fn = _reporting_failures(count_host_fallbacks_first(fn))
    if threading.current_thread() is not threading.main_thread():
        return original(local_rank, local_world_size, fn, initializer_fn)
    previous = signal.signal(signal.SIGINT, _stop_now)
    try:
        return original(local_rank, local_world_size, fn, initializer_fn)
    finally:
        _restore_sigint(previous)


def _restore_sigint(previous) -> None:
    """Put back the SIGINT handler. A Ctrl-C that arrives while it is being put back makes CPython's
    ``signal.signal`` raise ``OSError: Signal 2 ignored due to race condition`` (a traceback where the
    program's one line belongs): the handler is put back anyway, and the Ctrl-C is what it was."""
    try:
        signal.signal(signal.SIGINT, previous)
    except OSError:
        signal.signal(signal.SIGINT, previous)
        raise KeyboardInterrupt from None


def _release_semaphores() -> None:
    """Unlink this process's named semaphores as a normal exit would (tqdm's write lock is one):
    ``os._exit`` skips multiprocessing's finalizers, and the resource tracker then warns of "leaked
    semaphore objects" after every Ctrl-C."""
    try:
        from multiprocessing import util
        from multiprocessing.synchronize import SemLock
        for finalizer in list(util._finalizer_registry.values()):
            if getattr(finalizer, "_callback", None) is SemLock._cleanup:
                finalizer()
    except Exception:  # private names of multiprocessing: nothing here may stop the exit
        pass


_STOPPING = threading.Event()


def _stop_now(signum, frame) -> None:
    # Under a terminal's Ctrl-C this process gets SIGINT twice (its process group's, and the one the
    # launching process passes on). A second handler run inside the first (Python runs handlers
    # between any two bytecodes) exited between a semaphore's unlink and its unregistering, and the
    # resource tracker then warned of a leaked semaphore.
    if _STOPPING.is_set():
        return
    _STOPPING.set()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _release_semaphores()
    removed = remove_unfinished_writes()
    # a save's files take their names only once every rank has written its own: what was in
    # progress is removed, and every checkpoint on disk is whole, as it was before the save
    note = (f"; a checkpoint save was in progress: its {len(removed)} unfinished file(s) removed, the "
            "checkpoint at its prefix is as it was before the save") if removed else ""
    os.write(2, f"\nxla_fsdp: interrupted: stopped every rank{note}\n".encode())
    os._exit(130)


def _run_multiprocess_forwarding(*args, **kwargs):
    """The launching process: pass SIGINT on to the device processes (which may not share its
    process group), then let it interrupt this one as usual."""
    from torch_xla._internal import pjrt
    original = patches.original(pjrt, "run_multiprocess")
    if threading.current_thread() is not threading.main_thread():
        return original(*args, **kwargs)
    previous = signal.getsignal(signal.SIGINT)

    def forward(signum, frame):
        for child in multiprocessing.active_children():
            try:
                os.kill(child.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        if callable(previous):
            previous(signum, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, forward)
    try:
        return original(*args, **kwargs)
    finally:
        _restore_sigint(previous)
