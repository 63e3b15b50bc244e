import collections
import fnmatch
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# XLA:CPU runs in tests are mostly compiling small graphs: LLVM at -O0 instead of -O3, and XLA:CPU's
# older fusion emitters instead of its MLIR ones, compile them in about half the time (docs/testing.md
# has the figures). Both change machine-code generation, not the graphs xla_fsdp builds; an XLA_FLAGS
# of your own takes precedence.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
# Every process the suite starts (ranks, launchers, example scripts) prints its Python threads' stacks
# if it dies by a signal (SIGABRT, SIGSEGV): a rare abort at exit is then diagnosable from
# the one run where it happens.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


# What tests, their subprocesses and the libraries they drive leave in a temp folder: tempfile's
# tmp*, multiprocessing's pymp-*, torchrun's error files and run dirs.
TEMP_LITTER = ["tmp*", "pymp-*", "pytorch-errorfile-*", "torchelastic_*"]
_TEMP = {}


def pytest_configure(config):
    """Every temp path of the session (pytest's tmp_path, tempfile in tests and in the processes
    they start) goes to one private folder, removed at the end of a passing session."""
    _TEMP.update(system=tempfile.gettempdir(), tmpdir=os.environ.get("TMPDIR"))
    private = tempfile.mkdtemp(prefix="xla_fsdp-tests-")
    _TEMP["private"] = private
    os.environ["TMPDIR"] = private  # inherited by subprocesses and spawned ranks
    tempfile.tempdir = private
    # the session's training runs shared by its pytest-xdist workers (harness.session_run): the
    # controller names the folder, the workers it starts inherit it
    if "XLA_FSDP_SESSION_RUNS" not in os.environ:
        os.environ["XLA_FSDP_SESSION_RUNS"] = _TEMP["session_runs"] = os.path.join(private, "session_runs")
    # each XLA device process started through ranks.run_multiprocess notes its compile time here
    if "XLA_FSDP_COMPILE_LOG" not in os.environ:
        os.environ["XLA_FSDP_COMPILE_LOG"] = _TEMP["compile_log"] = os.path.join(private, "xla_compile_times")
        os.makedirs(_TEMP["compile_log"])


