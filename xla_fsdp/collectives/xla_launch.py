"""Rank threads that fail or are interrupted stop together (several XLA:CPU devices are threads of one process).

``torch_xla.launch`` reports a rank's error only once every rank thread has returned, so one rank
that raised (a missing file, a bad batch) left the others waiting in a host exchange for 10
minutes, or in a device rendezvous until XLA aborted the process and the error was never shown.
Here the failing rank prints its traceback at once and wakes its peers, which raise an error
naming it (:func:`.host_exchange.report_rank_failure`).

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
from typing import Any, Callable, Dict

from .._exit_cleanup import remove_unfinished_writes
from .host_exchange import report_rank_failure

_ORIGINALS: Dict[str, Callable[..., Any]] = {}


def install_failure_reporting() -> None:
    """Wrap the per-rank call of ``torch_xla.launch``/``xmp.spawn``; idempotent."""
    from torch_xla._internal import pjrt

    original = pjrt._SpawnFn.__call__
    if getattr(original, "_xla_fsdp_reports_failures", False):
        return

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except BaseException as error:
            import torch_xla.runtime as xr

            from .xla_user import is_threaded_cpu
            if is_threaded_cpu():
                rank = xr.global_ordinal()
                detail = (f"{type(error).__name__}: {error}\n" if getattr(error, "user_facing", False)
                          else traceback.format_exc())
                sys.stderr.write(f"xla_fsdp: rank {rank} failed; stopping the other ranks:\n{detail}")
                sys.stderr.flush()
                report_rank_failure(rank, error)
            raise

    call._xla_fsdp_reports_failures = True
    pjrt._SpawnFn.__call__ = call


def install_interrupt_handling() -> None:
    """Ctrl-C stops XLA:CPU training at once (see the module docstring); idempotent."""
    from torch_xla._internal import pjrt

    if "run_thread_per_device" in _ORIGINALS:
        return
    _ORIGINALS["run_thread_per_device"] = pjrt._run_thread_per_device
    _ORIGINALS["run_multiprocess"] = pjrt.run_multiprocess
    pjrt._run_thread_per_device = run_thread_per_device_stoppable
    pjrt.run_multiprocess = functools.wraps(pjrt.run_multiprocess)(_run_multiprocess_forwarding)


def run_thread_per_device_stoppable(local_rank, local_world_size, fn, initializer_fn):
    """torch_xla's device-process body (it starts the rank threads), where SIGINT ends the process."""
    from torch_xla._internal import pjrt

    original = _ORIGINALS.get("run_thread_per_device", pjrt._run_thread_per_device)
    if threading.current_thread() is not threading.main_thread():
        return original(local_rank, local_world_size, fn, initializer_fn)
    previous = signal.signal(signal.SIGINT, _stop_now)
    try:
        return original(local_rank, local_world_size, fn, initializer_fn)
    finally:
        signal.signal(signal.SIGINT, previous)


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


def _stop_now(signum, frame) -> None:
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
    if threading.current_thread() is not threading.main_thread():
        return _ORIGINALS["run_multiprocess"](*args, **kwargs)
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
        return _ORIGINALS["run_multiprocess"](*args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, previous)
