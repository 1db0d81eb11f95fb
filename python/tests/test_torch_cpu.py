"""CPU torch tensors: against the fp64 oracle, the compat fwd() call, errors, the torch.library
custom ops (opcheck) and torch.compile(fullgraph=True) tracing through them."""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the torch suites are skipped")

import flashkda  # noqa: E402
from kda_helpers import K, check_against_oracle, make_problem, run_forward, to_torch  # noqa: E402


@pytest.mark.parametrize("state", [None, "float32", "bfloat16"])
@pytest.mark.parametrize("T", [0, 1, 17, 64])
def test_batched_against_oracle(T, state):
    p = to_torch(make_problem(B=2, T=T, state=state, seed=T))
    out, final_state = run_forward(p, output_final_state=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (2, T, 2, K)
    assert final_state.dtype == (torch.float32 if state is None else p["initial_state"].dtype)
    check_against_oracle(p, out, final_state)


@pytest.mark.parametrize("cu_dtype", ["int32", "int64"])
def test_varlen_with_empty_sequences(cu_dtype):
    p = to_torch(make_problem(lengths=[0, 16, 1, 0, 33, 15, 0], state="bfloat16", cu_dtype=cu_dtype, seed=4))
    out, final_state = run_forward(p, output_final_state=True)
    check_against_oracle(p, out, final_state)


def test_compat_fwd_writes_in_place():
    import flashkda as flash_kda

    p = to_torch(make_problem(lengths=[20, 0, 13], state="float32", seed=9))
    out = torch.zeros(1, 33, 2, K, dtype=torch.bfloat16)
    final_state = torch.zeros_like(p["initial_state"])
    assert flash_kda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], K ** -0.5, out, p["A_log"], p["dt_bias"], -5.0,
                         p["initial_state"], final_state, p["cu_seqlens"]) is None
    check_against_oracle(p, out, final_state)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_out_argument_and_requires_grad_inputs_without_grad_mode(mode):
    p = to_torch(make_problem(T=24, state="float32"))
    A_log = torch.nn.Parameter(p["A_log"].clone())  # module parameters require grad
    q = p["q"].clone().requires_grad_()
    out = torch.empty(1, 24, 2, K, dtype=torch.bfloat16)
    with getattr(torch, mode)():
        got, final_state = flashkda.forward(q, p["k"], p["v"], p["g"], p["beta"], A_log=A_log,
                                            dt_bias=p["dt_bias"], initial_state=p["initial_state"], out=out,
                                            output_final_state=True)
        fwd_out = torch.empty_like(out)
        assert flashkda.fwd(q, p["k"], p["v"], p["g"], p["beta"], K ** -0.5, fwd_out, A_log, p["dt_bias"], -5.0,
                            p["initial_state"]) is None
    assert got is out and not out.requires_grad and not final_state.requires_grad
    check_against_oracle(p, out, final_state)
    assert torch.equal(fwd_out, out)


# ---------------------------------------------------------------------------------------------
# Inference only: tensors that require grad are refused while grad mode is on

def _assert_inference_only_message(message, name):
    assert message.startswith(f"{name}: requires grad"), message
    for part in ("inference only", "no backward", "torch.no_grad()", "torch.inference_mode()", f"{name}.detach()"):
        assert part in message, (part, message)


@pytest.mark.parametrize("name", ["q", "beta", "A_log", "dt_bias", "initial_state"])
def test_requires_grad_under_grad_mode_refused_by_forward(name):
    p = to_torch(make_problem(T=12, state="float32"))
    p[name] = torch.nn.Parameter(p[name].clone()) if p[name].is_floating_point() else p[name]
    assert torch.is_grad_enabled() and p[name].requires_grad
    with pytest.raises(RuntimeError) as info:
        run_forward(p, output_final_state=True)
    _assert_inference_only_message(str(info.value), name)


@pytest.mark.parametrize("name", ["k", "A_log", "out", "final_state"])
def test_requires_grad_under_grad_mode_refused_by_fwd(name):
    p = to_torch(make_problem(T=12, state="float32"))
    p["out"] = torch.full((1, 12, 2, K), 3.0, dtype=torch.bfloat16)
    p["final_state"] = torch.full_like(p["initial_state"], 3.0)
    p[name] = p[name].clone().requires_grad_()
    with pytest.raises(RuntimeError) as info:
        flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], K ** -0.5, p["out"], p["A_log"], p["dt_bias"], -5.0,
                     p["initial_state"], p["final_state"])
    _assert_inference_only_message(str(info.value), name)
    assert (p["out"].detach() == 3).all() and (p["final_state"].detach() == 3).all()  # nothing written