def _own_live_temp_dirs():
    """Temp folders this process still holds, removed when it exits (not litter yet): multiprocessing's
    and torch.distributed.nn's."""
    import multiprocessing.process
    held = {multiprocessing.process.current_process()._config.get("tempdir")}
    instantiator = sys.modules.get("torch.distributed.nn.jit.instantiator")
    temp_dir = getattr(instantiator, "_TEMP_DIR", None)
    held.add(getattr(temp_dir, "name", None))
    return {os.path.basename(p) for p in held if p}


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when a process it started left temp entries behind (tests clean up after
    themselves). Only the session's private folder counts: every process the suite starts writes its
    temp files there, and what other programs on the machine put in the system temp folder is theirs."""
    _relay_to_controller(session)
    folder = _TEMP.get("compile_log")
    if folder and os.path.isdir(folder):  # read before the session's folder goes
        _CLOCK["compile_notes"] = [json.load(open(os.path.join(folder, n))) for n in os.listdir(folder)
                                   if n.endswith(".json")]
    if "private" not in _TEMP:
        return
    private = _TEMP["private"]
    if "session_runs" in _TEMP:  # the controller (or a plain session): the runs end with it
        os.environ.pop("XLA_FSDP_SESSION_RUNS", None)
    if "compile_log" in _TEMP:
        os.environ.pop("XLA_FSDP_COMPILE_LOG", None)
    tempfile.tempdir = None
    if _TEMP["tmpdir"] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = _TEMP["tmpdir"]
    own = _own_live_temp_dirs()
    left = sorted(name for name in os.listdir(private)
                  if any(fnmatch.fnmatch(name, p) for p in TEMP_LITTER) and name not in own)
    if left:
        print(f"\nthe test session's processes left {len(left)} temp entries: {left[:10]}")
        session.exitstatus = 1
    if exitstatus == 0 and not left:
        live = own & set(os.listdir(private))
        for name in set(os.listdir(private)) - live:
            path = os.path.join(private, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        if live:  # multiprocessing removes its own folder as this process exits: the rest after it
            import multiprocessing.util
            multiprocessing.util.Finalize(None, shutil.rmtree, args=(private,), kwargs={"ignore_errors": True},
                                          exitpriority=-200)
        else:
            os.rmdir(private)
    else:
        print(f"\ntemp files of this session kept in {private}")


# Test files by time taken on this machine, slowest first: run in this order, pytest-xdist's workers
# (make test) finish close together instead of one running a slow file alone at the end. The Makefile
# passes --no-loadscope-reorder: without it xdist hands files out by their number of tests instead.
# Measured: `python tools/test_times.py` after make test (both environments, 2026-11-29).
SLOWEST_FILES = ["test_checkpoints.py", "test_llama_fsdp2_example.py", "test_docs.py", "test_examples.py",
                 "test_hf_trainer.py", "test_benchmarks.py", "test_fsdp2.py", "test_lm_example.py",
                 "test_differential.py", "test_fine_tuning.py", "test_preemption.py", "test_spmd.py",
                 "test_torchtitan.py",
                 "test_output_rule.py", "test_user_programs.py", "test_user_collectives.py",
                 "test_checkpoint_safety.py", "test_patches.py", "test_install.py", "test_dcp.py",
                 "test_pretrained.py", "test_cross_version.py", "test_compat.py",
                 "test_xla_defects.py", "test_full_disk.py", "test_offload.py"]


#: whether this environment has torch_xla (make test's first environment; the second runs the newest
#: torch without it, as a user who installs plain ``xla_fsdp``)
HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the interpreters of the two environments make test builds (tests that move a run between them)
ENVIRONMENTS = {"xla-env": os.environ.get("XLA_FSDP_XLA_PYTHON") or os.path.join(_ROOT, ".venv", "bin", "python"),
                "newest-env": os.environ.get("XLA_FSDP_NEWEST_PYTHON")
                or os.path.join(_ROOT, ".venv-newest", "bin", "python")}
NO_XLA = pytest.mark.skip(reason="needs torch_xla, which this environment does not have (the xla extra; "
                                 "make test runs it in its first environment)")


def _needs_xla(item) -> bool:
    """Marked ``xla``, or a parametrized case whose value is ``"xla"`` (a transport)."""
    callspec = getattr(item, "callspec", None)
    return item.get_closest_marker("xla") is not None or (
        callspec is not None and "xla" in [v for v in callspec.params.values() if isinstance(v, str)])


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))  # stable: file order kept
    for item in items:
        if _needs_xla(item):
            # one marker for every case that needs torch_xla, so `-m xla` / `-m "not xla"` select by
            # environment (make test-xla / make test-newest)
            item.add_marker(pytest.mark.xla)
            if not HAS_TORCH_XLA:
                item.add_marker(NO_XLA)


# The equivalence figures printed at the end: test_equivalence's own when it ran in this process,
# else those its pytest-xdist worker sent back (make test runs the suite on 2 workers).
_RELAYED = {"deviations": {}, "bytes": []}


def _equivalence_figures():
    module = sys.modules.get("test_equivalence")
    if module is not None and (module.DEVIATIONS or module.BYTES):
        return {"deviations": module.DEVIATIONS, "bytes": [list(row) for row in module.BYTES]}
    return None


def _relay_to_controller(session):
    """On a pytest-xdist worker: hand this worker's equivalence figures to the controller."""
    output = getattr(session.config, "workeroutput", None)
    figures = _equivalence_figures()
    if output is not None and figures is not None:
        output["xla_fsdp_equivalence"] = json.dumps(figures)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    figures = getattr(node, "workeroutput", {}).get("xla_fsdp_equivalence")
    if figures:
        figures = json.loads(figures)
        for transport, worst in figures["deviations"].items():
            mine = _RELAYED["deviations"].setdefault(transport, {"loss": 0.0, "param": 0.0})
            for kind, value in worst.items():
                mine[kind] = max(mine[kind], value)
        _RELAYED["bytes"].extend(figures["bytes"])


