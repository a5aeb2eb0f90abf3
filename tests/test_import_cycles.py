"""No import circle in the house: the modules of the project's packages, with every import they
make (at module level and inside functions alike), form a graph without cycles, so each module
can be read and tested with only what is below it."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ["schemas", "compression", "pipelines", "trainer", "native", "benchmarks"]


def _modules() -> dict:
    """Dotted module name -> source path of every module (None for a compiled extension, known
    by its type stub, so the graph does not depend on whether it was built in place)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        for path in sorted((ROOT / package).rglob("*.pyi")):
            modules.setdefault(".".join(path.relative_to(ROOT).with_suffix("").parts), None)
    return modules


def _within(name: str, modules: dict) -> str | None:
    """The house module that importing ``name`` loads last (``a.b.c`` where ``c`` is a function
    of ``a.b``: ``a.b``); None outside the house."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict:
    """module -> the house modules it imports anywhere in its source."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        graph[name] = set()
        if path is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [_within(alias.name, modules) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                           else _within(base, modules) for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t and t != name)
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_sees_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_holds_function_level_imports():
    graph = import_graph()
    # compression.cli imports compression.io inside input_rows, not at module level
    assert "compression.io" in graph["compression.cli"]
    assert "native._store" in graph["native.store"]


def test_no_import_cycle_in_the_house():
    graph = import_graph()
    described = [{module: sorted(graph[module] & set(component)) for module in component}
                 for component in cycles(graph)]
    assert described == []  # each: module -> the modules of its circle it imports
