"""Prefix checkpoints (checkpoint_offsets, checkpoint_state) and fwd's workspace= through the Python
API, on the CPU backend with torch tensors and NumPy arrays: each checkpoint equals, bit for bit,
the float32 final state of a separate prefill of the sequence's first tokens (its inputs sliced)
from the same initial state, and the fp64 oracle's within the bar; offsets 0, a sequence's whole
length, repeated, int64 and int32; unused (negative) entries left as they were; both state
layouts; with state pools; forward's third value; the refusals, each naming its argument;
torch.compile(fullgraph=True), opcheck and FakeTensorMode; JAX refused; workspace= ignored on the
CPU; on CUDA (the chunked prefill and the recurrent kernel) bit for bit against prefix prefills on
the same kernels."""

import inspect
import re

import numpy as np
import pytest

import flashkda
from flashkda import _ext, _frameworks
from kda_helpers import BAR, BF16, K, FakeJaxArray, as_f64, make_problem, rel, to_torch, to_fw, torch, needs_torch, needs_cuda, FRAMEWORKS


H = 2
LENGTHS = [37, 64, 0, 20, 48]  # N = 5: lengths off and on the 16-token grid, an empty sequence
N = len(LENGTHS)
# Per sequence, C = 4 offsets: 0 (the initial state), chunk boundaries, a sequence's whole length
# (64, 48), repeated offsets, unused (-1) entries anywhere.
OFFSETS = [[0, 16, 32, -1], [16, 48, 64, 64], [0, -1, -1, -1], [-1, 0, 16, -1], [-1, 16, 48, 48]]
C = len(OFFSETS[0])
SENTINEL = -7.0  # what checkpoint_state holds before a call
OUT_SENTINEL = 7.0  # what out holds before a call (bfloat16-exact)
LAYOUTS = {"vk": 0, "kv": 1}


# ---------------------------------------------------------------------------------------------
# Helpers: NumPy masters, converted to the framework under test for the call

def problem(seed, initial="float32", lengths=LENGTHS):
    """Inputs and, unless `initial` is None, V-major float32 initial states [N, H, V, K]."""
    return make_problem(lengths=lengths, H=H, state=initial, seed=seed)


def in_layout(state, layout):
    """V-major states [.., V, K] as `layout` (a contiguous copy for "kv")."""
    return None if state is None else (np.ascontiguousarray(state.swapaxes(-1, -2)) if layout == "kv" else state)


def raw(x):
    """The bytes of an array or tensor (for bit-for-bit comparisons)."""
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def offsets(dtype="int64", rows=OFFSETS):
    return np.array(rows, dtype=dtype)


def sentinel_checkpoints():
    """[N, C, H, V, K] (K = V: the K-major shape too) float32, every element SENTINEL."""
    return np.full((N, C, H, K, K), SENTINEL, np.float32)


def sentinel_out(p, fw):
    return to_fw(np.full(p["q"].shape[:3] + (K,), OUT_SENTINEL, dtype=BF16), fw)


