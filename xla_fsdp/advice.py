"""Checks that only warn (a model that looks untied, an optimizer whose steps differ on shards): they
advise, so none of them may stop a wrap or a step. :func:`only_warns` turns a check that fails into
one warning that names it and the error."""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def only_warns(check: F) -> F:
    """``check`` as a call that never raises: an exception inside it becomes a warning (the check's
    name, the error, what was skipped), and the caller goes on as if the check found nothing."""
    @functools.wraps(check)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return check(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - advice must never stop the program
            warnings.warn(f"xla_fsdp: the check {check.__name__} (it only warns) failed and was skipped: "
                          f"{type(error).__name__}: {error}. Nothing else changes; please report it.",
                          AdviceCheckFailed, stacklevel=2)
            return None
    return guarded  # type: ignore[return-value]


class AdviceCheckFailed(UserWarning):
    """A check that only warns raised; the wrap or step it ran in went on."""