# What the session spends, printed at its end (make test prints both environments' lines): the next
# change sees the budget (30 min for make test on 2 cores, both environments) and where it goes.
_CLOCK = {"start": time.monotonic(), "files": collections.defaultdict(float), "tests": 0}
# Drawn programs that need a CPU kernel this machine lacks (test_differential records them as the
# user property "not_applicable_here"): printed at the end with their count, never counted as passed.
_NOT_APPLICABLE = []


def pytest_runtest_logreport(report):
    """Seconds per test file (setup, call and teardown; on the controller, its workers' reports), and
    the programs a test found not applicable here."""
    _CLOCK["files"][report.nodeid.split("::")[0]] += report.duration
    if report.when == "call":
        _NOT_APPLICABLE.extend((report.nodeid, value) for name, value in report.user_properties
                               if name == "not_applicable_here")
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _CLOCK["tests"] += 1


def _report_time(terminalreporter) -> None:
    if getattr(terminalreporter.config, "workerinput", None) is not None:
        return  # a pytest-xdist worker: its controller reports
    wall = time.monotonic() - _CLOCK["start"]
    env = "xla-env (torch_xla)" if HAS_TORCH_XLA else "newest-env (no torch_xla)"
    terminalreporter.write_line(f"suite time, {env}: {wall:.0f} s wall for {_CLOCK['tests']} tests, "
                                f"{sum(_CLOCK['files'].values()):.0f} s in tests; the 25 slowest files:")
    for path, seconds in sorted(_CLOCK["files"].items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"  {seconds:8.1f} s  {path}")
    notes = _CLOCK.get("compile_notes")
    if notes:
        compile_s, wall_s = sum(n["compile_s"] for n in notes), sum(n.get("wall_s", 0.0) for n in notes)
        cpu_s = sum(n["cpu_s"] for n in notes)
        terminalreporter.write_line(
            f"XLA compilation: {sum(n['compiles'] for n in notes)} graphs compiled in {compile_s:.0f} s of the "
            f"{wall_s:.0f} s that the {len(notes)} device processes started through test/ranks.py ran "
            f"({compile_s / max(wall_s, 1e-9):.0%}; {cpu_s:.0f} CPU s)")


def _report_not_applicable(terminalreporter) -> None:
    if getattr(terminalreporter.config, "workerinput", None) is not None or not _NOT_APPLICABLE:
        return
    total = sum(value["programs"] for _, value in _NOT_APPLICABLE)
    terminalreporter.write_line(f"not applicable on this machine: {total} drawn programs need a CPU kernel it "
                                f"lacks (not run, not passed; others were drawn in their place, docs/testing.md):")
    for nodeid, value in _NOT_APPLICABLE:
        terminalreporter.write_line(f"  {value['programs']:3d}  {nodeid}: {value['reason']}")


def pytest_terminal_summary(terminalreporter):
    _report_time(terminalreporter)
    _report_not_applicable(terminalreporter)
    figures = _equivalence_figures() or _RELAYED
    if figures["deviations"]:
        terminalreporter.write_line("largest deviation from unsharded training, per transport:")
        for transport, worst in sorted(figures["deviations"].items()):
            terminalreporter.write_line(f"  {transport}: loss {worst['loss']:.2e}, parameters {worst['param']:.2e}")
    if figures["bytes"]:
        terminalreporter.write_line("per-rank params+grads+optimizer bytes (max over ranks) vs ideal total/N:")
        terminalreporter.write_line("  transport ws config                       bytes     ideal  ratio  padding")
        for transport, ws, name, got, ideal, pad in sorted(map(tuple, figures["bytes"])):
            terminalreporter.write_line(
                f"  {transport:9s} {ws:2d} {name:25s} {got:9d} {ideal:9.0f}  {got / ideal:5.3f}  {pad:7.0f}"
            )


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    """A one-rank gloo group in this process, for single-rank API tests (multi-rank cases spawn
    real ranks through ranks.on_gloo / on_xla)."""
    import ranks
    with ranks.one_rank_group(tmp_path_factory.mktemp("gloo") / "store"):
        yield