def call_args(p, fw):
    return [to_fw(p[name], fw) for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens")]


def prefix(p, n, t, initial):
    """The inputs of a separate prefill of the first t tokens of sequence n (sliced, contiguous),
    starting from `initial` [1, H, ., .] (or None)."""
    bos = int(p["cu_seqlens"][n])
    sl = {name: np.ascontiguousarray(p[name][:, bos:bos + t]) for name in ("q", "k", "v", "g", "beta")}
    sl.update(A_log=p["A_log"], dt_bias=p["dt_bias"], initial_state=initial,
              cu_seqlens=np.array([0, t], dtype=np.int64))
    return sl


def prefix_final_state(p, n, t, fw, layout, initial):
    """The float32 final state (in `layout`, [H, ., .]) of fwd on the first t tokens of sequence n
    alone, from initial[n] (`initial`: [N, H, ., .] in `layout`, or None for zeros)."""
    sl = prefix(p, n, t, None if initial is None else initial[n:n + 1])
    final = to_fw(np.zeros((1, H, K, K), np.float32), fw)
    out = to_fw(np.zeros((1, t, H, K), BF16), fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(sl, fw)
    flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, to_fw(sl["initial_state"], fw), final, cu,
                 state_layout=layout)
    return final[0]


def prefix_oracle(p, n, t, layout, initial):
    """fp64 V-major [H, V, K]: the oracle's state after the first t tokens of sequence n."""
    sl = prefix(p, n, t, None if initial is None else initial[n:n + 1])
    args, views = _frameworks._prepare({name: sl[name] for name in ("q", "k", "v", "g", "beta")})
    _, state = _ext.oracle_forward(args["q"], args["k"], args["v"], args["g"], args["beta"], sl["A_log"],
                                   sl["dt_bias"], sl["initial_state"], sl["cu_seqlens"], -5.0, K ** -0.5, 0, views,
                                   state_layout=LAYOUTS[layout])
    return state[0]


def v_major(state, layout):
    s = as_f64(state)
    return s.swapaxes(-1, -2) if layout == "kv" else s


def check_checkpoints(p, ckpt, rows, fw, layout, initial, oracle=False):
    """Each used entry bit for bit the prefix prefill's final state (and, with `oracle`, within
    the bar of the fp64 oracle); each unused one still the sentinel."""
    for n in range(N):
        for c in range(len(rows[n])):
            t = int(rows[n][c])
            if t < 0:
                assert np.all(as_f64(ckpt[n, c]) == SENTINEL), f"unused entry [{n}, {c}] was written"
                continue
            want = prefix_final_state(p, n, t, fw, layout, initial)
            assert raw(ckpt[n, c]) == raw(want), \
                f"checkpoint [{n}, {c}] at {t} tokens differs from a prefill of those tokens"
            if oracle:
                e = rel(v_major(ckpt[n, c], layout), prefix_oracle(p, n, t, layout, initial))
                assert e <= BAR, f"checkpoint [{n}, {c}] at {t} tokens: rel error {e:.2e} > {BAR}"


def fwd_with_checkpoints(p, fw, layout, initial, rows, offsets_dtype="int64", **kw):
    """fwd on the whole packed batch with checkpoints; returns (out, final_state, checkpoint_state)."""
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    out = sentinel_out(p, fw)
    final = to_fw(np.zeros((N, H, K, K), np.float32), fw)
    ckpt = to_fw(sentinel_checkpoints(), fw)
    assert flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, to_fw(initial, fw), final, cu,
                        state_layout=layout, checkpoint_state=ckpt,
                        checkpoint_offsets=to_fw(offsets(offsets_dtype, rows), fw), **kw) is None
    return out, final, ckpt


# ---------------------------------------------------------------------------------------------
# Against separate prefills of the prefixes, and the oracle

