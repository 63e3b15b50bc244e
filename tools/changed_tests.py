"""The test files a change touches, for ``make test-changed``: the fast loop for a change in progress
that runs what the change can break, not the whole suite.

A test file counts when it changed itself, when it imports a changed test helper (``test/harness.py``
and the like, followed through the helpers that import it), or when it names a changed package
module (``xla_fsdp.unit.freeing``, ``from xla_fsdp.unit import freeing``, ``unit/freeing.py``) or a
function or class it defines (``resume_training`` for ``checkpoints/resume.py``). A
change to a module no test names (most of ``xla_fsdp/unit/``: every training test reaches it through
the wrapper) selects the files that train, the equivalence and differential suites, as does any
change on the step's path (outside ``checkpoints/``, ``cli/``, ``compat/``, ``integrations/``, ``spmd/``). The change is
what ``git`` sees against ``--base`` (default ``HEAD``: uncommitted and untracked files).

    python tools/changed_tests.py [--base REV]      prints the files, one per line
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST = os.path.join(ROOT, "test")
#: what runs every unit end to end: the selection for a package change no test file names
TRAINING = ["test_equivalence.py", "test_differential.py"]


def changed_files(base: str) -> List[str]:
    def git(*args: str) -> List[str]:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [line for line in out.splitlines() if line]
    return sorted(set(git("diff", "--name-only", base)) | set(git("ls-files", "--others", "--exclude-standard")))


def _imports(path: str) -> Set[str]:
    """Top-level module names a file imports (any depth in the file)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _public_names(path: str) -> Set[str]:
    """The functions and classes a package module defines for others (named without a leading
    underscore, and long enough not to match everywhere)."""
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
            and not node.name.startswith("_") and len(node.name) >= 8}


def tests_for(changed: List[str]) -> List[str]:
    files = sorted(f for f in os.listdir(TEST) if f.endswith(".py"))
    imports: Dict[str, Set[str]] = {f: _imports(os.path.join(TEST, f)) for f in files}
    helpers = {f[:-3] for f in files if not f.startswith("test_") and f != "conftest.py"}
    touched_helpers = {os.path.basename(c)[:-3] for c in changed if c.startswith("test/")} & helpers
    while True:  # helpers that import a touched helper are touched too
        more = {h for h in helpers - touched_helpers if imports[h + ".py"] & touched_helpers}
        if not more:
            break
        touched_helpers |= more
    selected = {os.path.basename(c) for c in changed if c.startswith("test/test_") and c.endswith(".py")}
    selected |= {f for f in files if f.startswith("test_") and imports[f] & touched_helpers}
    if "test/conftest.py" in changed:
        selected |= {f for f in files if f.startswith("test_")}
    texts = {f: open(os.path.join(TEST, f)).read() for f in files if f.startswith("test_")}
    for path in changed:
        if not (path.startswith("xla_fsdp/") and path.endswith(".py")):
            continue
        module = path[:-3].replace("/", ".").removesuffix(".__init__")
        parent, _, leaf = module.rpartition(".")
        patterns = [re.escape(module) + r"\b", re.escape(path[len("xla_fsdp/"):]),
                    rf"from {re.escape(parent)} import [^\n]*\b{re.escape(leaf)}\b"]
        patterns += [rf"\b{name}\b" for name in _public_names(os.path.join(ROOT, path))]
        hits = {f for f, text in texts.items() if any(re.search(p, text) for p in patterns)}
        step_path = not path.startswith(("xla_fsdp/checkpoints/", "xla_fsdp/cli/", "xla_fsdp/compat/",
                                          "xla_fsdp/integrations/", "xla_fsdp/spmd/"))
        selected |= hits | (set(TRAINING) if step_path or not hits else set())
    return sorted(f"test/{f}" for f in selected if os.path.exists(os.path.join(TEST, f)))


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the revision the change is measured against (default HEAD)")
    args = parser.parse_args(argv)
    for path in tests_for(changed_files(args.base)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
