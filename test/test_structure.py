"""The house rules: the package's imports run one way, down the layers of LAYERS (no
circles, even through lazy or type-only imports, and no import of a higher layer: a low layer must
never depend on the public wrapper); modules moved in the package-per-concern layout stay
importable at their old paths; the code passes the linter (ruff.toml)."""
import ast
import os
import shutil
import subprocess
import sys

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
                      "xla_fsdp.consolidate_sharded_ckpts", "xla_fsdp.resize", "xla_fsdp.convert",
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


#: each piece of a step's state, by (file, class holding it): the class whose methods are its only writers.
#: A unit's step state is its runtime's (FSDP2's param group owns its training and sharded states); what a
#: root's units share is the root context's; a gather group's storage and states are the group's.
STATE_OWNERS = {(os.path.join("unit", "runtime.py"), "StepState"): "UnitRuntime",
                (os.path.join("unit", "root_context.py"), "RootContext"): "RootContext",
                (os.path.join("unit", "root_context.py"), "Schedule"): "Schedule",
                (os.path.join("unit", "gather_group.py"), "GatherGroup"): "GatherGroup"}
#: calls that change the container a field holds in place
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "add", "discard", "setdefault",
            "popitem", "sort", "reverse"}


def _fields(cls):
    """A class's fields: its annotated class attributes (a dataclass's) and what its methods assign to ``self``."""
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            fields.add(node.attr)
    return fields


def _written(node):
    """The attribute nodes ``node`` writes: assigned, augmented, deleted, item-assigned, changed in place by a
    mutating call, or set by ``setattr(x, "name", ...)`` (returned as (receiver, name))."""
    out = []

    def target(t):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                target(e)
        elif isinstance(t, (ast.Starred, ast.Subscript)):
            target(t.value)
        elif isinstance(t, ast.Attribute):
            out.append((t.value, t.attr))

    if isinstance(node, (ast.Assign, ast.Delete)):
        for t in node.targets:
            target(t)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        target(node.target)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in MUTATORS and isinstance(node.func.value, ast.Attribute):
            out.append((node.func.value.value, node.func.value.attr))
    if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)) \
            and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("setattr", "__setattr__") \
            and len(node.args) >= 2 and isinstance(node.args[-2], ast.Constant):
        out.append((node.args[-3] if len(node.args) >= 3 else node.args[0], node.args[-2].value))
    return out


def writes_outside_owners(sources, owners=None):
    """``file:line (class): receiver.field`` for every write to a field of a class of ``owners`` outside the
    methods of that field's owner. A class writing ``self.<name>`` writes its own field (another class's
    field of the same name is not this one); any other receiver counts."""
    owners = STATE_OWNERS if owners is None else owners
    trees = {rel: ast.parse(text) for rel, text in sources.items()}
    owner_of = {}
    for (rel, name), owner in owners.items():
        cls = next(n for n in ast.walk(trees[rel]) if isinstance(n, ast.ClassDef) and n.name == name)
        for f in _fields(cls):
            owner_of.setdefault(f, set()).add(owner)
    found = []

    def visit(node, cls, rel):
        if isinstance(node, ast.ClassDef):
            cls = node.name
        for receiver, attr in _written(node):
            if attr in owner_of and cls not in owner_of[attr] \
                    and not (isinstance(receiver, ast.Name) and receiver.id == "self"):
                found.append(f"{rel}:{node.lineno} ({cls or 'module'}): {ast.unparse(receiver)}.{attr}")
        for child in ast.iter_child_nodes(node):
            visit(child, cls, rel)

    for rel, tree in trees.items():
        visit(tree, None, rel)
    return found


def _package_sources():
    sources = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                sources[os.path.relpath(path, PACKAGE)] = open(path).read()
    return sources


@pytest.mark.fast
def test_each_piece_of_step_state_is_written_by_its_owner_only():
    """A unit's step state (training state, root or not, gradient sync, pending gradients, a gather in
    flight) changes only in its runtime's methods; a root's shared state (hand-offs, the plan, the backward
    pass, reduce-scatters in flight) only in RootContext's; a gather group's states only in the group's. The
    hooks of step.py, fsdp2.py and the wrapper call those methods."""
    sources = _package_sources()
    assert writes_outside_owners(sources) == []
    fields = {owner: set() for owner in STATE_OWNERS.values()}
    for (rel, name), owner in STATE_OWNERS.items():
        cls = next(n for n in ast.walk(ast.parse(sources[rel])) if isinstance(n, ast.ClassDef) and n.name == name)
        fields[owner] |= _fields(cls)
    # the fields the check guards are found (a renamed class or file would leave it checking nothing)
    assert {"training_state", "is_root", "require_backward_grad_sync", "pending_grads"} <= fields["UnitRuntime"]
    assert {"plan", "backward_task", "trainable_groups", "_waiting", "_kept"} <= fields["RootContext"]
    assert {"state", "grad_incomplete", "gradient_in_later_pass", "post_forward_piece"} <= fields["GatherGroup"]


#: what a gather group is asked about its layout by code outside it (checkpoints, names, messages)
LAYOUT_QUESTIONS = ("flat", "dim0", "in_place")