@pytest.mark.parametrize("offsets_dtype", ["int64", "int32"])
@pytest.mark.parametrize("initial", ["float32", None])
@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_fwd_checkpoints_equal_prefix_prefills_bit_for_bit(fw, layout, initial, offsets_dtype):
    p = problem(10 + 4 * LAYOUTS[layout] + 2 * (initial is None) + (offsets_dtype == "int32"), initial)
    init = in_layout(p["initial_state"], layout)
    out, final, ckpt = fwd_with_checkpoints(p, fw, layout, init, OFFSETS, offsets_dtype)
    check_checkpoints(p, ckpt, OFFSETS, fw, layout, init)
    # A checkpoint at a sequence's whole length is its final state; the call's out and final
    # state are those of the same call without checkpoints.
    assert raw(ckpt[1, 3]) == raw(final[1]) and raw(ckpt[4, 3]) == raw(final[4])
    out2, final2 = sentinel_out(p, fw), to_fw(np.zeros((N, H, K, K), np.float32), fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    flashkda.fwd(q, k, v, g, beta, None, out2, A_log, dt_bias, -5.0, to_fw(init, fw), final2, cu, state_layout=layout)
    assert raw(out) == raw(out2) and raw(final) == raw(final2)


@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_checkpoints_within_the_bar_of_the_oracle(fw, layout):
    p = problem(30 + LAYOUTS[layout])
    init = in_layout(p["initial_state"], layout)
    _, _, ckpt = fwd_with_checkpoints(p, fw, layout, init, OFFSETS)
    check_checkpoints(p, ckpt, OFFSETS, fw, layout, init, oracle=True)


@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_forward_returns_checkpoints_as_a_third_value(fw, layout):
    """forward: (out, final_state, checkpoint_state) with checkpoint_offsets; allocated (float32,
    zeros in unused entries, in q's framework) or the given buffer itself; (out, final_state) as
    before without them."""
    p = problem(40)
    init = in_layout(p["initial_state"], layout)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    kw = dict(A_log=A_log, dt_bias=dt_bias, initial_state=to_fw(init, fw), cu_seqlens=cu, state_layout=layout)
    ref_out, ref_final = flashkda.forward(q, k, v, g, beta, output_final_state=True, **kw)

    out, final, ckpt = flashkda.forward(q, k, v, g, beta, output_final_state=True,
                                        checkpoint_offsets=to_fw(offsets(), fw), **kw)
    assert type(ckpt) is type(q) and tuple(ckpt.shape) == (N, C, H, K, K) and str(ckpt.dtype).endswith("float32")
    assert raw(out) == raw(ref_out) and raw(final) == raw(ref_final)
    filled = np.array(as_f64(ckpt))
    for n, c in zip(*np.nonzero(offsets() < 0)):
        assert np.all(filled[n, c] == 0), f"unused entry [{n}, {c}] of an allocated checkpoint_state is not zeros"
        filled[n, c] = SENTINEL
    check_checkpoints(p, filled.astype(np.float32), OFFSETS, fw, layout, init)

    given = to_fw(sentinel_checkpoints(), fw)
    out2, final2, got = flashkda.forward(q, k, v, g, beta, checkpoint_offsets=to_fw(offsets("int32"), fw),
                                         checkpoint_state=given, **kw)
    assert got is given and final2 is None and raw(out2) == raw(ref_out)
    check_checkpoints(p, given, OFFSETS, fw, layout, init)

    # Without checkpoints: the 2-tuple, unchanged.
    assert len(flashkda.forward(q, k, v, g, beta, **kw)) == 2

    if fw == "torch":  # NumPy offsets and cu_seqlens beside torch tensors: states allocated by torch
        kw.update(cu_seqlens=p["cu_seqlens"])
        _, _, mixed = flashkda.forward(q, k, v, g, beta, checkpoint_offsets=offsets(), **kw)
        assert isinstance(mixed, torch.Tensor) and raw(mixed) == raw(ckpt)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_checkpoints_of_pooled_sequences_start_from_their_slots(fw):
    """With state_indices, sequence n's checkpoints start from pool[state_indices[n]] (forward's
    pool path and fwd's pools alike)."""
    p = problem(50)
    pool0 = np.random.default_rng(51).standard_normal((8, H, K, K)).astype(np.float32)
    idx = np.array([6, 1, 3, 0, 5])
    init = pool0[idx]  # what each sequence starts from
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)

    pool = to_fw(pool0.copy(), fw)
    out, got_pool, ckpt = flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                           cu_seqlens=cu, state_indices=to_fw(idx, fw),
                                           checkpoint_offsets=to_fw(offsets(), fw),
                                           checkpoint_state=to_fw(sentinel_checkpoints(), fw))
    assert got_pool is pool
    check_checkpoints(p, ckpt, OFFSETS, fw, "vk", init)

    pool2 = to_fw(pool0.copy(), fw)
    ckpt2 = to_fw(sentinel_checkpoints(), fw)
    flashkda.fwd(q, k, v, g, beta, None, sentinel_out(p, fw), A_log, dt_bias, -5.0, pool2, pool2, cu,
                 state_indices=to_fw(idx, fw), checkpoint_offsets=to_fw(offsets(), fw), checkpoint_state=ckpt2)
    assert raw(ckpt2) == raw(ckpt) and raw(pool2) == raw(pool)


# ---------------------------------------------------------------------------------------------
# Refusals: ValueError (TypeError for types) naming the argument, and nothing written

def _refusal_setup(fw):
    p = problem(60)
    return p, sentinel_out(p, fw), to_fw(sentinel_checkpoints(), fw)


def _nothing_written(out, ckpt):
    assert np.all(as_f64(out) == OUT_SENTINEL) and np.all(as_f64(ckpt) == SENTINEL)


