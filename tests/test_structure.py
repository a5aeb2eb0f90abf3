"""The shape of the house, read from the sources with ``ast`` (nothing is imported): no import
cycle between its modules, no argparse object below a command module, and no class taken from
a command module (docs/architecture.md, "Structure the tests enforce")."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("schemas", "compression", "pipelines", "trainer", "native", "benchmarks")


# --- the modules of the house and their imports -------------------------------------------

def house_sources(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict[str, bytes]:
    """Module name -> source bytes of every ``.py`` file of the packages (a package is its
    ``__init__``)."""
    sources = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            # Sources are parsed from their bytes, as Python reads them (UTF-8), whatever the
            # locale's encoding.
            sources[".".join(parts)] = path.read_bytes()
        # A compiled extension (native._store) is a module that imports none of the house;
        # its typed stub names it whether or not it is built.
        for path in sorted((root / package).rglob("*.pyi")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            sources.setdefault(name, b"")
    return sources


def _is_package(name: str, sources: dict) -> bool:
    return any(other.startswith(name + ".") for other in sources)


def _in_function(tree: ast.AST) -> set[int]:
    """ids of the import statements inside a function body (run when the function is
    called, not when the module is imported)."""
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner.update(id(n) for n in ast.walk(node)
                         if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inner


def import_edges(sources: dict[str, bytes], function_level: bool = True) -> dict[str, set[str]]:
    """Module -> the modules of the house it imports.

    ``import a.b.c`` and ``from a.b.c import x`` lead to ``a.b.c``; ``from a.b import c`` leads to
    ``a.b.c`` when that is a module, else to the package ``a.b`` (its ``__init__``). A package's
    ``__init__`` that Python runs on the way to a submodule is not an edge: a module that
    imports ``compression.fs`` depends on ``fs``, not on everything ``compression/__init__``
    re-exports. ``function_level``: also count imports inside functions. Imports under
    ``if TYPE_CHECKING:`` are never run, and are left out."""
    edges = {}
    for name, source in sources.items():
        tree = ast.parse(source, filename=name)
        inner = _in_function(tree)
        skipped = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(n) for n in ast.walk(node))
        package = name if _is_package(name, sources) or "." not in name else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if id(node) in skipped or (not function_level and id(node) in inner):
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    targets.add(_known(alias.name, sources))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    targets.add(sub if sub in sources else _known(module, sources))
        targets.discard(None)
        targets.discard(name)
        edges[name] = targets
    return edges


def _known(module: str, sources: dict) -> str | None:
    """The longest prefix of a dotted name that is a module of the house (None: outside)."""
    parts = module.split(".")
    while parts:
        if ".".join(parts) in sources:
            return ".".join(parts)
        parts.pop()
    return None


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``a -> b -> a``) through each import circle, sorted."""
    return sorted(_one_cycle(component, edges) for component in import_circles(edges))


