"""The argument parser of every command and example: options are spelled with underscores
(``--ckpt_prefix``, as torch_xla's tools spell them), and the dashed spelling users also type
(``--ckpt-prefix``) means the same option instead of a "missing --ckpt_prefix" error."""
from __future__ import annotations

import argparse
from typing import Any, List, Optional, Sequence, Tuple


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` where ``--some-option`` is read as ``--some_option`` when only the
    underscore spelling is defined (values and everything after ``--`` are left as they are)."""

    def parse_known_args(self, args: Optional[Sequence[str]] = None,
                         namespace: Optional[argparse.Namespace] = None) -> Tuple[argparse.Namespace, List[str]]:
        import sys
        given = list(sys.argv[1:] if args is None else args)
        known = set(self._option_string_actions)
        spelled: List[Any] = []
        for i, arg in enumerate(given):
            if arg == "--":
                spelled.extend(given[i:])
                break
            spelled.append(_underscored(arg, known))
        return super().parse_known_args(spelled, namespace)


def _underscored(arg: Any, known: set) -> Any:
    if not isinstance(arg, str) or not arg.startswith("--") or "-" not in arg[2:].split("=", 1)[0]:
        return arg
    name, eq, value = arg.partition("=")
    alternative = "--" + name[2:].replace("-", "_")
    return alternative + eq + value if name not in known and alternative in known else arg
