"""Keras without scikit-learn: what every process that loads TensorFlow saves at start-up.

Keras 3 imports scikit-learn whenever it is installed, for its scikit-learn wrappers
(``keras/src/wrappers``: ``try: import sklearn`` in three modules), which prefixrec never uses.
That import costs ~1-2 CPU-s per process (measured in benchmarks/RESULTS.md, "Test suite time"),
paid by every command, every Ray actor and every test child that loads TensorFlow; scikit-learn
is installed here only for ``benchmarks/quality.py``.

:func:`install` (called by ``trainer/__init__.py``, so it holds however TensorFlow is reached)
puts a one-shot finder in front of ``sys.meta_path``. While the ``keras`` and ``tensorflow``
packages are executed for the first time, ``sys.modules["sklearn"]`` is ``None``, so keras'
``import sklearn`` raises ImportError, the case keras handles (its wrappers then say
scikit-learn is missing); the entry is removed as soon as they are loaded, so a later
``import sklearn`` works as usual. A process that imported scikit-learn before keras keeps the
wrappers (nothing is hidden then). During those seconds another thread's ``import sklearn``
would fail too; no thread of prefixrec imports it.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading

# keras imports sklearn while it loads, and TensorFlow imports keras.wrappers (through
# keras._tf_keras) while *it* loads, also when keras was loaded before it: both are covered.
_PACKAGES = ("keras", "tensorflow")
_lock = threading.Lock()
_installed = False


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loaders of the first ``keras`` and ``tensorflow`` imports, then leaves."""

    def __init__(self):
        self.pending = set(_PACKAGES)

    def find_spec(self, name, path=None, target=None):
        if name not in self.pending:
            return None
        with _lock:
            self.pending.discard(name)
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _HidingLoader(spec.loader)
        return spec


class _HidingLoader(importlib.abc.Loader):
    """Runs the real loader with ``sklearn`` unimportable; the module keeps the real loader."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        hide = "sklearn" not in sys.modules
        if hide:
            sys.modules["sklearn"] = None
        try:
            self.loader.exec_module(module)
        finally:
            if hide and "sklearn" in sys.modules and sys.modules["sklearn"] is None:
                del sys.modules["sklearn"]


def install() -> None:
    """Hide scikit-learn from the first import of keras and TensorFlow in this process (no-op
    once either is loaded, or when called again)."""
    global _installed
    with _lock:
        if _installed or any(name in sys.modules for name in _PACKAGES):
            return
        _installed = True
        sys.meta_path.insert(0, _Finder())
