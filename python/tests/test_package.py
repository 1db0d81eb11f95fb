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
