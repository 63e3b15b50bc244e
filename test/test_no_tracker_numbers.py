"""No numbers of an internal tracker in the project's text: a reader of the docs, the code or the tests
cannot look up an issue, a stop or a review round by its number, so each place says what holds and why
instead. The scan covers README.md, CONTRIBUTING.md, docs/*.md and every .py file of the package, the
tests, the examples, the tools and the benchmarks; only the narrow forms in ALLOWED pass."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY_FOLDERS = ["xla_fsdp", "test", "examples", "tools", "benchmarks"]

# A tracker word followed by a number ("<word> 12", "<word>s 12", "<word> #12", "<word>-12"). Built
# from pieces so that this file's own source never reads as a hit.
ISSUE, STOP, ROUND = "iss" + "ue", "st" + "op", "ro" + "und"
TRACKER_NUMBER = re.compile(rf"\b(?:{ISSUE}|{STOP}|{ROUND})s?[\s-]#?\d+", re.IGNORECASE)

# (file, regex): a hit inside a match of the regex, in that file ("*": any), is allowed.
ALLOWED = [
    # an upstream project's issue ("pytorch/xla <word> #9094"): a reader can look that up
    ("*", re.compile(rf"\bpytorch/[\w.-]+ {ISSUE}s? #?\d+", re.IGNORECASE)),
    # the benchmark CLIs' flag for the number of measurement repetitions ("--<word>s 3")
    ("*", re.compile(rf"--{ROUND}s[ =]\d+")),
    # one repetition of a measurement in the benchmark write-up ("<word> 1's steps 4 and 8 took ...")
    ("docs/benchmarks.md", re.compile(rf"\b{ROUND} \d+'s steps\b")),
]


def files_to_scan():
    paths = [os.path.join(ROOT, p) for p in ("README.md", "CONTRIBUTING.md")]
    paths += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    for top in PY_FOLDERS:
        for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            paths += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    return [p for p in paths if os.path.isfile(p)]


def _allowed(rel, line, hit):
    for pattern, regex in ALLOWED:
        if pattern == "*" or rel == pattern:
            if any(m.start() <= hit.start() and hit.end() <= m.end() for m in regex.finditer(line)):
                return True
    return False


def tracker_numbers(paths):
    """'file:line: text' of every hit that ALLOWED does not allow."""
    found = []
    for path in paths:
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if any(not _allowed(rel, line, hit) for hit in TRACKER_NUMBER.finditer(line)):
                    found.append(f"{rel}:{number}: {line.strip()[:160]}")
    return found


@pytest.mark.fast
def test_no_tracker_numbers_in_docs_code_or_tests():
    # the pattern finds the forms the tracker's numbers took, and lets the allowed ones pass
    for text in (f"{ISSUE.title()} 53 item 2.", f"({ISSUE} 42)", f"{ISSUE} 53's bound", f"{ISSUE}s 28 and 42",
                 f"at {STOP} 49 we", f"{STOP}-49", f"{ROUND} 3 of the review", f"{ISSUE} #7"):
        assert [h for h in TRACKER_NUMBER.finditer(text) if not _allowed("x.py", text, h)], text
    for text in (f"pytorch/xla {ISSUE} #9094", f"--{ROUND}s 3", "over 3 rounds", "pytorch/xla#5280"):
        assert not [h for h in TRACKER_NUMBER.finditer(text) if not _allowed("x.py", text, h)], text
    paths = files_to_scan()
    # the scan finds what it should scan (a moved folder would leave it checking nothing)
    rels = {os.path.relpath(p, ROOT).replace(os.sep, "/") for p in paths}
    assert {"README.md", "xla_fsdp/__init__.py", "test/conftest.py", "test/test_no_tracker_numbers.py"} <= rels
    found = tracker_numbers(paths)
    assert not found, ("tracker numbers a reader cannot look up; say what holds and why instead:\n"
                       + "\n".join(found))