@pytest.mark.parametrize("row, message", [
    ([0, 8, 32, -1], "checkpoint_offsets: checkpoint_offsets[0, 1] = 8 is not a multiple of 16"),
    ([0, 16, 48, -1], "checkpoint_offsets: checkpoint_offsets[0, 2] = 48 is past the end of sequence 0 (37 tokens)"),
    ([0, 32, -1, 16], "checkpoint_offsets: offsets of sequence 0 decrease: [0, 3] = 16 after [0, 1] = 32"),
])
@pytest.mark.parametrize("offsets_dtype", ["int64", "int32"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_bad_offsets_are_refused_naming_the_argument(fw, offsets_dtype, row, message):
    p, out, ckpt = _refusal_setup(fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    bad = to_fw(offsets(offsets_dtype, [row] + OFFSETS[1:]), fw)
    init = to_fw(p["initial_state"], fw)
    with pytest.raises(ValueError, match=re.escape(message)):
        flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, init, None, cu,
                     checkpoint_offsets=bad, checkpoint_state=ckpt)
    with pytest.raises(ValueError, match=re.escape(message)):
        flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=init, cu_seqlens=cu,
                         out=out, checkpoint_offsets=bad, checkpoint_state=ckpt)
    with pytest.raises(ValueError, match=re.escape(message)):  # allocating the states
        flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=init, cu_seqlens=cu,
                         out=out, checkpoint_offsets=bad)
    _nothing_written(out, ckpt)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_checkpoint_arguments_alone_of_the_wrong_shape_or_dtype_are_refused(fw):
    p, out, ckpt = _refusal_setup(fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    offs = to_fw(offsets(), fw)

    def fwd(**kw):
        flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, None, None, cu, **kw)

    def forward(**kw):
        return flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, out=out, **kw)

    both = "; pass both (the offsets [N, C] and the states [N, C, H, V, K] they fill)"
    with pytest.raises(ValueError, match=re.escape("checkpoint_offsets: given without checkpoint_state" + both)):
        fwd(checkpoint_offsets=offs)
    for call in (fwd, forward):
        with pytest.raises(ValueError, match=re.escape("checkpoint_state: given without checkpoint_offsets" + both)):
            call(checkpoint_state=ckpt)
        with pytest.raises(ValueError, match=re.escape("checkpoint_state: expected shape [5, 4, 2, 128, 128] "
                                                       "[N, C, H, V, K], got [5, 4, 2, 128, 64]")):
            call(checkpoint_offsets=offs, checkpoint_state=to_fw(np.zeros((N, C, H, K, 64), np.float32), fw))
        with pytest.raises(ValueError, match=re.escape("checkpoint_state: expected shape [5, 4, 2, 128, 128] "
                                                       "[N, C, H, K, V], got [5, 3, 2, 128, 128]")):
            call(checkpoint_offsets=offs, checkpoint_state=to_fw(np.zeros((N, 3, H, K, K), np.float32), fw),
                 state_layout="kv")
        with pytest.raises(ValueError, match=re.escape("checkpoint_offsets: expected shape [5, 4] [N, C], "
                                                       "got [4, 4]")):
            call(checkpoint_offsets=offs[:4], checkpoint_state=ckpt)
        with pytest.raises(TypeError, match=re.escape("checkpoint_state: expected dtype float32, got bfloat16")):
            call(checkpoint_offsets=offs, checkpoint_state=to_fw(sentinel_checkpoints().astype(BF16), fw))
        with pytest.raises(TypeError, match=re.escape("checkpoint_state: expected dtype float32, got float64")):
            call(checkpoint_offsets=offs, checkpoint_state=to_fw(np.zeros((N, C, H, K, K)), fw))
        with pytest.raises(TypeError, match=re.escape("checkpoint_offsets: expected dtype int64 or int32, "
                                                      "got float32")):
            call(checkpoint_offsets=to_fw(offsets("float32"), fw), checkpoint_state=ckpt)
        with pytest.raises(TypeError, match=re.escape("checkpoint_offsets: expected a tensor or array")):
            call(checkpoint_offsets=OFFSETS, checkpoint_state=ckpt)
        with pytest.raises(TypeError, match=re.escape("checkpoint_state: expected a tensor or array")):
            call(checkpoint_offsets=offs, checkpoint_state=[0.0])
    # forward allocating the states: the offsets' shape is still the C++ validation's to refuse.
    with pytest.raises(ValueError, match=re.escape("checkpoint_offsets: expected 2 dimensions [N, C], got 1 "
                                                   "dimension with shape [5]")):
        forward(checkpoint_offsets=to_fw(np.zeros(N, np.int64), fw))
    with pytest.raises(ValueError, match=re.escape("checkpoint_offsets: expected shape [5, 4] [N, C], got [4, 4]")):
        forward(checkpoint_offsets=offs[:4])
    _nothing_written(out, ckpt)


