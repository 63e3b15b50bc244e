"""The house rules (issue 24): the package's imports run one way, down the layers of LAYERS (no
circles, even through lazy or type-only imports, and no import of a higher layer: a low layer must
never depend on the public wrapper); modules moved in the package-per-concern layout stay
importable at their old paths; the code passes the linter (ruff.toml)."""
import ast
import os
import shutil
import subprocess
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "xla_fsdp")


def _module_name(path):
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def import_graph():
    """Module -> the package modules it imports anywhere in its source (function bodies and
    ``if TYPE_CHECKING`` blocks included)."""
    files = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                files[_module_name(os.path.join(folder, name))] = os.path.join(folder, name)
    graph = {}
    for module, path in files.items():
        package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                # ``from pkg import sub`` imports the submodule; ``from mod import name``, the module
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            targets.update(n for n in names if n in files and n != module)
        graph[module] = targets
    return graph


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


# The layers, top first; a module may import its own layer and those below (CONTRIBUTING.md).
LAYERS = [
    ("entry points", ["xla_fsdp", "xla_fsdp.cli", "xla_fsdp.compat", "xla_fsdp.integrations",
                      "xla_fsdp.consolidate_sharded_ckpts", "xla_fsdp.resize", "xla_fsdp.reshard", "xla_fsdp.convert",
                      "xla_fsdp.inspect", "xla_fsdp.spmd"]),
    ("FSDP2's API", ["xla_fsdp.fsdp2", "xla_fsdp.fsdp2_keywords"]),
    ("public API", ["xla_fsdp.fully_sharded_data_parallel", "xla_fsdp.wrap", "xla_fsdp.remat", "xla_fsdp.strategy"]),
    ("checkpoints", ["xla_fsdp.checkpoints"]),
    ("unit life cycle", ["xla_fsdp.unit"]),
    ("transports, sharding math, names", ["xla_fsdp.collectives", "xla_fsdp.sharding", "xla_fsdp.shard_names",
                                         "xla_fsdp.advice", "xla_fsdp._exit_cleanup", "xla_fsdp._version",
                                         "xla_fsdp.patches"]),
]


def layer_of(module):
    """Index in LAYERS (0 = top) of the longest prefix naming the module or its package."""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if prefix != "xla_fsdp" or module == "xla_fsdp":
                    if best is None or len(prefix) > best[1]:
                        best = (index, len(prefix))
    return None if best is None else best[0]


@pytest.mark.fast
def test_imports_run_one_way():
    graph = import_graph()
    assert "xla_fsdp.fully_sharded_data_parallel" in graph and len(graph) > 40
    assert cycles(graph) == []
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert not unplaced, f"put these modules in a layer of LAYERS (and CONTRIBUTING.md): {unplaced}"
    upward = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
                    for m, targets in graph.items() for t in targets if layer_of(t) < layer_of(m))
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_layer_check_catches_an_upward_import():
    graph = {"xla_fsdp.unit.step": {"xla_fsdp.fully_sharded_data_parallel"},
             "xla_fsdp.fully_sharded_data_parallel": set()}
    assert layer_of("xla_fsdp.unit.step") > layer_of("xla_fsdp.fully_sharded_data_parallel")
    assert cycles(graph) == []  # no circle, yet against the layers: the layer check is what finds it


