"""CUDA torch tensors on the CUDA kernels: against the fp64 oracle, CUDA-graph capture and replay,
torch.compile(fullgraph=True), a non-default stream, and the CUDA-only errors. Skipped, with the
reason, where torch has no CUDA device or flashkda was built without its kernels."""

import os
import re

import numpy as np
import pytest

import flashkda
from kda_helpers import BAR, K, check_against_oracle, make_problem, needs_cuda, oracle, rel, run_forward, to_torch

torch = pytest.importorskip("torch", reason="torch is not installed: the GPU suite needs CUDA torch")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX beside torch on one GPU

pytestmark = needs_cuda  # a GPU torch and a flashkda built with its kernels


def cuda_problem(**kw):
    return to_torch(make_problem(**kw), "cuda")


@pytest.mark.parametrize("state", [None, "float32", "bfloat16"])
@pytest.mark.parametrize("T", [1, 15, 16, 17, 200])
def test_batched_against_oracle(T, state):
    p = cuda_problem(B=2, T=T, H=4, state=state, seed=T)
    out, final_state = run_forward(p, output_final_state=True)
    assert out.is_cuda and out.dtype == torch.bfloat16
    check_against_oracle(p, out, final_state)


@pytest.mark.parametrize("cu_dtype", ["int32", "int64"])
@pytest.mark.parametrize("state", [None, "float32", "bfloat16"])
def test_varlen_with_empty_sequences(cu_dtype, state):
    p = cuda_problem(lengths=[0, 1, 0, 15, 16, 17, 0, 300, 2], H=3, state=state, cu_dtype=cu_dtype, seed=5)
    out, final_state = run_forward(p, output_final_state=True)
    check_against_oracle(p, out, final_state)


def test_long_sequence_bars():
    """docs/contract.md's bar: rel <= 3e-3 for sequences up to 8192 tokens (bf16 state in and out)."""
    p = cuda_problem(B=1, T=8192, H=4, state="bfloat16", seed=1)
    out, final_state = run_forward(p, output_final_state=True)
    e_out, e_state = check_against_oracle(p, out, final_state)
    print(f"T=8192 H=4 bf16 state: rel out {e_out:.2e}, final_state {e_state:.2e}")


def test_compat_fwd_writes_in_place():
    """The compat call writes out and final_state in place on the device."""
    import flashkda as flash_kda

    p = cuda_problem(lengths=[40, 0, 77], state="float32", seed=6)
    out = torch.zeros(1, 117, 2, K, dtype=torch.bfloat16, device="cuda")
    final_state = torch.zeros_like(p["initial_state"])
    assert flash_kda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], K ** -0.5, out, p["A_log"], p["dt_bias"], -5.0,
                         initial_state=p["initial_state"], final_state=final_state,
                         cu_seqlens=p["cu_seqlens"]) is None
    check_against_oracle(p, out, final_state)


def test_check_cu_seqlens_off_and_bad_offsets_refused():
    p = cuda_problem(lengths=[30, 0, 50], state="float32", seed=8)
    out, final_state = run_forward(p, output_final_state=True, check_cu_seqlens=False)
    check_against_oracle(p, out, final_state)
    bad = dict(p, cu_seqlens=torch.tensor([0, 40, 30, 80], device="cuda"))
    with pytest.raises(ValueError, match="non-decreasing"):
        run_forward(bad, output_final_state=True)


def test_cuda_graph_capture_and_replay():
    p = cuda_problem(lengths=[33, 0, 64, 17], state="bfloat16", seed=10)
    static = {name: (None if x is None else x.clone()) for name, x in p.items()}

    def step():
        return run_forward(static, output_final_state=True)  # check_cu_seqlens stays on: skipped while capturing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_state = step()
    for seed in (11, 12):
        fresh = cuda_problem(lengths=[33, 0, 64, 17], state="bfloat16", seed=seed)
        for name, x in fresh.items():
            if x is not None and name != "cu_seqlens":
                static[name].copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        check_against_oracle(fresh, graph_out, graph_state)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    p = cuda_problem(lengths=[100, 0, 28], state="float32", seed=13)

    def layer(q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens):
        out, final_state = flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=state,
                                            cu_seqlens=cu_seqlens, output_final_state=True)
        return out * 2, final_state

    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], p["initial_state"],
            p["cu_seqlens"])
    out2, final_state = torch.compile(layer, fullgraph=True)(*args)
    check_against_oracle(p, out2 / 2, final_state)


