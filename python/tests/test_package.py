"""What `pip install .` declares: the runtime dependencies NumPy callers need."""

import importlib.metadata
import pathlib
import re

import pytest

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"


def _names(requirements):
    """Distribution names of requirement strings, normalised (PEP 503), without extras' markers."""
    names = set()
    for req in requirements or []:
        if "extra ==" in req:
            continue
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1)
        names.add(re.sub(r"[-_.]+", "-", name).lower())
    return names


def test_installed_package_requires_numpy_and_ml_dtypes():
    """NumPy has no bfloat16: NumPy callers need ml_dtypes, so installing flashkda brings it."""
    names = _names(importlib.metadata.requires("flashkda"))
    assert {"numpy", "ml-dtypes"} <= names, names


def test_pyproject_declares_ml_dtypes():
    if not PYPROJECT.exists():
        pytest.skip("pyproject.toml is not beside the tests (installed elsewhere)")
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11+")
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert {"numpy", "ml-dtypes"} <= _names(project["dependencies"]), project["dependencies"]


def test_extension_links_the_shared_libstdcxx():
    """A static libstdc++ inside the extension, beside the shared one torch and numpy load, made
    the first C++ error crash the interpreter on a GPU machine whose compiler wrapper links it
    statically; python/CMakeLists.txt links the shared one there. Reads the ELF NEEDED entries."""
    import shutil
    import subprocess
    import sys

    import flashkda._ext as ext

    if not sys.platform.startswith("linux"):
        pytest.skip("ELF dynamic sections are a Linux matter")
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf is not installed (binutils)")
    dynamic = subprocess.run([readelf, "-d", ext.__file__], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    assert any(n.startswith("libstdc++.so") for n in needed), f"{ext.__file__} needs {needed}"