def test_checkpoint_state_of_jax_arrays_is_refused():
    p, out, ckpt = _refusal_setup("numpy")
    args = [p[name] for name in ("q", "k", "v", "g", "beta")]
    message = re.escape("checkpoint_state: it is written in place, and JAX arrays are immutable")
    with pytest.raises(TypeError, match=message):
        flashkda.fwd(*args, None, out, p["A_log"], p["dt_bias"], -5.0, None, None, p["cu_seqlens"],
                     checkpoint_offsets=offsets(), checkpoint_state=FakeJaxArray(ckpt))
    with pytest.raises(TypeError, match=message):
        flashkda.forward(*args, A_log=p["A_log"], dt_bias=p["dt_bias"], cu_seqlens=p["cu_seqlens"],
                         checkpoint_offsets=offsets(), checkpoint_state=FakeJaxArray(ckpt))
    with pytest.raises(TypeError, match=message):  # beside JAX inputs
        flashkda.forward(FakeJaxArray(args[0]), *args[1:], A_log=p["A_log"], dt_bias=p["dt_bias"],
                         cu_seqlens=p["cu_seqlens"], checkpoint_offsets=offsets(), checkpoint_state=ckpt)
    _nothing_written(out, ckpt)


def test_checkpoints_of_real_jax_arrays():
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    jnp = jax.numpy
    p = problem(70)
    cpu = jax.devices("cpu")[0]  # the CPU backend, as the NumPy prefix prefills it is compared with bit for bit
    pj = {name: (None if x is None else jax.device_put(jnp.asarray(x), cpu)) for name, x in p.items()}
    args = [pj[name] for name in ("q", "k", "v", "g", "beta")]
    kw = dict(A_log=pj["A_log"], dt_bias=pj["dt_bias"], initial_state=pj["initial_state"],
              cu_seqlens=pj["cu_seqlens"], checkpoint_offsets=jax.device_put(jnp.asarray(offsets()), cpu))
    with pytest.raises(TypeError, match=re.escape("checkpoint_state: it is written in place, and JAX arrays are "
                                                  "immutable")):
        flashkda.forward(*args, checkpoint_state=jax.device_put(jnp.zeros((N, C, H, K, K), jnp.float32), cpu), **kw)
    _, _, ckpt = flashkda.forward(*args, **kw)  # allocated: fine for JAX
    filled = np.array(ckpt)
    filled[offsets() < 0] = SENTINEL
    check_checkpoints(p, filled, OFFSETS, "numpy", "vk", p["initial_state"])


# ---------------------------------------------------------------------------------------------
# fwd's interface and workspace=

