"""NumPy arrays (bfloat16 through ml_dtypes) on the CPU backend: against the fp64 oracle, the
compat fwd() call, and every bad input with its message."""

import re
import subprocess
import sys

import numpy as np
import pytest

import flashkda
from kda_helpers import BAR, BF16, ml_dtypes, K, check_against_oracle, make_problem, oracle, rel, run_forward


# ---------------------------------------------------------------------------------------------
# Against the oracle

@pytest.mark.parametrize("state", [None, "float32", "bfloat16"])
@pytest.mark.parametrize("T", [0, 1, 15, 16, 17, 100])
def test_batched_against_oracle(T, state):
    p = make_problem(B=2, T=T, state=state, seed=T)
    out, final_state = run_forward(p, output_final_state=True)
    assert isinstance(out, np.ndarray) and out.dtype == BF16 and out.shape == (2, T, 2, K)
    assert final_state.dtype == (np.float32 if state is None else p["initial_state"].dtype)
    assert final_state.shape == (2, 2, K, K)
    check_against_oracle(p, out, final_state)


@pytest.mark.parametrize("cu_dtype", ["int32", "int64"])
@pytest.mark.parametrize("state", ["float32", "bfloat16"])
def test_varlen_with_empty_sequences(cu_dtype, state):
    p = make_problem(lengths=[0, 5, 0, 17, 16, 1, 0, 40, 15], state=state, cu_dtype=cu_dtype, seed=7)
    out, final_state = run_forward(p, output_final_state=True)
    assert final_state.shape == (9, 2, K, K)
    check_against_oracle(p, out, final_state)
    # An empty sequence's final state is its initial state.
    np.testing.assert_array_equal(final_state[0], p["initial_state"][0])


def test_no_states():
    p = make_problem(T=33, state=None)
    out, final_state = run_forward(p)
    assert final_state is None
    check_against_oracle(p, out, None)


def test_large_state_and_other_scalars():
    p = make_problem(T=40, state="float32", state_scale=1e3, seed=3)
    out, final_state = run_forward(p, output_final_state=True, lower_bound=-1.5, scale=0.3)
    check_against_oracle(p, out, final_state, lower_bound=-1.5, scale=0.3)


def test_softplus_gate_on_cpu():
    p = make_problem(T=50, state="float32", seed=5)
    out, final_state = run_forward(p, output_final_state=True, gate="softplus")
    check_against_oracle(p, out, final_state, gate="softplus")


def test_out_argument_is_written_and_returned():
    p = make_problem(T=20, state=None)
    out = np.full((1, 20, 2, K), 7, dtype=BF16)
    got, _ = run_forward(p, out=out)
    assert got is out
    check_against_oracle(p, out, None)


def test_read_only_inputs_are_accepted():
    p = make_problem(T=18, state="float32")
    for x in p.values():
        if x is not None:
            x.flags.writeable = False
    out, final_state = run_forward(p, output_final_state=True)
    check_against_oracle(p, out, final_state)


def test_oracle_hook_returns_float64():
    p = make_problem(lengths=[3, 0, 4], state="bfloat16")
    ref_out, ref_state = oracle(p)
    assert ref_out.dtype == np.float64 and ref_out.shape == (1, 7, 2, K)
    assert ref_state.dtype == np.float64 and ref_state.shape == (3, 2, K, K)
    np.testing.assert_array_equal(ref_state[1], p["initial_state"][1].astype(np.float64))


# ---------------------------------------------------------------------------------------------
# flash_kda.fwd compatibility

def test_compat_fwd_writes_in_place():
    import flashkda as flash_kda

    p = make_problem(lengths=[9, 0, 30], state="bfloat16", seed=11)
    out = np.zeros((1, 39, 2, K), dtype=BF16)
    final_state = np.zeros_like(p["initial_state"])
    result = flash_kda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], K ** -0.5, out, p["A_log"], p["dt_bias"],
                           -5.0, initial_state=p["initial_state"], final_state=final_state,
                           cu_seqlens=p["cu_seqlens"])
    assert result is None
    check_against_oracle(p, out, final_state)