def test_requires_grad_beside_numpy_q():
    """The check is the API's, whatever the framework of q: a torch parameter beside NumPy arrays."""
    p = make_problem(T=10, state=None)
    A_log = torch.nn.Parameter(torch.from_numpy(p["A_log"].copy()))
    with pytest.raises(RuntimeError) as info:
        run_forward(dict(p, A_log=A_log))
    _assert_inference_only_message(str(info.value), "A_log")
    with torch.no_grad():
        out, _ = run_forward(dict(p, A_log=A_log))
    check_against_oracle(p, out, None)


def _compile_available():
    try:
        import torch._dynamo

        return torch._dynamo.is_dynamo_supported()
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.skipif(not _compile_available(), reason="torch.compile (dynamo) is not supported on this platform")
@pytest.mark.parametrize("call", ["forward", "fwd"])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_requires_grad_under_torch_compile(call, fullgraph):
    torch._dynamo.reset()
    p = to_torch(make_problem(T=9, state=None, seed=17))
    A_log = torch.nn.Parameter(p["A_log"].clone())

    def step(q, k, v, g, beta, A_log, dt_bias):
        if call == "forward":
            return flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias)[0]
        out = torch.empty_like(v)
        flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0)
        return out

    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], A_log, p["dt_bias"])
    compiled = torch.compile(step, fullgraph=fullgraph, backend="aot_eager")
    # Without fullgraph the error itself comes out (the check runs eagerly after a graph break);
    # with it, dynamo's RuntimeError carries the message.
    with pytest.raises(RuntimeError, match=r"A_log: requires grad, but flashkda is inference only") as info:
        compiled(*args)
    assert "torch.no_grad()" in str(info.value)
    with torch.no_grad():
        got = compiled(*args)
    assert not got.requires_grad
    check_against_oracle(p, got, None)


# ---------------------------------------------------------------------------------------------
# Arguments that are not tensors, missing tensors, scalars

TENSOR_ARGS = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens"]


def _fwd(p, **changes):
    d = dict(p, **changes)
    return flashkda.fwd(d["q"], d["k"], d["v"], d["g"], d["beta"], d.get("scale", K ** -0.5), d["out"], d["A_log"],
                        d["dt_bias"], d.get("lower_bound", -5.0), d["initial_state"], d.get("final_state"),
                        d["cu_seqlens"])


def _fwd_problem():
    p = to_torch(make_problem(lengths=[6, 0, 7], state="float32", seed=2))
    p["out"] = torch.zeros(1, 13, 2, K, dtype=torch.bfloat16)
    p["final_state"] = torch.zeros_like(p["initial_state"])
    return p


@pytest.mark.parametrize("name", TENSOR_ARGS)
def test_list_argument_is_a_type_error_naming_it(name):
    p = to_torch(make_problem(lengths=[5, 3], state="float32"))
    expected = (f"{name}: expected a tensor or array (torch, NumPy, CuPy, JAX; anything with DLPack or the buffer "
                "protocol), got list")
    with pytest.raises(TypeError, match=re.escape(expected)):
        run_forward(dict(p, **{name: p[name].tolist()}), output_final_state=True)
    pf = _fwd_problem()
    with pytest.raises(TypeError, match=re.escape(expected)):
        _fwd(pf, **{name: pf[name].tolist()})


@pytest.mark.parametrize("name", ["out", "final_state"])
def test_list_output_is_a_type_error_naming_it(name):
    p = _fwd_problem()
    with pytest.raises(TypeError, match=re.escape(f"{name}: expected a tensor or array")):
        _fwd(p, **{name: p[name].tolist()})


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "A_log", "dt_bias"])
def test_none_for_a_required_tensor_names_it(name):
    p = to_torch(make_problem(T=8, state="float32"))
    with pytest.raises(TypeError, match=re.escape(f"{name}: required tensor is missing")):
        run_forward(dict(p, **{name: None}))
    with pytest.raises(TypeError, match=re.escape(f"{name}: required tensor is missing")):
        _fwd(_fwd_problem(), **{name: None})


def test_none_for_out_in_fwd_names_it():
    with pytest.raises(TypeError, match=re.escape("out: required tensor is missing")):
        _fwd(_fwd_problem(), out=None)


