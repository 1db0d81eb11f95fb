"""flashkda.register_as_flash_kda(): `import flash_kda` (how fla-based engines reach a
FlashKDA-compatible kernel) resolves to flashkda, by explicit opt-in, in this process only."""

import importlib.util
import re
import subprocess
import sys
import types

import numpy as np
import pytest

import flashkda
from kda_helpers import BF16, K, check_against_oracle, make_problem


@pytest.fixture
def no_flash_kda():
    """No flash_kda in sys.modules during the test; whatever was there before comes back after."""
    saved = sys.modules.pop("flash_kda", None)
    yield
    sys.modules.pop("flash_kda", None)
    if saved is not None:
        sys.modules["flash_kda"] = saved


def _fla_style_call(p, out, final_state):
    """What fla-based code does: import flash_kda, call fwd positionally in flash_kda's order."""
    import flash_kda

    return flash_kda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], K ** -0.5, out, p["A_log"], p["dt_bias"], -5.0,
                         p["initial_state"], final_state, p["cu_seqlens"])


def test_import_flash_kda_runs_flashkda_fwd(no_flash_kda):
    torch = pytest.importorskip("torch", reason="torch is not installed: fla-style code is torch code")
    from kda_helpers import to_torch

    module = flashkda.register_as_flash_kda()
    assert sys.modules["flash_kda"] is module and module.fwd is flashkda.fwd
    assert importlib.util.find_spec("flash_kda") is not None  # how fla probes for the package

    p = to_torch(make_problem(lengths=[11, 0, 20], state="bfloat16", seed=40))
    out = torch.zeros(1, 31, 2, K, dtype=torch.bfloat16)
    final_state = torch.zeros_like(p["initial_state"])
    with torch.inference_mode():
        assert _fla_style_call(p, out, final_state) is None
    want_out = torch.zeros_like(out)
    want_state = torch.zeros_like(final_state)
    flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], K ** -0.5, want_out, p["A_log"], p["dt_bias"], -5.0,
                 p["initial_state"], want_state, p["cu_seqlens"])
    assert torch.equal(out, want_out) and torch.equal(final_state, want_state)
    check_against_oracle(p, out, final_state)

    # fla's keyword form too.
    import flash_kda

    kw_out = torch.zeros_like(out)
    flash_kda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], K ** -0.5, kw_out, A_log=p["A_log"],
                  dt_bias=p["dt_bias"], lower_bound=-5.0, initial_state=p["initial_state"],
                  final_state=torch.zeros_like(final_state), cu_seqlens=p["cu_seqlens"])
    assert torch.equal(kw_out, want_out)


def test_import_flash_kda_with_numpy_arrays(no_flash_kda):
    flashkda.register_as_flash_kda()
    p = make_problem(B=2, T=9, state="float32", seed=41)
    out = np.zeros((2, 9, 2, K), BF16)
    final_state = np.zeros_like(p["initial_state"])
    _fla_style_call(p, out, final_state)
    check_against_oracle(p, out, final_state)


def test_registration_is_idempotent_and_exposes_the_api(no_flash_kda):
    first = flashkda.register_as_flash_kda()
    second = flashkda.register_as_flash_kda()
    assert first is second is sys.modules["flash_kda"]
    assert first.__name__ == "flash_kda"
    assert first.forward is flashkda.forward and first.info is flashkda.info
    assert first.__version__ == flashkda.__version__ and first.WITH_CUDA == flashkda.WITH_CUDA
    import flash_kda

    assert flash_kda is first


def test_refuses_a_different_flash_kda_already_imported(no_flash_kda):
    real = types.ModuleType("flash_kda")
    real.__file__ = "/opt/site-packages/flash_kda/__init__.py"
    real.fwd = lambda *args, **kwargs: None
    sys.modules["flash_kda"] = real
    with pytest.raises(RuntimeError, match=re.escape("a different flash_kda module is already imported")) as info:
        flashkda.register_as_flash_kda()
    assert "/opt/site-packages/flash_kda/__init__.py" in str(info.value)
    assert sys.modules["flash_kda"] is real  # left in place
    import flash_kda

    assert flash_kda is real


def test_not_registered_without_opt_in():
    """Importing flashkda alone puts no flash_kda into sys.modules (a fresh interpreter)."""
    code = ("import sys, flashkda\n"
            "print('flash_kda' in sys.modules)\n"
            "flashkda.register_as_flash_kda()\n"
            "import flash_kda\n"
            "print(flash_kda.fwd is flashkda.fwd)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True"]