def test_compat_fwd_check_cu_seqlens_keyword():
    # The keyword-only addition: accepted, and host cu_seqlens are still checked (CPU backend).
    p = make_problem(lengths=[5, 12], state="float32", seed=12)
    out = np.zeros((1, 17, 2, K), dtype=BF16)
    final_state = np.zeros_like(p["initial_state"])
    flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], K ** -0.5, out, p["A_log"], p["dt_bias"], -5.0,
                 p["initial_state"], final_state, p["cu_seqlens"], check_cu_seqlens=False)
    check_against_oracle(p, out, final_state)
    bad = p["cu_seqlens"].copy()
    bad[1] = 20
    with pytest.raises(ValueError, match="cu_seqlens"):
        flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], K ** -0.5, out, p["A_log"], p["dt_bias"], -5.0,
                     p["initial_state"], final_state, bad, check_cu_seqlens=False)


def test_compat_fwd_positional_and_stateless():
    p = make_problem(B=2, T=17, state=None)
    out = np.zeros((2, 17, 2, K), dtype=BF16)
    flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], 0.25, out, p["A_log"], p["dt_bias"], -3.0)
    check_against_oracle(p, out, None, lower_bound=-3.0, scale=0.25)


# ---------------------------------------------------------------------------------------------
# Bad inputs: the exception type and the message (argument, expectation, value)

def _bad(**changes):
    p = make_problem(T=20, state="float32")
    kw = dict(output_final_state=True)
    for name, value in changes.items():
        if name in p:
            p[name] = value(p) if callable(value) else value
        else:
            kw[name] = value
    return p, kw