def test_torch_compile_reduce_overhead_cuda_graphs():
    torch._dynamo.reset()
    p = cuda_problem(B=2, T=64, state=None, seed=14)

    def f(q, k, v, g, beta, A_log, dt_bias):
        return flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, output_final_state=True)

    compiled = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"])
    for _ in range(3):
        out, final_state = compiled(*args)
    check_against_oracle(p, out.clone(), final_state.clone())


def test_non_default_stream():
    p = cuda_problem(lengths=[70, 0, 90], state="float32", seed=15)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps `side` busy: the forward must queue behind it
        # check_cu_seqlens=False: the host check would wait for the stream (by design).
        out, final_state = run_forward(p, output_final_state=True, check_cu_seqlens=False)
    assert not side.query(), "the forward did not wait on the caller's stream"
    side.synchronize()
    check_against_oracle(p, out, final_state)


def test_other_device_index_guard():
    if torch.cuda.device_count() < 2:
        pytest.skip("one CUDA device: the device guard is exercised with two")
    p = to_torch(make_problem(T=40, state="float32"), "cuda:1")
    out, final_state = run_forward(p, output_final_state=True)
    assert out.device == torch.device("cuda:1")
    check_against_oracle(p, out, final_state)


def test_cuda_errors():
    p = cuda_problem(T=32, state="float32")
    with pytest.raises(ValueError, match=re.escape("A_log: is on cpu but q is on cuda:0")):
        run_forward(dict(p, A_log=p["A_log"].cpu()))
    # The softplus gate runs (on the chunked prefill).
    out, final_state = run_forward(p, gate="softplus", output_final_state=True)
    check_against_oracle(p, out, final_state, gate="softplus")
    with pytest.raises(TypeError, match=re.escape("v: expected dtype bfloat16, got float16")):
        run_forward(dict(p, v=p["v"].half()))


def test_cupy_arrays():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    p = cuda_problem(lengths=[20, 30], state="float32", seed=16)
    try:
        pc = {name: (None if x is None else cupy.from_dlpack(x)) for name, x in p.items()}
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"CuPy cannot hold these tensors (bfloat16): {e}")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out, final_state = run_forward(pc, output_final_state=True)
    stream.synchronize()
    assert type(out).__module__.startswith("cupy")
    check_against_oracle(p, torch.from_dlpack(out), torch.from_dlpack(final_state))


def test_jax_gpu_arrays():
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    gpus = [d for d in jax.devices() if d.platform == "gpu"] if jax.default_backend() == "gpu" else []
    if not gpus:
        pytest.skip("JAX has no GPU backend here")
    import jax.numpy as jnp

    p = make_problem(lengths=[25, 0, 40], state="bfloat16", seed=17)
    pj = {name: (None if x is None else jax.device_put(jnp.asarray(x), gpus[0])) for name, x in p.items()}
    out, final_state = run_forward(pj, output_final_state=True)
    ref_out, ref_state = oracle(p)
    assert rel(np.asarray(out, dtype=np.float64), ref_out) <= BAR
    assert rel(np.asarray(final_state, dtype=np.float64), ref_state) <= BAR


def test_python_overhead_report():
    """Not a bar: prints the host time of one small call (DLPack imports, checks, launch)."""
    import time

    p = cuda_problem(B=1, T=16, state=None)
    for _ in range(3):
        run_forward(p, check_cu_seqlens=False)
    torch.cuda.synchronize()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        run_forward(p, check_cu_seqlens=False)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"host time per flashkda.forward call (T=16, H=2): {(t1 - t0) / n * 1e6:.1f} us")
