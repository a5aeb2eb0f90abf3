"""Build description of the native embedding store extension (``native._store``).

setup.py calls :func:`extensions`; building needs only a C++17 compiler and pybind11 (the
binding uses pybind11's own numpy support, so numpy headers are not needed).
Set ``PREFIXREC_SANITIZE=1`` to build with AddressSanitizer + UndefinedBehaviorSanitizer
(used by ``make test-asan``).
"""
import glob
import os


def extensions(root):
    """The list of setuptools extensions for native/, with paths relative to ``root``."""
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension  # build-time

    # the sources compile on every core (a fresh install waited ~45 s on one of two);
    # PREFIXREC_BUILD_JOBS=N sets the number
    ParallelCompile("PREFIXREC_BUILD_JOBS").install()

    # the native core (native/src/*.cc) and its Python binding, one file per bound class or
    # area (native/src/bindings/*.cc; the C++ unit tests build the core without it)
    sources = sorted(
        os.path.relpath(path, root)
        for pattern in ("native/src/*.cc", "native/src/bindings/*.cc")
        for path in glob.glob(os.path.join(root, pattern))
    )
    headers = sorted(
        os.path.relpath(path, root)
        for pattern in ("native/include/prefixrec/*.h", "native/src/internal/*.h",
                        "native/src/bindings/*.h")
        for path in glob.glob(os.path.join(root, pattern))
    )
    compile_args = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden", "-Wall", "-Wextra"]
    link_args = ["-pthread"]
    if os.environ.get("PREFIXREC_SANITIZE") == "1":
        sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                    "-fno-sanitize-recover=undefined"]
        compile_args = ["-O1", "-g", "-ffp-contract=off", "-fno-math-errno"] + sanitize
        link_args += sanitize
    return [
        Pybind11Extension(
            "native._store",
            sources,
            depends=headers,  # setuptools does not scan includes: rebuild on any header change
            include_dirs=[os.path.join("native", "include"), os.path.join("native", "src")],
            cxx_std=17,
            extra_compile_args=compile_args + ["-pthread"],
            extra_link_args=link_args,
        )
    ]