@pytest.mark.fast
def test_the_code_passes_the_linter():
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    assert ruff, "ruff is part of the test extra: pip install -e .[test]"
    proc = subprocess.run([ruff, "check", "xla_fsdp", "test", "examples", "tools", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


@pytest.mark.parametrize("leaves", ["nothing", "an entry in the system temp folder", "its own temp folder"])
def test_the_suites_litter_check_counts_only_its_own_processes(leaves, tmp_path):
    """A session fails when one of its processes leaves a temp entry behind, and only then: what
    another program puts in the system temp folder meanwhile (seen: a user's torch process) is not
    the suite's. A nested pytest session with this suite's conftest.py shows both."""
    import tempfile
    system = tmp_path / "system"  # stands in for /tmp, where another program writes
    system.mkdir()
    (tmp_path / "conftest.py").write_text(open(os.path.join(ROOT, "test", "conftest.py")).read())
    make = {"nothing": "pass",
            "an entry in the system temp folder": f"os.mkdir(os.path.join({str(system)!r}, 'tmpother'))",
            "its own temp folder": "subprocess.run([sys.executable, '-c', 'import tempfile; tempfile.mkdtemp()'])"}
    (tmp_path / "test_one.py").write_text(f"import os, subprocess, sys\n\ndef test_it():\n    {make[leaves]}\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(tmp_path / "test_one.py")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, TMPDIR=str(system)))
    if leaves == "its own temp folder":
        assert proc.returncode == 1 and "the test session's processes left 1 temp entries: ['tmp" in proc.stdout, \
            proc.stdout[-2000:]
        kept = [d for d in os.listdir(system) if d.startswith("xla_fsdp-tests-")]
        assert len(kept) == 1  # kept for a look, with what was left
    else:
        assert proc.returncode == 0, proc.stdout[-2000:]
        assert [d for d in os.listdir(system) if d.startswith("xla_fsdp-tests-")] == []
    assert tempfile.gettempdir() != str(system)


#: the unit's own files (the wrapper's shell, fully_shard's, and the runtime they hold): the only ones that
#: touch a unit's private state (step.py, root_setup.py and adoption.py use the runtime's public names)
UNIT_CLASS_FILES = {"fully_sharded_data_parallel.py", "fsdp2.py", os.path.join("unit", "runtime.py"),
                    os.path.join("unit", "shell.py")}


@pytest.mark.fast
def test_other_modules_use_a_unit_only_through_its_declared_interface():
    """The schedule, the gradient code, the checkpoint code and the tools use what ``unit/base.py``
    declares (``gather_groups``, ``reshard()``, ``gather_over_ranks()``, ...), never a unit's private
    attributes: before, checkpoint code read ``_groups``, ``_aux_channel``, ``_shard_size_multiple``
    and the schedule called ``_reshard`` and ``_finish_unshard``."""
    private = set()
    for rel in UNIT_CLASS_FILES:
        for node in ast.walk(ast.parse(open(os.path.join(PACKAGE, rel)).read())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and isinstance(node.ctx, ast.Store)) or isinstance(node, ast.FunctionDef):
                name = node.attr if isinstance(node, ast.Attribute) else node.name
                if name.startswith("_") and not name.startswith("__"):
                    private.add(name)
    assert {"_runtime", "_adopted", "_channels", "_rank_0_buffers"} <= private
    reached = []
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, PACKAGE)
            if not name.endswith(".py") or rel in UNIT_CLASS_FILES:
                continue
            for node in ast.walk(ast.parse(open(path).read())):
                if (isinstance(node, ast.Attribute) and node.attr in private
                        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                    reached.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert reached == []
    from xla_fsdp import XlaFullyShardedDataParallel
    from xla_fsdp.unit.base import ShardedUnit
    # the declared methods are abstract: the wrapper implements every one (or it could not be built)
    assert len(ShardedUnit.__abstractmethods__) == 9 and not XlaFullyShardedDataParallel.__abstractmethods__


#: the unit's files a training step runs through (issue 68: FSDP2's runs through 4, state -> param group ->
#: param -> collectives): the hooks (step), the runtime with its step state and the collectives of several
#: groups (runtime), the gather groups and their values (gather_group), where members sit in the module
#: (member_slots), which groups get gradients and the shard gradient's type (gradients), what is freed when
#: (freeing), which modules are units (base: the root's forward walks its modules down to the units for
#: parameters added after wrapping). The optimizer's step adds the check of what it was given (optimizer_check).
STEP_FILES = {"step.py", "runtime.py", "gather_group.py", "member_slots.py", "gradients.py", "freeing.py", "base.py"}


_BUILDING = threading.Lock()


def _files_one_step_runs(rank, api="wrapper"):
    import torch
    import torch.nn as nn
    import xla_fsdp
    from xla_fsdp import XlaFullyShardedDataParallel as FSDP
    with _BUILDING:  # (XLA:CPU device threads share one CPU generator)
        torch.manual_seed(0)
        built = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    if api == "wrapper":
        # flat and per-parameter units, nested under a root with a parameter of its own; several small
        # groups, so a coalescing transport (gloo) joins their collectives
        model = FSDP(nn.Sequential(FSDP(built[:3]), FSDP(nn.Linear(8, 8), flatten_parameters=False), built[3]))
    else:  # FSDP2's recipe on XLA: fully_shard on the blocks, then on the root
        model = built.to(rank.device)
        for module in (model[0], model[2], model):
            xla_fsdp.fully_shard(module)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = (torch.randn(4, 8) + rank.rank).to(rank.device)
    unit_dir = os.path.join(os.path.dirname(sys.modules["xla_fsdp"].__file__), "unit")
    seen = {"step": set(), "optimizer": set()}
    phase = []

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(unit_dir):
            seen[phase[0]].add(os.path.relpath(path, unit_dir))

    for traced in (False, False, True):  # the third step is traced: the first forward sets up the root
        opt.zero_grad()
        phase[:] = ["step"]
        if traced:
            sys.setprofile(profile)
        model(x).sum().backward()
        phase[:] = ["optimizer"]
        opt.step()
        sys.setprofile(None)
        rank.sync()
    return {k: sorted(v) for k, v in seen.items()}


def test_a_training_step_runs_through_the_step_files():
    """Forward, backward and the reduce-scatters of a step (2 gloo ranks, flat and per-parameter units,
    coalesced collectives) enter exactly the files of STEP_FILES; the optimizer's step adds one."""
    from ranks import on_gloo
    for files in on_gloo(_files_one_step_runs, 2):
        assert set(files["step"]) == STEP_FILES, files["step"]
        assert set(files["optimizer"]) - set(files["step"]) <= {"optimizer_check.py"}, files["optimizer"]


@pytest.mark.xla
def test_a_fully_shard_step_on_xla_runs_through_the_same_files():
    """The same for FSDP2's recipe on 2 XLA:CPU devices (fully_shard's hooks in fsdp2.py call the same
    step); the module's own forward adds the weight-saving nn.Linear forward the unit installs on XLA
    (patched_linear: the module's compute, not the unit's step). The optimizer's own operations on the
    parameters run through their type, fully_shard's ShardParam (shard_param: the parameter, not the step)."""
    from ranks import on_xla
    for files in on_xla(_files_one_step_runs, 2, "fully_shard"):
        assert set(files["step"]) == STEP_FILES | {"patched_linear.py"}, files["step"]
        assert set(files["optimizer"]) - set(files["step"]) <= {"optimizer_check.py", "shard_param.py"}, \
            files["optimizer"]