BAD_INPUTS = {
    "q float32": (lambda: _bad(q=lambda p: p["q"].astype(np.float32)), TypeError,
                  "q: expected dtype bfloat16, got float32"),
    "k uint16": (lambda: _bad(k=lambda p: p["k"].view(np.uint16)), TypeError,
                 "k: expected dtype bfloat16, got uint16"),
    "A_log bfloat16": (lambda: _bad(A_log=lambda p: p["A_log"].astype(BF16)), TypeError,
                       "A_log: expected dtype float32, got bfloat16"),
    "dt_bias float64": (lambda: _bad(dt_bias=lambda p: p["dt_bias"].astype(np.float64)), TypeError,
                        "dt_bias: expected dtype float32, got float64"),
    "initial_state float16": (lambda: _bad(initial_state=lambda p: p["initial_state"].astype(np.float16)),
                              TypeError, "initial_state: expected dtype bfloat16 or float32, got float16"),
    "beta a list": (lambda: _bad(beta=lambda p: p["beta"].tolist()), TypeError, "beta: expected a"),
    "k shape": (lambda: _bad(k=lambda p: p["k"][:, :10].copy()), ValueError,
                "k: expected shape [1, 20, 2, 128]"),
    "q 3-D": (lambda: _bad(q=lambda p: p["q"][0]), ValueError, "q: expected 4 dimensions [B, T, H, K]"),
    "beta shape": (lambda: _bad(beta=lambda p: p["beta"][..., :1].copy()), ValueError,
                   "beta: expected shape [1, 20, 2] [B, T, H]"),
    "A_log shape": (lambda: _bad(A_log=lambda p: np.zeros(3, np.float32)), ValueError,
                    "A_log: expected shape [2] [H]"),
    "head size 64": (lambda: _bad(**{n: (lambda p, n=n: p[n][..., :64].copy()) for n in ("q", "k", "g")}),
                     NotImplementedError, "q: head dimension K must be 128"),
    "v tokens reversed": (lambda: _bad(v=lambda p: p["v"][:, ::-1]), ValueError,
                          "v: negative strides are not supported"),
    "initial_state transposed": (lambda: _bad(initial_state=lambda p: p["initial_state"].transpose(0, 1, 3, 2)),
                                 ValueError, "initial_state: expected a contiguous"),
    "unknown gate": (lambda: _bad(gate="fast"), ValueError, "gate: expected 'safe' or 'softplus', got 'fast'"),
    "lower_bound 0": (lambda: _bad(lower_bound=0.0), ValueError,
                      "lower_bound: expected a value in [-5, 0) for the safe gate, got 0"),
    "lower_bound -6": (lambda: _bad(lower_bound=-6.0), ValueError, "got -6"),
    "scale nan": (lambda: _bad(scale=float("nan")), ValueError, "scale: expected a finite number"),
    "initial_state shape": (lambda: _bad(initial_state=lambda p: np.zeros((1, 2, K, 64), np.float32)), ValueError,
                            "initial_state: expected shape [1, 2, 128, 128] [N, H, V, K]"),
    "cu_seqlens float": (lambda: _bad(cu_seqlens=np.array([0.0, 20.0])), TypeError,
                         "cu_seqlens: expected dtype int64 or int32, got float64"),
    "cu_seqlens decreasing": (lambda: _bad(initial_state=None, cu_seqlens=np.array([0, 12, 8, 20])), ValueError,
                              "cu_seqlens: expected non-decreasing values, got cu_seqlens[1] = 12 > cu_seqlens[2] = 8"),
    "cu_seqlens end": (lambda: _bad(initial_state=None, cu_seqlens=np.array([0, 5, 19], np.int32)), ValueError,
                       "to equal the number of tokens T = 20, got 19"),
    "cu_seqlens start": (lambda: _bad(initial_state=None, cu_seqlens=np.array([1, 20])), ValueError,
                         "cu_seqlens: expected cu_seqlens[0] = 0, got 1"),
    "cu_seqlens one entry": (lambda: _bad(initial_state=None, cu_seqlens=np.array([0])), ValueError,
                             "cu_seqlens: expected at least 2 entries"),
    "cu_seqlens with B=2": (lambda: (lambda p: (p, {}))(dict(make_problem(B=2, T=4, state=None),
                                                              cu_seqlens=np.array([0, 8]))),
                            ValueError, "packed sequences need batch size B = 1"),
    "out float32": (lambda: _bad(out=np.zeros((1, 20, 2, K), np.float32)), TypeError,
                    "out: expected dtype bfloat16, got float32"),
    "stream object": (lambda: _bad(stream="s"), TypeError, "stream: expected an int cudaStream_t"),
    # Not arrays, missing arrays, dtypes without a DLPack / buffer export, non-number scalars
    "q a list": (lambda: _bad(q=lambda p: p["q"].tolist()), TypeError,
                 "q: expected a tensor or array (torch, NumPy, CuPy, JAX; anything with DLPack or the buffer "
                 "protocol), got list"),
    "A_log a tuple": (lambda: _bad(A_log=lambda p: tuple(p["A_log"].tolist())), TypeError,
                      "A_log: expected a tensor or array"),
    "q None": (lambda: _bad(q=None), TypeError, "q: required tensor is missing"),
    "A_log None": (lambda: _bad(A_log=None), TypeError, "A_log: required tensor is missing"),
    "dt_bias None": (lambda: _bad(dt_bias=None), TypeError, "dt_bias: required tensor is missing"),
    "q float8": (lambda: _bad(q=lambda p: p["q"].astype(ml_dtypes.float8_e4m3fn)), TypeError,
                 "q: expected dtype bfloat16, got float8_e4m3fn"),
    "initial_state float8": (lambda: _bad(initial_state=lambda p: p["initial_state"].astype(ml_dtypes.float8_e5m2)),
                             TypeError, "initial_state: expected dtype bfloat16 or float32, got float8_e5m2"),
    "out read-only": (lambda: _bad(out=_read_only(np.zeros((1, 20, 2, K), BF16))), TypeError,
                      "out: expected a writable tensor or array (it is written in place), got a read-only"),
    "scale a string": (lambda: _bad(scale="0.1"), TypeError, "scale: expected a real number, got str"),
    "lower_bound None": (lambda: _bad(lower_bound=None), TypeError,
                         "lower_bound: expected a real number, got NoneType"),
    "lower_bound an array": (lambda: _bad(lower_bound=np.array([-1.0, -2.0])), TypeError,
                             "lower_bound: expected a real number, got ndarray"),
}


