"""The house rules (issue 24): the package's imports run one way (no module imports, even lazily or
for type hints, a module that imports it back: a circle would mean a low layer depends on the public
wrapper), and the code passes the linter (ruff.toml)."""
import ast
import os
import shutil
import subprocess
import sys

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


def test_imports_run_one_way():
    graph = import_graph()
    assert "xla_fsdp.fully_sharded_data_parallel" in graph and len(graph) > 30
    assert cycles(graph) == []
    low = ["xla_fsdp.schedule", "xla_fsdp.backward", "xla_fsdp.unit_init", "xla_fsdp.param_names",
           "xla_fsdp.metadata", "xla_fsdp.wrap", "xla_fsdp.param_group", "xla_fsdp.sharding"]
    for module in low:  # the layers below the wrapper never name it
        assert "xla_fsdp.fully_sharded_data_parallel" not in graph[module], module


def test_the_code_passes_the_linter():
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    assert ruff, "ruff is part of the test extra: pip install -e .[test]"
    proc = subprocess.run([ruff, "check", "xla_fsdp", "test", "examples", "tools", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]