def test_fwd_scale_none_means_k_to_the_minus_half():
    p = _fwd_problem()
    _fwd(p, scale=None)
    explicit = torch.zeros_like(p["out"])
    _fwd(p, scale=K ** -0.5, out=explicit, final_state=torch.zeros_like(p["final_state"]))
    assert torch.equal(p["out"], explicit)
    out, _ = run_forward(p)  # forward's scale=None
    assert torch.equal(out, explicit)
    check_against_oracle(p, p["out"], p["final_state"])


@pytest.mark.parametrize("name, value, type_name", [
    ("scale", "0.1", "str"), ("scale", [0.1], "list"), ("scale", 1j, "complex"),
    ("lower_bound", "x", "str"), ("lower_bound", None, "NoneType"), ("lower_bound", True, "bool"),
])
def test_non_number_scalars_are_type_errors_naming_them(name, value, type_name):
    message = re.escape(f"{name}: expected a real number, got {type_name}")
    with pytest.raises(TypeError, match=message):
        _fwd(_fwd_problem(), **{name: value})
    with pytest.raises(TypeError, match=message):
        run_forward(to_torch(make_problem(T=8, state=None)), **{name: value})


def test_number_like_scalars_are_accepted():
    """NumPy scalars and one-element tensors are numbers (as float() took them before)."""
    p = _fwd_problem()
    _fwd(p, scale=np.float32(0.25), lower_bound=torch.tensor(-3.0))
    check_against_oracle(p, p["out"], p["final_state"], scale=0.25, lower_bound=-3.0)


# ---------------------------------------------------------------------------------------------
# Meta and float8 tensors: the real reason

@pytest.mark.parametrize("name", ["q", "k", "A_log", "initial_state"])
def test_meta_tensor_names_the_meta_device(name):
    p = to_torch(make_problem(T=8, state="float32"))
    expected = f"{name}: tensors on the meta device have no data (device meta)"
    with pytest.raises(ValueError, match=re.escape(expected)):
        run_forward(dict(p, **{name: p[name].to("meta")}), output_final_state=True)
    pf = _fwd_problem()
    with pytest.raises(ValueError, match=re.escape(expected)):
        _fwd(pf, **{name: pf[name].to("meta")})


def test_all_meta_tensors_refused_eagerly_but_traced_by_the_custom_ops():
    p = to_torch(make_problem(lengths=[3, 4], state="bfloat16"))
    meta = {name: (None if x is None else x.to("meta")) for name, x in p.items()}
    with pytest.raises(ValueError, match=re.escape("q: tensors on the meta device have no data (device meta)")):
        run_forward(meta, output_final_state=True)
    # The fake implementations (what torch.compile traces) take meta tensors.
    out, final_state = torch.ops.flashkda.forward(*_op_args(meta))
    assert out.device.type == "meta" and out.shape == (1, 7, 2, K) and out.dtype == torch.bfloat16
    assert final_state.device.type == "meta" and final_state.shape == (2, 2, K, K)
    out = torch.empty(1, 7, 2, K, dtype=torch.bfloat16, device="meta")
    assert torch.ops.flashkda.forward_out(meta["q"], meta["k"], meta["v"], meta["g"], meta["beta"], meta["A_log"],
                                          meta["dt_bias"], meta["initial_state"], meta["cu_seqlens"], out,
                                          torch.empty_like(meta["initial_state"]), None, None, -5.0, K ** -0.5, 0,
                                          True) is None


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8 dtypes")
@pytest.mark.parametrize("name, dtype, expected", [
    ("q", "float8_e4m3fn", "q: expected dtype bfloat16, got float8_e4m3fn"),
    ("v", "float8_e5m2", "v: expected dtype bfloat16, got float8_e5m2"),
    ("A_log", "float8_e4m3fn", "A_log: expected dtype float32, got float8_e4m3fn"),
    ("initial_state", "float8_e5m2", "initial_state: expected dtype bfloat16 or float32, got float8_e5m2"),
])
def test_float8_tensor_names_its_dtype(name, dtype, expected):
    p = to_torch(make_problem(T=8, state="float32"))
    bad = p[name].to(getattr(torch, dtype))
    with pytest.raises(TypeError, match=re.escape(expected)):
        run_forward(dict(p, **{name: bad}), output_final_state=True)
    pf = _fwd_problem()
    with pytest.raises(TypeError, match=re.escape(expected)):
        _fwd(pf, **{name: pf[name].to(getattr(torch, dtype))})