def _read_only(x):
    x.flags.writeable = False
    return x


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_with_message(case):
    make, exc, message = BAD_INPUTS[case]
    p, kw = make()
    with pytest.raises(exc) as info:
        run_forward(p, **kw)
    assert message in str(info.value)


def test_state_dtype_mismatch_in_fwd():
    p = make_problem(T=8, state="bfloat16")
    out = np.zeros((1, 8, 2, K), dtype=BF16)
    final_state = np.zeros(p["initial_state"].shape, np.float32)
    with pytest.raises(ValueError, match=re.escape("final_state: dtype float32 differs from initial_state's bfloat16")):
        flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], 0.1, out, p["A_log"], p["dt_bias"], -5.0,
                     initial_state=p["initial_state"], final_state=final_state)


def _fwd_problem():
    p = make_problem(lengths=[7, 0, 5], state="bfloat16", seed=14)
    p["out"] = np.full((1, 12, 2, K), 3, dtype=BF16)
    p["final_state"] = np.full_like(p["initial_state"], 3)
    return p


def _fwd(p, **changes):
    d = dict(p, **changes)
    return flashkda.fwd(d["q"], d["k"], d["v"], d["g"], d["beta"], d.get("scale", K ** -0.5), d["out"], d["A_log"],
                        d["dt_bias"], d.get("lower_bound", -5.0), d["initial_state"], d["final_state"], d["cu_seqlens"])


def test_compat_fwd_scale_none_means_k_to_the_minus_half():
    p = _fwd_problem()
    assert _fwd(p, scale=None) is None
    check_against_oracle(p, p["out"], p["final_state"], scale=K ** -0.5)
    explicit = _fwd_problem()
    _fwd(explicit)
    np.testing.assert_array_equal(p["out"].view(np.uint16), explicit["out"].view(np.uint16))
    np.testing.assert_array_equal(p["final_state"].view(np.uint16), explicit["final_state"].view(np.uint16))


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "out"])
def test_compat_fwd_none_for_a_required_tensor_names_it(name):
    p = _fwd_problem()
    with pytest.raises(TypeError, match=re.escape(f"{name}: required tensor is missing")):
        _fwd(p, **{name: None})
    assert (p["final_state"].astype(np.float32) == 3).all()


