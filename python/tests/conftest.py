import pytest

import flashkda


def pytest_report_header(config):
    info = flashkda.info()
    try:
        import torch

        torch_line = f"torch {torch.__version__} (cuda available: {torch.cuda.is_available()})"
    except ImportError:
        torch_line = "torch not installed: the torch suites are skipped"
    return [f"flashkda {info['version']}: {info['note']}; cuda devices: {info['cuda_devices']}", torch_line]


@pytest.fixture(autouse=True, scope="session")
def _require_ml_dtypes():
    pytest.importorskip("ml_dtypes", reason="the tests build bfloat16 NumPy inputs with ml_dtypes (pip install ml_dtypes)")
