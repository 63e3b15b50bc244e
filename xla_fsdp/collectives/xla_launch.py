"""A rank thread that fails tells its peers (several XLA:CPU devices are threads of one process).

``torch_xla.launch`` reports a rank's error only once every rank thread has returned, so one rank
that raised (a missing file, a bad batch) left the others waiting in a host exchange for 10
minutes, or in a device rendezvous until XLA aborted the process and the error was never shown.
Here the failing rank prints its traceback at once and wakes its peers, which raise an error
naming it (:func:`.host_exchange.report_rank_failure`).
"""
from __future__ import annotations

import functools
import sys
import traceback

from .host_exchange import report_rank_failure


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
                sys.stderr.write(f"xla_fsdp: rank {rank} failed; stopping the other ranks:\n{traceback.format_exc()}")
                sys.stderr.flush()
                report_rank_failure(rank, error)
            raise

    call._xla_fsdp_reports_failures = True
    pjrt._SpawnFn.__call__ = call