def test_fwd_takes_the_keywords_of_the_vllm_fork():
    params = inspect.signature(flashkda.fwd).parameters
    for name in ("check_cu_seqlens", "state_indices", "final_state_indices", "state_layout", "checkpoint_state",
                 "checkpoint_offsets", "workspace"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert params["state_layout"].default == "vk"
    assert all(params[name].default is None for name in ("checkpoint_state", "checkpoint_offsets", "workspace"))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_workspace_is_ignored_on_the_cpu(fw):
    p = problem(80)
    init = p["initial_state"]
    want_out, want_final, want_ckpt = fwd_with_checkpoints(p, fw, "vk", init, OFFSETS)
    for workspace in (np.zeros(1, np.uint8), np.zeros((0,), np.float32), np.zeros((3, 5), np.int8)[:, ::2]):
        out, final, ckpt = fwd_with_checkpoints(p, fw, "vk", init, OFFSETS, workspace=to_fw(workspace, fw))
        assert raw(out) == raw(want_out) and raw(final) == raw(want_final) and raw(ckpt) == raw(want_ckpt)
    if fw == "torch" and torch.cuda.is_available():  # a device buffer beside CPU tensors: ignored too
        out, _, _ = fwd_with_checkpoints(p, fw, "vk", init, OFFSETS, workspace=torch.empty(8, device="cuda"))
        assert raw(out) == raw(want_out)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_workspace_of_the_wrong_kind_is_refused(fw):
    p, out, ckpt = _refusal_setup(fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    for workspace, message in (([0] * 8, "workspace: expected a tensor or array"),
                               (FakeJaxArray(np.zeros(8, np.uint8)), "workspace: it is written as scratch memory, "
                                                                      "and JAX arrays are immutable")):
        with pytest.raises(TypeError, match=re.escape(message)):
            flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, None, None, cu, workspace=workspace,
                         checkpoint_offsets=to_fw(offsets(), fw), checkpoint_state=ckpt)
    _nothing_written(out, ckpt)


def test_given_workspace_checks_size_device_and_contiguity():
    """The workspace_alloc built for a given buffer (CUDA path only; exercised here on host
    buffers, as if q were on the same host device): a view of the buffer when it is large enough,
    ValueError naming workspace otherwise."""
    q = np.zeros((1, 16, H, K), np.float32)
    alloc = _frameworks.given_workspace(np.zeros(100, np.uint8), q)
    assert alloc(100).nbytes == 100 and alloc(0).nbytes == 100
    with pytest.raises(ValueError, match=re.escape("workspace: expected at least 101 bytes for this call, got a "
                                                   "buffer of 100 bytes")):
        alloc(101)
    assert _frameworks.given_workspace(np.zeros((5, 5), np.float32), q)(100).nbytes == 100  # its bytes count
    with pytest.raises(ValueError, match=re.escape("workspace: expected a contiguous buffer")):
        _frameworks.given_workspace(np.zeros((4, 8), np.uint8)[:, ::2], q)
    if torch is None:
        return
    from flashkda import _torch_ops

    alloc = _torch_ops._given_workspace(torch.zeros(10, dtype=torch.float32), torch.device("cpu"))
    view = alloc(33)
    assert view.dtype == torch.uint8 and view.numel() == 33 and alloc(40).numel() == 40
    with pytest.raises(ValueError, match=re.escape("workspace: expected at least 41 bytes for this call, got a "
                                                   "buffer of 40 bytes (torch.float32 [10])")):
        alloc(41)
    with pytest.raises(ValueError, match=re.escape("workspace: is on cpu but q is on meta")):
        _torch_ops._given_workspace(torch.zeros(8, dtype=torch.uint8), torch.device("meta"))
    with pytest.raises(ValueError, match=re.escape("workspace: expected a contiguous tensor")):
        _torch_ops._given_workspace(torch.zeros(4, 8, dtype=torch.uint8)[:, ::2], torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# torch: the custom op, FakeTensorMode, torch.compile

def _compile_available():
    try:
        import torch._dynamo

        return torch._dynamo.is_dynamo_supported()
    except Exception:  # noqa: BLE001
        return False


needs_compile = pytest.mark.skipif(torch is None or not _compile_available(),
                                   reason="torch.compile (dynamo) is not supported on this platform")


@needs_torch
@needs_compile
@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_fwd_writes_checkpoints(backend, layout):
    torch._dynamo.reset()
    p0 = problem(90)
    init0 = in_layout(p0["initial_state"], layout)
    p = to_torch(p0)
    init, offs = to_fw(init0, "torch"), torch.from_numpy(offsets())

    def step(q, k, v, g, beta, A_log, dt_bias, init, cu, offs, ckpt):
        out = torch.zeros_like(v)
        final = torch.empty_like(init)
        flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, init, final, cu, state_layout=layout,
                     checkpoint_state=ckpt, checkpoint_offsets=offs)
        return out, final

    def run(fn, ckpt):
        return fn(p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], init, p["cu_seqlens"], offs,
                  ckpt)

    want_ckpt = torch.from_numpy(sentinel_checkpoints())
    want = run(step, want_ckpt)
    ckpt = torch.from_numpy(sentinel_checkpoints())
    got = run(torch.compile(step, fullgraph=True, backend=backend), ckpt)
    assert torch.equal(ckpt, want_ckpt), "the compiled call did not write the checkpoints as the eager one does"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    check_checkpoints(p0, ckpt, OFFSETS, "torch", layout, init0)


