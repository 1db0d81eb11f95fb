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


def test_out_argument_and_requires_grad_inputs():
    p = to_torch(make_problem(T=24, state="float32"))
    A_log = torch.nn.Parameter(p["A_log"].clone())  # module parameters require grad
    out = torch.empty(1, 24, 2, K, dtype=torch.bfloat16)
    got, final_state = flashkda.forward(p["q"], p["k"], p["v"], p["g"], p["beta"], A_log=A_log,
                                        dt_bias=p["dt_bias"], initial_state=p["initial_state"], out=out,
                                        output_final_state=True)
    assert got is out
    check_against_oracle(p, out, final_state)


def test_errors_name_the_argument():
    p = to_torch(make_problem(T=16, state="float32"))
    with pytest.raises(TypeError, match=re.escape("q: expected dtype bfloat16, got float32")):
        run_forward(dict(p, q=p["q"].float()))
    with pytest.raises(ValueError, match=re.escape("k: expected a contiguous (dense, row-major) tensor")):
        run_forward(dict(p, k=p["k"].transpose(1, 2).contiguous().transpose(1, 2)))
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
            final_state, -5.0, K ** -0.5, 0, True)
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