@pytest.mark.parametrize("name, value, message", [
    ("scale", "0.1", "scale: expected a real number, got str"),
    ("scale", [0.1], "scale: expected a real number, got list"),
    ("lower_bound", "-5", "lower_bound: expected a real number, got str"),
    ("lower_bound", None, "lower_bound: expected a real number, got NoneType"),
])
def test_compat_fwd_non_number_scalars_name_the_argument(name, value, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        _fwd(_fwd_problem(), **{name: value})


def test_compat_fwd_list_argument_names_it():
    p = _fwd_problem()
    with pytest.raises(TypeError, match=re.escape("cu_seqlens: expected a tensor or array")):
        _fwd(p, cu_seqlens=p["cu_seqlens"].tolist())
    with pytest.raises(TypeError, match=re.escape("q: expected a tensor or array")):
        _fwd(p, q=p["q"].tolist())


def test_empty_optional_arrays_are_given_and_checked():
    """Empty arrays are passed, not taken for absent ones (then refused by their shapes)."""
    p = _fwd_problem()
    with pytest.raises(ValueError, match=re.escape("initial_state: expected shape [3, 2, 128, 128] [N, H, V, K], "
                                                   "got [0, 2, 128, 128]")):
        _fwd(p, initial_state=np.empty((0, 2, K, K), BF16))
    with pytest.raises(ValueError, match=re.escape("final_state: expected shape [3, 2, 128, 128] [N, H, V, K], "
                                                   "got [0, 2, 128, 128]")):
        _fwd(p, final_state=np.empty((0, 2, K, K), BF16))
    with pytest.raises(ValueError, match=re.escape("cu_seqlens: expected at least 2 entries [N + 1]")):
        _fwd(p, cu_seqlens=np.empty(0, np.int64), initial_state=None, final_state=None)
    assert (p["out"].astype(np.float32) == 3).all()


def test_oracle_hook_validates_before_allocating():
    """The testing hook sizes its buffers from validated shapes only: a [1, 0, 2, 2**40] v (no
    elements) is refused for its head size, not taken for a 2**52-byte state allocation."""
    p = make_problem(T=0, state=None)
    p["v"] = np.empty((1, 0, 2, 2 ** 40), BF16)
    with pytest.raises(NotImplementedError, match=re.escape("v: head dimension V must be 128")):
        oracle(p)
    p = make_problem(T=0, state=None)
    p["cu_seqlens"] = np.arange(2 ** 20, dtype=np.int64)  # 2**20 - 1 sequences for T = 0 tokens
    with pytest.raises(ValueError, match="cu_seqlens"):
        oracle(p)
    with pytest.raises(TypeError, match=re.escape("q: required tensor is missing")):
        oracle(dict(p, q=None))


def test_refused_call_writes_nothing():
    p = make_problem(lengths=[4, 4], state=None)
    p["cu_seqlens"] = np.array([0, 6, 5])
    out = np.full((1, 8, 2, K), 3, dtype=BF16)
    with pytest.raises(ValueError, match="non-decreasing"):
        run_forward(p, out=out)
    assert (out.astype(np.float32) == 3).all()


# ---------------------------------------------------------------------------------------------
# What the build says about itself

def test_info_names_the_backends():
    info = flashkda.info()
    assert info["cuda_kernels"] == flashkda.WITH_CUDA
    usable = flashkda.WITH_CUDA and info["cuda_devices"] > 0
    assert info["backends"] == (["cpu", "cuda"] if usable else ["cpu"])
    assert info["version"] == flashkda.__version__
    text = subprocess.run([sys.executable, "-m", "flashkda"], capture_output=True, text=True, check=True).stdout
    assert "cuda_kernels:" in text and "backends:" in text


@pytest.mark.parametrize("compiled, devices, backends", [
    (True, 0, ["cpu"]),  # kernels built in, but no device visible (CUDA_VISIBLE_DEVICES="", no driver)
    (True, 2, ["cpu", "cuda"]),
    (False, 0, ["cpu"]),
])
def test_info_lists_cuda_only_when_it_can_run(monkeypatch, compiled, devices, backends):
    from flashkda import _ext

    monkeypatch.setattr(_ext, "cuda_compiled", lambda: compiled)
    monkeypatch.setattr(_ext, "cuda_device_count", lambda: devices)
    monkeypatch.setattr(_ext, "cuda_device_name", lambda: "NVIDIA H200" if devices else "")
    info = flashkda.info()
    assert info["backends"] == backends
    assert info["cuda_kernels"] is compiled and info["cuda_devices"] == devices
    assert info["cuda_device_name"] == ("NVIDIA H200" if devices else "")
    assert set(info) == {"version", "cuda_kernels", "backends", "cuda_devices", "cuda_device_name", "torch_ops", "note"}


def test_jax_cpu_arrays():
    jnp = pytest.importorskip("jax.numpy", reason="JAX is not installed")
    p = make_problem(lengths=[7, 0, 12], state="bfloat16", seed=2)
    pj = {name: (None if x is None else jnp.asarray(x)) for name, x in p.items()}
    out, final_state = run_forward(pj, output_final_state=True)
    assert type(out).__module__.startswith("jax") and out.dtype == jnp.bfloat16
    assert final_state.dtype == jnp.bfloat16
    e_out = rel(np.asarray(out, dtype=np.float64), oracle(p)[0])
    assert e_out <= BAR
