"""The dependency direction of ARCHITECTURE.md: heavy frameworks stay in their own package."""

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
    tree = ast.parse(path.read_text(), filename=str(path))
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


def test_importing_schemas_and_compression_loads_neither_beam_nor_tensorflow():
    code = ("import sys, schemas, compression, compression.inspect, compression.compress; "
            "print(sorted(m for m in ('apache_beam', 'tensorflow', 'keras', 'confluent_kafka') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def _uses_pyarrow_json(path: pathlib.Path) -> bool:
    """``import pyarrow.json``, ``from pyarrow.json import ...``, ``from pyarrow import json``
    or ``pa.json`` / ``pyarrow.json`` used as an attribute."""
    tree = ast.parse(path.read_text(), filename=str(path))
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