@needs_torch
@needs_compile
def test_torch_compile_fullgraph_forward_allocates_checkpoints():
    torch._dynamo.reset()
    p0 = problem(100)
    p = to_torch(p0)
    offs = torch.from_numpy(offsets())

    def step(q, k, v, g, beta, A_log, dt_bias, init, cu, offs):
        out, final, ckpt = flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=init,
                                            cu_seqlens=cu, output_final_state=True, checkpoint_offsets=offs)
        return out, final, ckpt * 2

    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], p["initial_state"],
            p["cu_seqlens"], offs)
    want = step(*args)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    for w, g_ in zip(want, got):
        assert torch.equal(w, g_)
    assert got[2].shape == (N, C, H, K, K)


@needs_torch
def test_opcheck_in_place_op_with_checkpoints():
    p = to_torch(problem(110))
    out = torch.zeros(1, sum(LENGTHS), H, K, dtype=torch.bfloat16)
    final = torch.zeros(N, H, K, K)
    ckpt = torch.from_numpy(sentinel_checkpoints())
    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], p["initial_state"],
            p["cu_seqlens"], out, final, ckpt, torch.empty(16, dtype=torch.uint8), -5.0, K ** -0.5, 0, True, None,
            None, 0, False, torch.from_numpy(offsets("int32")))
    torch.library.opcheck(torch.ops.flashkda.forward_out.default, args)
    schema = torch.ops.flashkda.forward_out.default._schema
    mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert {"out", "final_state", "checkpoint_state", "workspace"} <= mutated


@needs_torch
def test_fake_tensor_mode_gives_checkpoint_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = to_torch(problem(120))
    with FakeTensorMode() as mode:
        p = {name: (None if x is None else mode.from_tensor(x)) for name, x in real.items()}
        offs = mode.from_tensor(torch.from_numpy(offsets()))
        args = (p["q"], p["k"], p["v"], p["g"], p["beta"])
        kw = dict(A_log=p["A_log"], dt_bias=p["dt_bias"], cu_seqlens=p["cu_seqlens"], checkpoint_offsets=offs)
        for layout in ("vk", "kv"):
            out, final, ckpt = flashkda.forward(*args, state_layout=layout, **kw)
            assert out.shape == (1, sum(LENGTHS), H, K) and final is None
            assert ckpt.shape == (N, C, H, K, K) and ckpt.dtype == torch.float32
        _, _, ckpt = flashkda.forward(*args, A_log=p["A_log"], dt_bias=p["dt_bias"], cu_seqlens=p["cu_seqlens"],
                                      checkpoint_offsets=offs[:, :2])
        assert ckpt.shape == (N, 2, H, K, K)


# ---------------------------------------------------------------------------------------------
# CUDA: workspace= is used and checked; checkpoints on the chunked prefill and the recurrent kernel

def _cuda_call(p, **kw):
    out = torch.full((1, sum(LENGTHS), H, K), OUT_SENTINEL, dtype=torch.bfloat16, device="cuda")
    final = torch.zeros(N, H, K, K, device="cuda")
    flashkda.fwd(p["q"], p["k"], p["v"], p["g"], p["beta"], None, out, p["A_log"], p["dt_bias"], -5.0,
                 p["initial_state"], final, p["cu_seqlens"], **kw)
    return out, final


def _needed_workspace(p):
    """The bytes of workspace the extension asks for on _cuda_call's arguments (0: none)."""
    asked = []
    out = torch.empty(1, sum(LENGTHS), H, K, dtype=torch.bfloat16, device="cuda")
    final = torch.zeros(N, H, K, K, device="cuda")

    def alloc(n):
        asked.append(n)
        return torch.empty(n, dtype=torch.uint8, device="cuda")

    _ext.forward(p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], out, p["initial_state"], final,
                 p["cu_seqlens"], -5.0, K ** -0.5, 0, True, torch.cuda.current_stream().cuda_stream, alloc, 0)
    torch.cuda.synchronize()
    return asked[0] if asked else 0