@pytest.mark.fast
def test_a_gather_group_never_branches_on_its_layout():
    """What differs between the per-parameter, flat and dim-0 layouts (members, unpad, the gradient's padding,
    the rows cut for a smaller group, what the module's places get, values to and from the padded buffer) is
    each layout class's own (unit/group_layouts.py). The group's code and the collectives it starts never ask
    which layout they have: no read of ``flat``, ``dim0`` or ``in_place`` (before: 14 in gather_group.py and
    2 in the gradient's padding) and no isinstance of the index-math layouts, except the read-only
    properties that answer the code outside."""
    asked = []
    for rel in (os.path.join("unit", "gather_group.py"), os.path.join("unit", "group_comms.py")):
        tree = ast.parse(open(os.path.join(PACKAGE, rel)).read())
        answers = {id(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in LAYOUT_QUESTIONS}
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef) or id(function) in answers:
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Attribute) and node.attr in LAYOUT_QUESTIONS and isinstance(node.ctx, ast.Load):
                    asked.append(f"{rel}:{node.lineno} {function.name}: {ast.unparse(node)}")
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" \
                        and "Layout" in ast.unparse(node.args[1]):
                    asked.append(f"{rel}:{node.lineno} {function.name}: {ast.unparse(node)}")
    # nor which API it serves: what the program sees of it is its face's (the wrapper's shard, fully_shard's ShardParam)
    source = open(os.path.join(PACKAGE, "unit", "gather_group.py")).read()
    asked += [f"unit/gather_group.py: {c}" for c in ("param is not self.shard", "param is self.shard") if c in source]
    assert asked == []
    from xla_fsdp.unit import group_layouts
    assert all(isinstance(getattr(group_layouts, name, None), type) for name in ("PerParameter", "Flat", "DimZero"))


def test_the_writer_check_finds_writes_outside_their_owner():
    """Planted writes, as the step was written before its state had owners: a free function setting a unit's
    training state, a hand-off writing the root context's fields, a tuple swap, an append, an autograd
    function flagging its group, a setattr; the owners' own writes pass."""
    owners = {("state.py", "StepState"): "Runtime", ("state.py", "Root"): "Root"}
    sources = {"state.py": (
        "class StepState:\n    training_state: int = 0\n    pending: list = None\n"
        "class Root:\n    def __init__(self):\n        self.plan = None\n        self.waiting = []\n"
        "    def hand_off(self, unit):\n        self.waiting.append(unit)\n"
        "class Runtime:\n    def go(self, other):\n        self.state.training_state = 1\n"
        "        other.state.training_state = 2\n"),
        "step.py": (
            "def before_forward(rt):\n    rt.state.training_state = 1\n"
            "def hand_off(root, unit):\n    unit, root.plan = root.plan, None\n    root.waiting.append(unit)\n"
            "class Split:\n    def backward(ctx):\n        ctx.state.pending += [1]\n"
            "def other(rt):\n    setattr(rt.root, 'plan', 3)\n    rt.plan_of_its_own = 1\n")}
    assert writes_outside_owners(sources, owners) == [
        "step.py:2 (module): rt.state.training_state", "step.py:4 (module): root.plan",
        "step.py:5 (module): root.waiting", "step.py:8 (Split): ctx.state.pending", "step.py:10 (module): rt.root.plan"]


def _calls(sources, names):
    """(file, name) of every call of a function or class named in ``names`` in the package (``torch.save``
    as "torch.save")."""
    found = []
    for rel, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch":
                    name = f"torch.{f.attr}"
                if name in names:
                    found.append((rel, name))
    return found


def _rank_file_io(sources):
    """Who writes and who reads rank files: the stream writer and the torch.save paths (writers), the rank
    file loader (readers), outside the modules that own them."""
    writers = set(_calls(sources, {"PthStreamWriter", "save_with_crc_outside_gil", "atomic_torch_save", "torch_save",
                                   "torch.save"}))
    readers = set(_calls(sources, {"load_rank_file"}))
    return writers, readers


@pytest.mark.fast
def test_rank_files_have_one_writer_and_one_reader():
    """Every rank file is written by checkpoints/rank_writer.py (the save, the resize, the DCP and pretrained
    imports go through it) and read by checkpoints/reader.py's RankFileReader (every load, live load and
    resume included). Other files written: the consolidated .pth (consolidate.py, streamed) and the
    FileSet's safetensors (hf_export.py)."""
    writers, readers = _rank_file_io(_package_sources())
    allowed_writers = {
        ("checkpoints/rank_writer.py", "PthStreamWriter"),
        ("checkpoints/consolidate.py", "PthStreamWriter"), ("checkpoints/consolidate.py", "torch_save"),  # full files
        ("checkpoints/files.py", "save_with_crc_outside_gil"),  # FileSet.torch_save, for the consolidated files
        ("checkpoints/zip_crc.py", "torch.save"),  # its fallback, under save_with_crc_outside_gil
        ("collectives/base.py", "torch.save"),  # an object broadcast to the ranks, into memory
    }
    assert writers <= allowed_writers, sorted(writers - allowed_writers)
    # files.py: the loader's own module, where find_rank_files reads the rank of a file named otherwise
    assert readers == {("checkpoints/reader.py", "load_rank_file"), ("checkpoints/files.py", "load_rank_file")}, \
        sorted(readers)
    users = {rel for rel, _ in _calls(_package_sources(), {"RankFileWriter", "RankFiles"})}
    assert users - {"checkpoints/rank_writer.py"} == {"checkpoints/sharded.py", "checkpoints/resizing.py",
                                                      "checkpoints/importing.py"}, users


@pytest.mark.fast
def test_the_rank_file_check_finds_a_second_writer_and_reader():
    sources = dict(_package_sources())
    sources["checkpoints/elsewhere.py"] = "import torch\ndef f(o, p):\n    torch.save(o, p)\n    load_rank_file(p)\n"
    writers, readers = _rank_file_io(sources)
    assert ("checkpoints/elsewhere.py", "torch.save") in writers
    assert ("checkpoints/elsewhere.py", "load_rank_file") in readers
