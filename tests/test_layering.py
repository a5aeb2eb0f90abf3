"""The dependency direction of docs/architecture.md: heavy frameworks stay in their own package."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ["schemas", "compression", "pipelines", "trainer", "native"]
# package -> top-level modules it must not import
FORBIDDEN = {
    "schemas": {"apache_beam", "tensorflow", "keras", "compression", "pipelines", "trainer",
                "native"},
    # compression may call native (the JSON sample decoder of Kafka messages)
    "compression": {"apache_beam", "tensorflow", "keras", "pipelines", "trainer"},
    "native": {"apache_beam", "tensorflow", "keras", "schemas", "compression", "pipelines",
               "trainer"},
    "pipelines": {"tensorflow", "keras", "trainer"},
    "trainer": {"apache_beam", "pipelines"},
}


def _imports(path: pathlib.Path) -> set[str]:
    # Sources are parsed from their bytes, as Python reads them (UTF-8): read_text() would
    # decode them with the locale's encoding, which fails on their non-ASCII characters
    # under an ASCII or EUC-JP locale.
    tree = ast.parse(path.read_bytes(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_package_imports_what_its_layer_forbids():
    offences = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            bad = _imports(path) & forbidden
            if bad:
                offences.append(f"{path.relative_to(ROOT)} imports {', '.join(sorted(bad))}")
    assert offences == []


# The Kafka client is imported in one place, so swapping it touches one module.
KAFKA_CLIENT = "confluent_kafka"
KAFKA_MODULE = "compression/kafka.py"


def test_only_one_module_imports_the_kafka_client():
    importers = [str(path.relative_to(ROOT)) for package in PACKAGES
                 for path in sorted((ROOT / package).rglob("*.py"))
                 if KAFKA_CLIENT in _imports(path)]
    assert importers == [KAFKA_MODULE]


def loaded_by(imports: str, modules: tuple) -> list:
    """Which of ``modules`` a fresh interpreter has loaded after ``import <imports>``."""
    code = f"import sys, {imports}; print([m for m in {modules!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return ast.literal_eval(out.stdout.strip())


def test_importing_schemas_and_compression_loads_neither_beam_nor_tensorflow():
    assert loaded_by("schemas, compression, compression.inspect, compression.compress",
                     ("apache_beam", "tensorflow", "keras", "confluent_kafka")) == []


def _uses_pyarrow_json(path: pathlib.Path) -> bool:
    """``import pyarrow.json``, ``from pyarrow.json import ...``, ``from pyarrow import json``
    or ``pa.json`` / ``pyarrow.json`` used as an attribute."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.startswith("pyarrow.json")
                                                for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module.startswith("pyarrow.json")
                or (node.module == "pyarrow" and any(a.name == "json" for a in node.names))):
            return True
        if (isinstance(node, ast.Attribute) and node.attr == "json"
                and isinstance(node.value, ast.Name) and node.value.id in ("pa", "pyarrow")):
            return True
    return False


def test_pyarrow_json_reader_never_reads_user_input():
    """JSON samples, in files and in Kafka messages alike, go through the one native decoder
    (compression.decode_json_samples): pyarrow's JSON reader crashes the process on a `null`
    line, so no package of the project may call it."""
    users = [str(path.relative_to(ROOT)) for package in PACKAGES
             for path in sorted((ROOT / package).rglob("*.py")) if _uses_pyarrow_json(path)]
    assert users == []
    assert _uses_pyarrow_json(ROOT / "benchmarks" / "json_decode.py")  # the check sees it


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The project modules a file imports, at any depth (function-level imports too):
    ``from trainer import serving`` names the module ``trainer.serving``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
    return out & modules


def test_trainer_modules_import_each_other_without_a_cycle():
    """No circle of imports inside trainer/, function-level imports included (they hid one:
    distributed -> serving -> train -> trainer -> distributed)."""
    paths = sorted((ROOT / "trainer").rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    # a package's lazy __init__ is not a dependency of its modules
    graph = {_module_name(p): {m for m in _project_imports(p, modules)
                               if m != _module_name(p) and not _module_name(p).startswith(m + ".")
                               and m != "trainer"}
             for p in paths}
    state, path, cycles = {}, [], []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert cycles == []
    assert "trainer.serving" in graph["trainer.trainer"]  # the walk sees function-level imports


def test_no_module_imports_a_private_name_of_another():
    """A ``_name`` is its module's own; a package's private submodule (``native._store``,
    ``pipelines._coders``) is its package's, imported within it only."""
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py*"))]
    modules = {_module_name(p) for p in paths}  # .py and .pyi: native._store is compiled
    offences = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                        node.module.split(".")[0] in PACKAGES:
                    private = [a.name for a in node.names
                               if a.name.startswith("_") and not a.name.startswith("__")
                               and not (f"{node.module}.{a.name}" in modules
                                        and node.module.split(".")[0] == package)]
                    if private:
                        offences.append(f"{path.relative_to(ROOT)}: from {node.module} import "
                                        f"{', '.join(private)}")
    assert offences == []


def test_commands_import_no_other_command():
    commands = {"trainer.train", "trainer.evaluate", "trainer.online", "compression.compress",
                "compression.inspect", "pipelines.compress", "pipelines.generate",
                "pipelines.replay", "pipelines.stream_compress", "pipelines.local_broker"}
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    modules = {_module_name(p) for p in paths}
    offences = [f"{_module_name(p)} imports {sorted(_project_imports(p, modules) & commands)}"
                for p in paths if _project_imports(p, modules) & (commands - {_module_name(p)})]
    assert offences == []


def test_a_store_shard_process_loads_neither_tensorflow_nor_ray():
    """Ray pickles the shard actor's class by reference; its process imports
    trainer.distributed.shard, which must not pull in TensorFlow (seconds and hundreds of MB
    per shard) or the driver."""
    assert loaded_by("trainer.distributed.shard", ("tensorflow", "keras", "ray", "trainer.trainer",
                                                  "trainer.distributed.driver")) == []


def test_the_fit_loop_loads_neither_tensorflow_nor_an_engine():
    """trainer.fitting is the one fit loop that Trainer.fit and DistributedTrainer.fit hand
    their arguments to; it knows engines only by what they do."""
    assert loaded_by("trainer.fitting", ("tensorflow", "keras", "ray", "trainer.trainer",
                                         "trainer.model_core", "trainer.distributed.driver")) == []


def test_tensorflow_loads_without_scikit_learn_which_stays_importable():
    """keras imports scikit-learn for wrappers prefixrec does not use (~1 CPU-s of every
    process that loads TensorFlow): trainer/_no_sklearn.py hides it while keras and
    TensorFlow load, however TensorFlow is reached first; a later ``import sklearn`` works,
    and a process that imported it before keras keeps it."""
    code = ("import sys, trainer.serving, trainer.model_core, keras, tensorflow\n"
            "before = [m for m in ('tensorflow', 'keras', 'sklearn') if m in sys.modules]\n"
            "import sklearn.linear_model\n"
            "print([before, sys.modules['sklearn'] is not None, "
            "type(keras.__loader__).__name__])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert ast.literal_eval(out.stdout.strip().splitlines()[-1]) == [
        ["tensorflow", "keras"], True, "SourceFileLoader"]
    assert loaded_by("sklearn, trainer.model_core", ("sklearn", "keras.src.wrappers")) == [
        "sklearn", "keras.src.wrappers"]