@needs_torch
@needs_cuda[0]
@needs_cuda[1]
def test_cuda_workspace_is_used_and_checked():
    p = to_torch(problem(130), "cuda")
    want_out, want_final = _cuda_call(p)
    needed = _needed_workspace(p)
    workspace = torch.empty(needed + 4096, dtype=torch.uint8, device="cuda")
    for ws in (workspace, workspace.view(-1)[: max(needed, 1)], torch.empty((needed + 3) // 4 + 1, device="cuda")):
        out, final = _cuda_call(p, workspace=ws)
        torch.cuda.synchronize()
        assert torch.equal(out, want_out) and torch.equal(final, want_final)
    if needed > 0:
        with pytest.raises(ValueError, match=re.escape(f"workspace: expected at least {needed} bytes for this call, "
                                                       f"got a buffer of {needed - 1} bytes")):
            _cuda_call(p, workspace=torch.empty(needed - 1, dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match=re.escape("workspace: is on cpu but q is on cuda:0")):
        _cuda_call(p, workspace=torch.empty(needed + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=re.escape("workspace: expected a contiguous tensor")):
        _cuda_call(p, workspace=torch.empty(2, needed + 2, dtype=torch.uint8, device="cuda")[:, 1:])
    if needed == 0:
        pytest.skip("these inputs need no workspace: the too-small refusal was not reached")


@needs_torch
@needs_cuda[0]
@needs_cuda[1]
@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("kernels", ["chunked", "recurrent"])
def test_cuda_checkpoints_equal_prefix_prefills(kernels, layout, monkeypatch):
    """On CUDA, forced onto one kind of kernel (the chunked prefill with one state-pass layout for
    every call, unsplit: a prefix prefill of one sequence would otherwise take another), the prefix
    prefills give the checkpoints bit for bit, and both are within the bar of the oracle."""
    monkeypatch.setenv("FLASHKDA_CUDA_KERNELS", kernels)
    monkeypatch.setenv("FLASHKDA_STATE_CONFIG", "8x1")
    monkeypatch.setenv("FLASHKDA_SPLIT", "0")
    p = problem(140 + LAYOUTS[layout])
    init = in_layout(p["initial_state"], layout)
    _, _, ckpt = fwd_with_checkpoints(p, "cuda", layout, init, OFFSETS)
    assert ckpt.is_cuda
    check_checkpoints(p, ckpt, OFFSETS, "cuda", layout, init, oracle=True)


@needs_torch
@needs_cuda[0]
@needs_cuda[1]
def test_cuda_workspace_of_cupy_arrays():
    """workspace= beside CuPy arrays (the path of frameworks other than torch): used, and checked."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    p = to_torch(problem(150), "cuda")
    try:
        pc = {name: (None if x is None else cupy.from_dlpack(x)) for name, x in p.items()}
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"CuPy cannot hold these tensors (bfloat16): {e}")
    needed = _needed_workspace(p)

    def call(**kw):
        out = torch.full((1, sum(LENGTHS), H, K), OUT_SENTINEL, dtype=torch.bfloat16, device="cuda")
        final = torch.zeros(N, H, K, K, device="cuda")
        flashkda.fwd(pc["q"], pc["k"], pc["v"], pc["g"], pc["beta"], None, cupy.from_dlpack(out), pc["A_log"],
                     pc["dt_bias"], -5.0, pc["initial_state"], cupy.from_dlpack(final), pc["cu_seqlens"], **kw)
        cupy.cuda.get_current_stream().synchronize()
        return out, final

    want_out, want_final = call()
    out, final = call(workspace=cupy.empty(needed + 256, dtype=cupy.uint8))
    assert torch.equal(out, want_out) and torch.equal(final, want_final)
    if needed > 0:
        with pytest.raises(ValueError, match=re.escape(f"workspace: expected at least {needed} bytes for this call, "
                                                       f"got a buffer of {needed - 1} bytes")):
            call(workspace=cupy.empty(needed - 1, dtype=cupy.uint8))
    with pytest.raises(ValueError, match=re.escape("workspace: is on cpu but q is on cuda:0")):
        call(workspace=np.empty(needed + 1, np.uint8))