def test_float8_numpy_array_beside_torch_tensors():
    """An ml_dtypes float8 array torch cannot import: the extension's words, not torch's."""
    import ml_dtypes

    p = to_torch(make_problem(T=8, state=None))
    k = make_problem(T=8, state=None)["k"].astype(ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match=re.escape("k: expected dtype bfloat16, got float8_e4m3fn")):
        run_forward(dict(p, k=k))


# ---------------------------------------------------------------------------------------------
# Empty optional tensors are given (and then checked), not taken for absent ones

def test_empty_initial_state_is_refused():
    p = _fwd_problem()
    with pytest.raises(ValueError, match=re.escape("initial_state: expected shape [3, 2, 128, 128] [N, H, V, K], "
                                                   "got [0, 2, 128, 128]")):
        _fwd(p, initial_state=torch.empty(0, 2, K, K), final_state=p["final_state"])
    with pytest.raises(ValueError, match=re.escape("initial_state: expected shape [3, 2, 128, 128]")):
        run_forward(dict(p, initial_state=torch.empty(0, 2, K, K)), output_final_state=True)


def test_empty_final_state_is_refused():
    p = _fwd_problem()
    p["out"].fill_(3)
    with pytest.raises(ValueError, match=re.escape("final_state: expected shape [3, 2, 128, 128] [N, H, V, K], "
                                                   "got [0, 2, 128, 128]")):
        _fwd(p, final_state=torch.empty(0, 2, K, K))
    assert (p["out"] == 3).all()  # refused before anything is written


@pytest.mark.parametrize("call", ["fwd", "forward"])
def test_empty_cu_seqlens_is_refused(call):
    p = _fwd_problem()
    empty = torch.empty(0, dtype=torch.int64)
    message = re.escape("cu_seqlens: expected at least 2 entries [N + 1] for N >= 1 sequences, got 0")
    with pytest.raises(ValueError, match=message):
        if call == "fwd":
            _fwd(p, cu_seqlens=empty, initial_state=None, final_state=None)
        else:
            run_forward(dict(p, cu_seqlens=empty, initial_state=None), output_final_state=True)


def test_token_major_views_equal_contiguous_inputs():
    """k stored head-major ([B, H, T, K]) and viewed as [B, T, H, K]: a strided view the library
    reads in place, with the contiguous result bit for bit."""
    p = to_torch(make_problem(T=40, state="float32"))
    want_out, want_state = run_forward(p, output_final_state=True)
    strided = dict(p, k=p["k"].transpose(1, 2).contiguous().transpose(1, 2))
    assert not strided["k"].is_contiguous()
    out, state = run_forward(strided, output_final_state=True)
    assert torch.equal(out, want_out) and torch.equal(state, want_state)


def test_errors_name_the_argument():
    p = to_torch(make_problem(T=16, state="float32"))
    with pytest.raises(TypeError, match=re.escape("q: expected dtype bfloat16, got float32")):
        run_forward(dict(p, q=p["q"].float()))
    # k with its channels strided (stored [B, T, K, H]): the last dimension must be contiguous
    with pytest.raises(ValueError, match=re.escape("k: expected the last dimension contiguous (stride 1)")):
        run_forward(dict(p, k=p["k"].transpose(2, 3).contiguous().transpose(2, 3)))
    with pytest.raises(ValueError, match=re.escape("A_log: expected a contiguous (dense, row-major) tensor")):
        run_forward(dict(p, A_log=torch.stack([p["A_log"], p["A_log"]], dim=1)[:, 0]))
    with pytest.raises(ValueError, match=re.escape("gate: expected 'safe' or 'softplus', got 'SAFE'")):
        run_forward(p, gate="SAFE")
    with pytest.raises(ValueError, match=re.escape("stream: torch tensors run on torch.cuda.current_stream()")):
        run_forward(p, stream=0)
    with pytest.raises(NotImplementedError, match="head dimension K must be 128"):
        run_forward(dict(p, q=p["q"][..., :64].contiguous(), k=p["k"][..., :64].contiguous(),
                         g=p["g"][..., :64].contiguous()))
    with pytest.raises(ValueError, match=re.escape("lower_bound: expected a value in [-5, 0) for the safe gate, got 0.5")):
        flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], 0.1, torch.empty_like(p["v"]), p["A_log"],
                     p["dt_bias"], 0.5)


