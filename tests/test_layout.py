"""The layout of the code: one import namespace (manylora), the engine's subpackages in one order, no import cycle,
model_repository -> engine -> kernels and never back.

Imports are read from the source (imports under ``if TYPE_CHECKING:`` are annotations, not run, and are left out).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "manylora"
# each engine subpackage and what it may import besides itself and the engine's top level
ENGINE_ORDER = {
    "requests": set(),
    "adapters": set(),
    "memory": {"adapters"},
    "layers": {"adapters", "memory", "kernels"},
    "models": {"layers", "memory", "kernels"},
    "parallel": {"adapters", "layers", "memory", "models", "kernels"},
    "execution": {"adapters", "layers", "memory", "models", "kernels"},
    "scheduling": {"requests", "adapters", "memory", "layers", "models", "parallel", "execution", "kernels"},
}


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _run_time_imports(path: Path) -> set[str]:
    """Modules a file imports when it runs (top level or inside functions), not those under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def _graph(root: Path) -> dict[str, set[str]]:
    modules = {_module(p): p for p in root.rglob("*.py")}
    return {m: {d for d in _run_time_imports(p) if d in modules} for m, p in modules.items()}


def _concern(module: str) -> str:
    """'kernels', 'client', 'embedded', 'engine' (the engine's top level) or the engine subpackage."""
    parts = module.split(".")
    if len(parts) == 1:
        return "manylora"
    if parts[1] != "engine":
        return parts[1]
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and (PACKAGE / "engine" / parts[2]).is_dir()) else "engine"


def test_everything_is_under_one_namespace():
    top = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    assert top == {"manylora", "perf"}, top  # perf/ is the benchmarks' package; nothing installs it
    assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()} == {"engine", "kernels", "client",
                                                                                     "embedded", "deploy", "openai"}


def test_the_engine_subpackages_import_in_one_order():
    wrong = []
    for module, deps in _graph(PACKAGE).items():
        if not module.startswith("manylora.engine."):
            continue
        own = _concern(module)
        allowed = {own, "engine"} | ENGINE_ORDER.get(own, set()) if own != "engine" else {"engine"}
        for dep in deps:
            if dep.startswith("manylora.") and _concern(dep) not in allowed:
                wrong.append(f"{module} imports {dep}")
    assert not wrong, "\n".join(sorted(wrong))
    assert set(ENGINE_ORDER) == {p.name for p in (PACKAGE / "engine").iterdir() if (p / "__init__.py").is_file()}


def test_no_import_cycle():
    graph = _graph(PACKAGE)
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in graph[module]:
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_kernels_know_nothing_of_the_engine_and_the_engine_nothing_of_the_server():
    for module, deps in _graph(PACKAGE).items():
        concern = _concern(module)
        every = _run_time_imports(Path(REPO, *module.split(".")).with_suffix(".py")
                                  if Path(REPO, *module.split(".")).with_suffix(".py").is_file()
                                  else Path(REPO, *module.split("."), "__init__.py"))
        assert not any(d.startswith(("model_repository", "perf", "triton_python_backend_utils")) for d in every), module
        if concern == "kernels":
            assert all(_concern(d) == "kernels" for d in deps if d.startswith("manylora.")), module
        if concern == "client":  # a client of the server; its planner uses the engine's sizing math and dtypes
            assert all(_concern(d) in ("client", "engine", "memory", "models") for d in deps
                       if d.startswith("manylora.")), module


def test_perf_is_grouped_and_its_gpu_entry_point_starts_on_the_standard_library():
    """perf/ holds its tools in groups, none loose; ``python -m perf.device`` starts with the standard library alone
    (it runs on a GPU machine's python3 before the server's venv exists; torch and the rest load in its steps)."""
    perf = REPO / "perf"
    assert {p.name for p in perf.glob("*.py")} == {"__init__.py"}
    assert {p.name for p in perf.iterdir() if (p / "__init__.py").is_file()} == {
        "workload", "kernels", "engine", "capacity", "server", "peers", "device"}
    for path in (perf / "device").glob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or name.startswith("perf.device") or top == "__future__", \
                    f"{path.name} imports {name} at module level"