def import_circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Every strongly connected component of more than one module: the modules that reach
    each other through imports."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = [0]

    def visit(v):  # Tarjan's algorithm; the house is a few hundred modules deep at most
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                components.append(set(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(components, key=min)


def _one_cycle(component: set[str], edges: dict) -> list[str]:
    """A shortest cycle through the component's first module, for the failure message."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a component always has one


def _cycle_lines(edges) -> str:
    """One line per circle: a cycle through it, and every module in it."""
    return "\n".join(
        " -> ".join(_one_cycle(circle, edges))
        + (f" (the circle holds {', '.join(sorted(circle))})" if len(circle) > 2 else "")
        for circle in import_circles(edges))


def test_no_import_cycle_in_the_house():
    # Imports inside functions count: a module that imports another in a function to dodge a
    # circle at import time still depends on it, and the circle is still there for a reader
    # (compression.cli -> compression.fs -> compression.cli was such a circle). A deferred
    # import to keep a heavy framework off a start-up path is no cycle and is not affected.
    edges = import_edges(house_sources(), function_level=True)
    circles = [sorted(circle) for circle in import_circles(edges)]
    assert not circles, "import cycles in the house:\n" + _cycle_lines(edges)


# --- argparse stays in the command modules ------------------------------------------------

# The modules that serve the commands themselves, beside the ``python -m`` modules: the
# commands' shared face (flags, one-line errors, exit codes) and what the trainer's commands
# share (run settings, the result line).
COMMAND_SUPPORT = {"compression.cli", "trainer.runs"}
# Below a command, a function may take a parser only to declare options on it (a package's
# own flags, e.g. compression.kafka.add_options); these are the calls that declare.
DECLARING = {"add_argument", "add_argument_group", "add_mutually_exclusive_group"}
# argparse names a module below the commands may use: the parser type in a declaring
# function's annotation, and the error a ``type=`` converter raises.
ALLOWED_BELOW = {"ArgumentParser", "ArgumentTypeError"}
ARGPARSE_PARAMETERS = {"args", "parser", "namespace"}


def is_command(name: str, source: bytes) -> bool:
    """A command module: run as ``python -m <name>`` (a top-level ``if __name__ ==
    "__main__":``), or a ``__main__`` module, or listed in COMMAND_SUPPORT."""
    if name in COMMAND_SUPPORT or name.endswith("__main__"):
        return True
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            words = {getattr(n, "id", None) for n in ast.walk(node.test)} | {
                getattr(n, "value", None) for n in ast.walk(node.test)}
            if "__name__" in words and "__main__" in words:
                return True
    return False


def _annotation_names(annotation) -> set[str]:
    if annotation is None:
        return set()
    names = {n.attr if isinstance(n, ast.Attribute) else n.id
             for n in ast.walk(annotation) if isinstance(n, (ast.Attribute, ast.Name))}
    for n in ast.walk(annotation):  # a string annotation ("argparse.Namespace")
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            names.update(n.value.replace("|", " ").replace(".", " ").split())
    return names


def _only_declares(function, parameter: str) -> bool:
    """Every use of ``parameter`` in the function is ``parameter.<declaring call>(...)``."""
    declared = set()
    for node in ast.walk(function):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == parameter
                and node.func.attr in DECLARING):
            declared.add(id(node.func.value))
    uses = [node for node in ast.walk(function)
            if isinstance(node, ast.Name) and node.id == parameter]
    return all(id(node) in declared for node in uses)


def argparse_offences(name: str, source: bytes) -> list[str]:
    """Where a module below the commands handles an argparse object: a parameter named
    ``args``/``parser``/``namespace`` or typed as an argparse object (a parser parameter only
    declaring options excepted), a call of ``.error``/``.parse_args``/``.parse_known_args`` on a
    parser, a parser or Namespace built, an argparse name other than ALLOWED_BELOW."""
    tree = ast.parse(source, filename=name)
    found = []

    def at(node, what):
        found.append(f"{name}:{node.lineno}: {what}")

    argparse_aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            argparse_aliases.update(a.asname or a.name for a in node.names if a.name == "argparse")
        elif isinstance(node, ast.ImportFrom) and node.module == "argparse" and node.level == 0:
            bad = [a.name for a in node.names if a.name not in ALLOWED_BELOW]
            if bad:
                at(node, f"imports {', '.join(bad)} from argparse")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            for parameter in arguments.posonlyargs + arguments.args + arguments.kwonlyargs:
                typed = _annotation_names(parameter.annotation) & {"ArgumentParser", "Namespace"}
                if parameter.arg not in ARGPARSE_PARAMETERS and not typed:
                    continue
                if (parameter.arg == "parser" or typed == {"ArgumentParser"}) and _only_declares(
                        node, parameter.arg):
                    continue
                at(node, f"{node.name}() takes {parameter.arg!r}"
                         + (f" ({', '.join(sorted(typed))})" if typed else ""))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = node.func.value
            receiver_name = receiver.id if isinstance(receiver, ast.Name) else (
                receiver.attr if isinstance(receiver, ast.Attribute) else "")
            if node.func.attr in {"parse_args", "parse_known_args"} or (
                    node.func.attr == "error" and "parser" in receiver_name):
                at(node, f"calls {ast.unparse(node.func)}()")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in argparse_aliases and node.attr not in ALLOWED_BELOW):
            at(node, f"uses argparse.{node.attr}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in argparse_aliases
                and node.func.attr == "ArgumentParser"):
            at(node, "builds an ArgumentParser")
    return sorted(set(found), key=lambda line: (int(line.split(":")[1]), line))


def test_no_argparse_object_below_a_command_module():
    # Commands parse their arguments into options the engines take; an engine reports a bad
    # option by raising, and the command turns that into its one line and exit code 2.
    offences = [offence for name, source in sorted(house_sources().items())
                if not is_command(name, source)
                for offence in argparse_offences(name, source)]
    assert not offences, "argparse objects below the command modules:\n" + "\n".join(offences)


def command_class_imports(sources: dict[str, bytes]) -> list[str]:
    """``from <command module> import <class it defines>`` anywhere in the house (inside
    functions too): a command's classes are its own; engines live below the commands.
    Functions a command module also offers (``pipelines.generate.generate_tables``, a
    command's ``run(argv)``) may be imported: benchmarks drive the commands."""
    classes = {name: {node.name for node in ast.parse(source).body
                      if isinstance(node, ast.ClassDef)}
               for name, source in sources.items()
               if is_command(name, source) and name not in COMMAND_SUPPORT}
    found = []
    for name, source in sorted(sources.items()):
        for node in ast.walk(ast.parse(source, filename=name)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in classes:
                for alias in node.names:
                    if alias.name in classes[node.module]:
                        found.append(f"{name}:{node.lineno}: imports {alias.name} from the "
                                     f"command module {node.module}")
    return found


def test_no_class_is_imported_from_a_command_module():
    offences = command_class_imports(house_sources())
    assert not offences, "classes taken from command modules:\n" + "\n".join(offences)


# --- the checkers on small synthetic houses ------------------------------------------------

def _house(tmp_path, files: dict[str, str]) -> dict[str, bytes]:
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    packages = sorted({relative.split("/")[0] for relative in files})
    return house_sources(tmp_path, packages)


def test_cycle_checker_passes_a_layered_toy_house(tmp_path):
    sources = _house(tmp_path, {
        "low/__init__.py": "from low.core import thing\n",
        "low/core.py": "import json\n",
        "low/fs.py": "from . import core\n",
        "high/__init__.py": "",
        "high/cmd.py": ("import low.fs\nfrom low import core\n\n"
                        "def f():\n    from high import util\n"),
        "high/util.py": "from low.fs import x\n",
    })
    edges = import_edges(sources)
    assert edges["high.cmd"] == {"low.fs", "low.core", "high.util"}
    assert edges["low.fs"] == {"low.core"} and edges["high.util"] == {"low.fs"}
    assert import_cycles(edges) == []


def test_cycle_checker_names_a_planted_cycle_also_inside_a_function(tmp_path):
    sources = _house(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/cli.py": "from pkg import fs\n",
        "pkg/fs.py": "import os\n\ndef check():\n    from .cli import UsageError\n",
        "pkg/other.py": "import pkg.cli\n",
    })
    assert import_cycles(import_edges(sources, function_level=False)) == []
    assert import_cycles(import_edges(sources)) == [["pkg.cli", "pkg.fs", "pkg.cli"]]
    assert _cycle_lines(import_edges(sources)) == "pkg.cli -> pkg.fs -> pkg.cli"


def test_cycle_checker_names_every_module_of_a_longer_circle(tmp_path):
    sources = _house(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/cli.py": "from pkg import fs, io\n",
        "pkg/io.py": "from pkg import fs\n",
        "pkg/fs.py": "def check():\n    from pkg.cli import UsageError\n",
        "pkg/trees.py": "from pkg import io\n",
    })
    assert _cycle_lines(import_edges(sources)) == (
        "pkg.cli -> pkg.fs -> pkg.cli (the circle holds pkg.cli, pkg.fs, pkg.io)")


def test_cycle_checker_leaves_type_checking_imports_out(tmp_path):
    sources = _house(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "import pkg.b\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
    })
    assert import_cycles(import_edges(sources)) == []


def test_command_modules_are_told_from_their_main_guard():
    assert is_command("pkg.run",
                      b"def main():\n    pass\n\nif __name__ == '__main__':\n    main()\n")
    assert is_command("pkg.__main__", b"import sys\n")
    assert is_command("compression.cli", b"import argparse\n")
    assert not is_command("pkg.engine", b"def main():\n    pass\n")


def test_argparse_checker_passes_typed_options_and_option_declarers():
    source = b"""
import argparse
import dataclasses


@dataclasses.dataclass
class Options:
    workers: int


class BadOption(argparse.ArgumentTypeError, ValueError):
    pass


def add_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("kafka")
    group.add_argument("-X")
    parser.add_argument("--broker-timeout", type=float)


def run(options: Options, *args, **kwargs) -> int:
    if options.workers < 1:
        raise ValueError("--workers must be at least 1")
    return len(args)
"""
    assert argparse_offences("pkg.engine", source) == []


def test_argparse_checker_finds_each_planted_offence():
    source = b"""
import argparse
from argparse import Namespace


def run_cli(args, parser, schema):
    if args.workers < 1:
        parser.error("--workers must be at least 1")


def restore(settings: argparse.Namespace):
    return settings


def keep(parser):
    parser.add_argument("--x")
    return parser


def build():
    return argparse.ArgumentParser().parse_args([])
"""
    offences = argparse_offences("pkg.engine", source)
    assert offences == [
        "pkg.engine:3: imports Namespace from argparse",
        "pkg.engine:6: run_cli() takes 'args'",
        "pkg.engine:6: run_cli() takes 'parser'",
        "pkg.engine:8: calls parser.error()",
        "pkg.engine:11: restore() takes 'settings' (Namespace)",
        "pkg.engine:11: uses argparse.Namespace",
        "pkg.engine:15: keep() takes 'parser'",
        "pkg.engine:21: builds an ArgumentParser",
        "pkg.engine:21: calls argparse.ArgumentParser().parse_args()",
    ]


def test_class_import_checker_finds_an_engine_taken_from_a_command(tmp_path):
    sources = _house(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/online.py": ("class OnlineTrainer:\n    pass\n\ndef run(argv):\n    pass\n\n"
                          "if __name__ == '__main__':\n    run(None)\n"),
        "pkg/loop.py": "class OnlineLoop:\n    pass\n",
        "bench/__init__.py": "",
        "bench/online.py": ("from pkg.loop import OnlineLoop\nfrom pkg.online import run\n\n"
                            "def measure():\n    from pkg.online import OnlineTrainer\n"),
    })
    assert command_class_imports(sources) == [
        "bench.online:5: imports OnlineTrainer from the command module pkg.online"]