def test_mixed_frameworks_on_cpu():
    """DLPack lets torch and NumPy inputs meet (both host memory); outputs follow q."""
    p = make_problem(T=19, state="float32", seed=12)
    pt = to_torch(p)
    mixed = dict(pt, A_log=p["A_log"], dt_bias=p["dt_bias"], initial_state=p["initial_state"])
    out, final_state = run_forward(mixed, output_final_state=True)
    assert isinstance(out, torch.Tensor) and isinstance(final_state, torch.Tensor)
    check_against_oracle(p, out, final_state)


def _op_args(p, output_final_state=True):
    return (p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], p["initial_state"],
            p["cu_seqlens"], -5.0, K ** -0.5, 0, output_final_state, True)


def test_opcheck_functional_op():
    p = to_torch(make_problem(lengths=[5, 0, 11], state="float32"))
    torch.library.opcheck(torch.ops.flashkda.forward.default, _op_args(p))
    torch.library.opcheck(torch.ops.flashkda.forward.default, _op_args(to_torch(make_problem(T=9, state=None)), False))


def test_opcheck_in_place_op():
    p = to_torch(make_problem(T=10, state="bfloat16"))
    out = torch.empty(1, 10, 2, K, dtype=torch.bfloat16)
    final_state = torch.empty_like(p["initial_state"])
    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], p["initial_state"], None, out,
            final_state, None, None, -5.0, K ** -0.5, 0, True)
    torch.library.opcheck(torch.ops.flashkda.forward_out.default, args)


class KDALayer(torch.nn.Module):
    """The shape of a model that calls flashkda: parameters in the module, activations from outside."""

    def __init__(self, H):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.rand(H))
        self.dt_bias = torch.nn.Parameter(torch.rand(H, K))

    def forward(self, q, k, v, g, beta, state, cu_seqlens):
        out, final_state = flashkda.forward(q, k, v, g, beta, A_log=self.A_log, dt_bias=self.dt_bias,
                                            initial_state=state, cu_seqlens=cu_seqlens, output_final_state=True,
                                            lower_bound=-4.0)
        return out.float().sum(dim=-1), final_state * 2


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(dynamic):
    torch._dynamo.reset()
    p = to_torch(make_problem(lengths=[10, 0, 22], state="float32", seed=21))
    layer = KDALayer(2)
    with torch.no_grad():
        layer.A_log.copy_(p["A_log"])
        layer.dt_bias.copy_(p["dt_bias"])
    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["initial_state"], p["cu_seqlens"])
    compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    with torch.no_grad():
        got = compiled(*args)
        want = layer(*args)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_torch_compile_fullgraph_compat_fwd():
    torch._dynamo.reset()
    p = to_torch(make_problem(T=21, state="bfloat16", seed=8))

    def step(q, k, v, g, beta, A_log, dt_bias, state):
        out = torch.empty_like(v)
        final_state = torch.empty_like(state)
        flashkda.fwd(q, k, v, g, beta, K ** -0.5, out, A_log, dt_bias, -5.0, state, final_state)
        return out, final_state

    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], p["initial_state"])
    out, final_state = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    check_against_oracle(p, out, final_state)


def test_torch_compile_inductor():
    """The default backend too: the graph holds the custom op and allocations only."""
    torch._dynamo.reset()
    p = to_torch(make_problem(T=17, state=None, seed=30))

    def f(q, k, v, g, beta, A_log, dt_bias):
        return flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, output_final_state=True)

    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"])
    out, final_state = torch.compile(f, fullgraph=True)(*args)
    check_against_oracle(p, out, final_state)
    np.testing.assert_array_equal(out.float().numpy(), f(*args)[0].float().numpy())


def test_custom_op_and_eager_fast_path_agree():
    """Eager calls skip the custom-op machinery; the registered op computes the same."""
    p = to_torch(make_problem(lengths=[12, 0, 9], state="bfloat16", seed=31))
    out, final_state = run_forward(p, output_final_state=True)
    op_out, op_state = torch.ops.flashkda.forward(*_op_args(p))
    assert torch.equal(out, op_out) and torch.equal(final_state, op_state)


def test_fake_tensor_mode_gives_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = make_problem(lengths=[3, 4], state="bfloat16")
    with FakeTensorMode() as mode:
        fake = {name: (None if x is None else mode.from_tensor(t)) for (name, x), t in
                zip(p.items(), to_torch(p).values())}
        out, final_state = run_forward(fake, output_final_state=True)
    assert out.shape == (1, 7, 2, K) and out.dtype == torch.bfloat16
    assert final_state.shape == (2, 2, K, K) and final_state.dtype == torch.bfloat16
