"""The docs are tested like code: every Python or shell block in README.md,
CONTRIBUTING.md and docs/ is either marked ``<!-- run: RUNNER -->`` (on the line before it, or the
line after) and run as written (a page's blocks in order, in one temporary folder, so a later block
reads what an earlier one wrote), or marked ``<!-- not run: why -->``. Runners: ``python``, ``bash``
(``python`` is this interpreter), ``torchrun N`` (N gloo processes), ``xla N`` (N XLA:CPU devices);
``RUNNER in xla-env`` / ``RUNNER in newest-env`` run with the interpreter of that environment first
on PATH (a page moving a run between them: such a page runs in the newest environment's suite).
Relative links must point at files that exist."""
import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import ENVIRONMENTS, HAS_TORCH_XLA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "CONTRIBUTING.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md"))
MARK = re.compile(r"^<!--\s*(run|not run):\s*(.*?)\s*-->$")
CODE_LANGUAGES = {"python", "bash", "sh", "shell", "console"}


def blocks(page):
    """(language, marker, argument, code, line number) of every fenced block of a page."""
    lines = open(os.path.join(ROOT, page)).read().splitlines()
    found, i, marker = [], 0, (None, "")
    while i < len(lines):
        line = lines[i]
        if line.startswith("```") and len(line) > 3:
            start, lang = i + 1, line[3:].strip().split()[0]
            i += 1
            while not lines[i].startswith("```"):
                i += 1
            after = MARK.match(lines[i + 1].strip()) if marker[0] is None and i + 1 < len(lines) else None
            if after:  # a marker right after the block (README's first block must open the page)
                marker = after.groups()
                i += 1
            found.append((lang, marker[0], marker[1], "\n".join(lines[start:i]) + "\n", start))
            marker = (None, "")
        elif MARK.match(line.strip()):
            marker = MARK.match(line.strip()).groups()
        elif line.strip():
            marker = (None, "")
        i += 1
    return found


def command(runner, path):
    """(argv, extra environment) of a block; ``runner`` may end in ``in ENVIRONMENT``."""
    runner, _, environment = runner.partition(" in ")
    python = sys.executable
    extra = {}
    if environment:
        if environment not in ENVIRONMENTS:
            raise ValueError(f"unknown environment {environment!r}: one of {sorted(ENVIRONMENTS)}")
        python = ENVIRONMENTS[environment]
        extra["PATH"] = os.path.dirname(python) + os.pathsep + os.environ["PATH"]
    kind, _, count = runner.partition(" ")
    if kind == "python":
        return [python, path], extra
    if kind == "bash":
        return ["bash", "-euo", "pipefail", path], extra
    if kind == "torchrun":
        logs = os.path.splitext(path)[0] + "_logs"  # beside the block: torchrun's default is a temp folder it keeps
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={int(count)}",
                "--log-dir", logs, path], extra
    if kind == "xla":
        return [python, path], {**extra, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(int(count))}
    raise ValueError(f"unknown runner {runner!r}")


def test_every_code_block_is_run_or_says_why_not():
    problems = []
    for page in PAGES:
        for lang, marker, argument, _, line in blocks(page):
            if lang not in CODE_LANGUAGES:
                continue
            if marker is None:
                problems.append(f"{page}:{line}: mark the block <!-- run: RUNNER --> or <!-- not run: why -->")
            elif marker == "not run" and len(argument) < 10:
                problems.append(f"{page}:{line}: say why the block is not run")
            elif marker == "run":
                try:
                    command(argument, "x")
                except ValueError as e:
                    problems.append(f"{page}:{line}: {e}")
    assert not problems, "\n".join(problems)


def test_the_block_finder_sees_markers():
    runs = [(lang, arg) for lang, marker, arg, _, _ in blocks("README.md") if marker == "run"]
    assert ("python", "torchrun 2") in runs and ("bash", "bash") in runs


def test_relative_links_point_at_files():
    missing = []
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not os.path.exists(os.path.join(ROOT, os.path.dirname(page), target)):
                missing.append(f"{page}: {target}")
    assert not missing, missing


def sections(text):
    """(heading, body) of each ``##`` section of a page, the body stripped."""
    parts = re.split(r"^(## .*)$", text, flags=re.M)
    return [(parts[i], parts[i + 1].strip()) for i in range(1, len(parts) - 1, 2)]


@pytest.mark.fast
def test_the_docs_stay_a_reference_of_at_most_80_kb():
    """README, CONTRIBUTING and docs/ together: a reference a reader can hold, not a log (history goes to
    benchmarks/results and commit messages)."""
    sizes = {page: os.path.getsize(os.path.join(ROOT, page)) for page in PAGES}
    assert sum(sizes.values()) <= 80_000, sorted(sizes.items(), key=lambda kv: -kv[1])


@pytest.mark.fast
def test_no_page_repeats_a_section():
    """A section written twice (benchmarks.md held its host-time, tutorial-program and against-commit sections
    twice, the second copy stale) says one thing in two places: every heading and every body once per page."""
    repeated = []
    for page in PAGES:
        found = sections(open(os.path.join(ROOT, page)).read())
        for what, items in (("heading", [h for h, _ in found]), ("body of", [b for _, b in found if b])):
            repeated += [
                f"{page}: {what} {item[:60]!r}" for k, item in enumerate(items) if item in items[:k]]
    assert not repeated, repeated
    planted = sections("## A\n\none\n\n## B\n\ntwo\n\n## A\n\none\n")
    assert [h for h, _ in planted].count("## A") == 2 and planted[0][1] == planted[2][1] == "one"


def _page_param(page):
    """A page with a block run on XLA devices needs torch_xla (its later blocks may read what that wrote);
    one that names environments runs once, in the newest environment's suite, and needs both."""
    runners = [b[2] for b in blocks(page) if b[1] == "run"]
    if any(" in " in r for r in runners):
        missing = [p for p in ENVIRONMENTS.values() if not os.path.exists(p)]
        return pytest.param(page, marks=[
            pytest.mark.skipif(HAS_TORCH_XLA, reason="moves a run between environments: runs once, in the newest "
                                                     "environment's suite (make test-newest)"),
            pytest.mark.skipif(bool(missing), reason=f"needs both environments (make install; missing {missing})")])
    xla = any(r.startswith("xla") for r in runners)
    return pytest.param(page, marks=[pytest.mark.xla] if xla else [])


@pytest.mark.parametrize("page", [_page_param(p) for p in PAGES if any(b[1] == "run" for b in blocks(p))])
def test_the_page_runs_as_written(page, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    for number, (lang, marker, runner, code, line) in enumerate(blocks(page)):
        if marker != "run":
            continue
        path = str(tmp_path / f"block{number}.{'py' if lang == 'python' else 'sh'}")
        with open(path, "w") as f:
            f.write(code)
        argv, extra_env = command(runner, path)
        block_env = {**env, **extra_env}
        if " in " in runner:  # another interpreter: only what it needs of ours
            block_env = {k: v for k, v in block_env.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
            block_env.update(extra_env)
        proc = subprocess.run(argv, cwd=tmp_path, env=block_env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{page}:{line} ({runner}) exit {proc.returncode}\n" + (
            proc.stdout[-2000:] + proc.stderr[-4000:])
        if page == "README.md":  # a user's first run: no warning of ours or caused by our calls
            assert "warn" not in proc.stderr.lower(), f"{page}:{line} ({runner}) warned:\n{proc.stderr[-3000:]}"
