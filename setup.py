"""Packaging for prefixrec: the five top-level packages and the native embedding store.

Dataflow workers install the same code through ``--setup_file ./setup.py``.
"""
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _requirements(name):
    with open(os.path.join(HERE, name)) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def _native_extensions():
    """The pybind11 extension of native/ (empty until its sources exist)."""
    sources = os.path.join(HERE, "native", "src")
    if not os.path.isdir(sources):
        return []
    import sys

    # PEP 517 builds (pip install .) do not put the project directory on sys.path.
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    from native_build import extensions  # noqa: E402  (build helper beside setup.py)

    return extensions(HERE)


setup(
    name="prefixrec",
    version="0.1.0",
    description="Multi-prefix-tree compressed CTR training: Beam compression, structured-compute "
    "TensorFlow trainer, native embedding store, online learning from Kafka.",
    python_requires=">=3.10",
    packages=find_packages(include=["schemas", "schemas.*", "compression", "compression.*",
                                    "pipelines", "pipelines.*", "trainer", "trainer.*",
                                    "native", "native.*"]),
    package_data={"schemas": ["examples/*.yaml"], "native": ["*.pyi", "py.typed"]},
    install_requires=_requirements("requirements.txt"),
    extras_require={"test": _requirements("requirements-test.txt")},
    ext_modules=_native_extensions(),
)
