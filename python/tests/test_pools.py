"""State pools through the Python API (state_indices, final_state_indices, state_layout), on the
CPU backend with torch tensors and NumPy arrays, against the fp64 oracle: shuffled slots updated
in place, final states into other slots or a second pool, padding sequences (their out rows
kept), both state layouts, float32 and bfloat16 pools, int32 and int64 indices, slots nobody
addresses left bit for bit; the refusals, each naming its argument; torch.compile(fullgraph=True)
seeing the pool mutated; JAX refused. The framework-parametrized cases also run on CUDA tensors
where there is a GPU (the recurrent kernel takes pools)."""

import re

import numpy as np
import pytest

import flashkda
from flashkda import _ext, _frameworks
from kda_helpers import BAR, BF16, K, FakeJaxArray, as_f64, make_problem, oracle, rel, to_torch, normal_pool, to_fw, torch, needs_torch, FRAMEWORKS, DEVICE_FRAMEWORKS

H = 2
LENGTHS = [9, 0, 17, 5]  # N = 4, one empty sequence among them
N = len(LENGTHS)
P = 8  # slots in a pool
SENTINEL = 7.0  # what out holds before a call (bfloat16-exact)
LAYOUTS = {"vk": 0, "kv": 1}


# ---------------------------------------------------------------------------------------------
# Helpers: NumPy masters, converted to the framework under test for the call

def problem(seed, lengths=LENGTHS):
    return make_problem(lengths=lengths, H=H, state=None, seed=seed)


def random_pool(dtype, seed, slots=P):
    return normal_pool(dtype, seed, slots, H)


def call_args(p, fw):
    return [to_fw(p[name], fw) for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "cu_seqlens")]


def sentinel_out(p, fw):
    out = np.full(p["q"].shape[:3] + (K,), SENTINEL, dtype=BF16)
    return to_fw(out, fw)


def raw(x):
    """The bytes of an array or tensor (for bit-for-bit comparisons)."""
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def v_major(state, layout):
    """One slot [H, V, K] (or [H, K, V] K-major) as float64 [H, V, K]."""
    s = as_f64(state)
    return s.swapaxes(-1, -2) if layout == "kv" else s


def pool_oracle(p, pool, state_indices, layout):
    """fp64 (out, per-sequence final states [N, H, V, K]) with sequence n starting from
    pool[state_indices[n]] (read in `layout`); padding sequences get zeros."""
    args, views = _frameworks._prepare(dict(q=p["q"], k=p["k"], v=p["v"], g=p["g"], beta=p["beta"],
                                            initial_state=pool))
    return _ext.oracle_forward(args["q"], args["k"], args["v"], args["g"], args["beta"], p["A_log"], p["dt_bias"],
                               args["initial_state"], p["cu_seqlens"], -5.0, K ** -0.5, 0, views,
                               state_indices=state_indices, state_layout=LAYOUTS[layout])


def rows(p, n):
    cu = p["cu_seqlens"]
    return slice(int(cu[n]), int(cu[n + 1]))


def check_results(p, out, ref_out, final_pool, final_before, ref_state, state_indices, final_slots, layout):
    """out against the oracle for the sequences that ran, the sentinel kept for padding ones;
    each written slot against its sequence's final state; every other slot of the final pool
    bit for bit as before."""
    got, want = [], []
    for n in range(N):
        r = rows(p, n)
        if state_indices[n] < 0:
            assert np.all(as_f64(out[0, r]) == SENTINEL), f"padding sequence {n} wrote out"
        else:
            got.append(as_f64(out[0, r]))
            want.append(ref_out[0, r])
    e = rel(np.concatenate(got), np.concatenate(want))
    assert e <= BAR, f"out: rel error {e:.2e} > {BAR}"
    written = set()
    for n in range(N):
        s = int(final_slots[n])
        if state_indices[n] < 0 or s < 0:
            continue
        written.add(s)
        e = rel(v_major(final_pool[s], layout), ref_state[n])
        assert e <= BAR, f"final state of sequence {n} in slot {s}: rel error {e:.2e} > {BAR}"
    for s in range(final_pool.shape[0]):
        if s not in written:
            assert raw(final_pool[s]) == final_before[s], f"slot {s} was not addressed but changed"


def shuffled_slots(seed, count=N, slots=P):
    return np.random.default_rng(seed).permutation(slots)[:count]


# ---------------------------------------------------------------------------------------------
# Against the oracle

@pytest.mark.parametrize("index_dtype", ["int64", "int32"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_forward_updates_shuffled_slots_in_place(fw, layout, state_dtype, index_dtype):
    seed = 10 * LAYOUTS[layout] + 3 * (state_dtype == "bfloat16") + (index_dtype == "int32")
    p = problem(seed)
    pool0 = random_pool(state_dtype, seed + 100)
    idx = shuffled_slots(seed + 200).astype(index_dtype)
    ref_out, ref_state = pool_oracle(p, pool0, idx, layout)

    pool = to_fw(pool0.copy(), fw)
    before = [raw(pool[s]) for s in range(P)]
    out = sentinel_out(p, fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    got_out, got_pool = flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                         cu_seqlens=cu, out=out, state_indices=to_fw(idx, fw),
                                         state_layout=layout, output_final_state=True)
    assert got_out is out and got_pool is pool  # the pool is the output, updated in place
    check_results(p, out, ref_out, pool, before, ref_state, idx, idx, layout)


@pytest.mark.parametrize("layout, state_dtype, index_dtype", [
    ("vk", "float32", "int64"), ("kv", "bfloat16", "int32"), ("kv", "float32", "int64"), ("vk", "bfloat16", "int32"),
])
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_fwd_writes_final_slots_of_a_second_pool(fw, layout, state_dtype, index_dtype):
    """fwd maps onto the C++ call: a read pool, a written pool, final_state_indices, padding
    (sequence 1, negative state index) and a final state not written (sequence 3)."""
    p = problem(40)
    initial0, final0 = random_pool(state_dtype, 41), random_pool(state_dtype, 42, slots=P + 3)
    idx = shuffled_slots(43).astype(index_dtype)
    idx[1] = -1
    fidx = shuffled_slots(44, slots=P + 3).astype(index_dtype)
    fidx[3] = -5
    ref_out, ref_state = pool_oracle(p, initial0, idx, layout)

    initial, final = to_fw(initial0.copy(), fw), to_fw(final0.copy(), fw)
    before = [raw(final[s]) for s in range(P + 3)]
    out = sentinel_out(p, fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    assert flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, initial, final, cu,
                        state_indices=to_fw(idx, fw), final_state_indices=to_fw(fidx, fw),
                        state_layout=layout) is None
    assert raw(initial) == raw(initial0)  # the read pool is not written
    check_results(p, out, ref_out, final, before, ref_state, idx, fidx, layout)


@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_fwd_one_pool_in_place_with_final_slots(fw):
    """initial_state and final_state the same tensor; sequences start from four slots and write
    the four others."""
    p = problem(50)
    pool0 = random_pool("float32", 51)
    perm = shuffled_slots(52, count=P)
    idx, fidx = perm[:N], perm[N:]
    ref_out, ref_state = pool_oracle(p, pool0, idx, "vk")

    pool = to_fw(pool0.copy(), fw)
    before = [raw(pool[s]) for s in range(P)]
    out = sentinel_out(p, fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, pool, pool, cu,
                 state_indices=to_fw(idx, fw), final_state_indices=to_fw(fidx, fw))
    check_results(p, out, ref_out, pool, before, ref_state, idx, fidx, "vk")  # the slots read: untouched


@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_padding_keeps_out_rows_and_allocated_out_is_zero_there(fw):
    p = problem(60)
    pool0 = random_pool("bfloat16", 61)
    idx = shuffled_slots(62)
    idx[[0, 2]] = [-1, -7]
    ref_out, ref_state = pool_oracle(p, pool0, idx, "vk")

    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)

    def forward(pool, **kw):
        return flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool, cu_seqlens=cu,
                                state_indices=to_fw(idx, fw), **kw)

    pool = to_fw(pool0.copy(), fw)
    before = [raw(pool[s]) for s in range(P)]
    out = sentinel_out(p, fw)
    forward(pool, out=out)
    check_results(p, out, ref_out, pool, before, ref_state, idx, idx, "vk")

    # Without out=, the rows of padding sequences are zeros (the allocation is zero-filled).
    pool2 = to_fw(pool0.copy(), fw)
    out2, got = forward(pool2)
    assert got is pool2 and raw(pool2) == raw(pool)
    for n in range(N):
        want = np.zeros_like(as_f64(out[0, rows(p, n)])) if idx[n] < 0 else as_f64(out[0, rows(p, n)])
        np.testing.assert_array_equal(as_f64(out2[0, rows(p, n)]), want)


@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_fwd_without_initial_state_starts_from_zero(fw):
    p = problem(70)
    ref_out, ref_state = oracle(p)  # no initial state: every sequence from zero
    pool0 = random_pool("float32", 71)
    idx = shuffled_slots(72)
    pool = to_fw(pool0.copy(), fw)
    before = [raw(pool[s]) for s in range(P)]
    out = sentinel_out(p, fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, None, pool, cu, state_indices=to_fw(idx, fw))
    check_results(p, out, ref_out, pool, before, ref_state, idx, idx, "vk")


@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_chunked_prefill_continues_from_the_pool(fw, layout):
    """Two calls on consecutive chunks of the same prompts and slots: the second starts from the
    states the first wrote in place; together they are one call on the whole prompts."""
    whole = problem(80, lengths=[30, 21])
    pool0 = random_pool("float32", 81)
    idx = np.array([5, 2])
    ref_out, ref_state = pool_oracle(whole, pool0, idx, layout)

    splits = [(0, 16, 30), (30, 41, 51)]  # per prompt: start, split, end in the packed tokens
    pool = to_fw(pool0.copy(), fw)
    before = [raw(pool[s]) for s in range(P)]
    outs = []
    for first in (True, False):
        take = [np.arange(a, m) if first else np.arange(m, e) for a, m, e in splits]
        sel = np.concatenate(take)
        chunk = {name: whole[name][:, sel] for name in ("q", "k", "v", "g", "beta")}
        chunk.update(A_log=whole["A_log"], dt_bias=whole["dt_bias"],
                     cu_seqlens=np.array([0, len(take[0]), len(sel)], dtype=np.int64))
        q, k, v, g, beta, A_log, dt_bias, cu = call_args(chunk, fw)
        out, got = flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                    cu_seqlens=cu, state_indices=to_fw(idx, fw), state_layout=layout)
        assert got is pool
        outs.append((sel, as_f64(out)[0]))
    got_out = np.zeros((whole["q"].shape[1], H, K))
    for sel, o in outs:
        got_out[sel] = o
    e = rel(got_out, ref_out[0])
    assert e <= BAR, f"out: rel error {e:.2e} > {BAR}"
    for n, s in enumerate(idx):
        e = rel(v_major(pool[s], layout), ref_state[n])
        assert e <= BAR, f"slot {s}: rel error {e:.2e} > {BAR}"
    for s in set(range(P)) - set(idx.tolist()):
        assert raw(pool[s]) == before[s]


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fw", FRAMEWORKS)  # on CUDA "kv" and "vk" take different kernels: not bit for bit
def test_k_major_states_without_pools(fw, state_dtype):
    """state_layout="kv" without state_indices: [N, H, K, V] states in, and allocated out."""
    p = problem(90)
    vk = random_pool(state_dtype, 91, slots=N)
    ref_out, ref_state = pool_oracle(p, vk, np.arange(N), "vk")
    kv = np.ascontiguousarray(vk.swapaxes(-1, -2))
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    out, final_state = flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=to_fw(kv, fw),
                                        cu_seqlens=cu, output_final_state=True, state_layout="kv")
    assert tuple(final_state.shape) == (N, H, K, K) and type(final_state) is type(q)
    assert rel(out, ref_out) <= BAR
    assert rel(v_major(final_state, "kv"), ref_state) <= BAR
    # No initial state: the allocated K-major final state is the transpose of the V-major one.
    _, fs_kv = flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu,
                                output_final_state=True, state_layout="kv")
    _, fs_vk = flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu,
                                output_final_state=True)
    np.testing.assert_array_equal(as_f64(fs_kv), as_f64(fs_vk).swapaxes(-1, -2))


# ---------------------------------------------------------------------------------------------
# Refusals: a ValueError (TypeError for types) naming the argument, and nothing written

def _refusal_setup(fw):
    p = problem(100)
    pool = to_fw(random_pool("float32", 101), fw)
    out = sentinel_out(p, fw)
    return p, pool, out, raw(pool)


@pytest.mark.parametrize("idx, fidx, message", [
    ([0, 8, 1, 2], None, "state_indices: state_indices[1] = 8 is outside initial_state's pool of 8 slots"),
    ([1, 2, 1, 4], None, "state_indices: sequences 0 and 2 both write slot 1; each slot may take one state"),
    ([0, 1, 2, 3], [4, 5, 4, 6], "final_state_indices: sequences 0 and 2 both write slot 4"),
    ([0, 1, 2, 3], [4, 9, 5, 6], "final_state_indices: final_state_indices[1] = 9 is outside final_state's pool"),
    ([0, 1, 2, 3], [1, 4, 5, 6], "final_state_indices: sequence 0 writes slot 1, which sequence 1 starts from in "
                                 "the same buffer"),
])
@pytest.mark.parametrize("index_dtype", ["int64", "int32"])
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_bad_indices_are_refused_naming_the_argument(fw, index_dtype, idx, fidx, message):
    p, pool, out, before = _refusal_setup(fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    si = to_fw(np.array(idx, dtype=index_dtype), fw)
    fi = None if fidx is None else to_fw(np.array(fidx, dtype=index_dtype), fw)
    with pytest.raises(ValueError, match=re.escape(message)):
        flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool, cu_seqlens=cu, out=out,
                         state_indices=si, final_state_indices=fi)
    with pytest.raises(ValueError, match=re.escape(message)):
        flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, pool, pool, cu, state_indices=si,
                     final_state_indices=fi)
    assert raw(pool) == before and np.all(as_f64(out) == SENTINEL)  # refused before anything is written


@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_duplicate_final_slots_in_a_second_pool_are_refused(fw):
    p, pool, out, before = _refusal_setup(fw)
    final = to_fw(np.zeros((P, H, K, K), np.float32), fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    with pytest.raises(ValueError, match=re.escape("final_state_indices: sequences 1 and 3 both write slot 2")):
        flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, pool, final, cu,
                     state_indices=to_fw(np.arange(N), fw), final_state_indices=to_fw(np.array([0, 2, 1, 2]), fw))
    # Reading one slot twice from a pool that is not written is fine.
    flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, pool, final, cu,
                 state_indices=to_fw(np.array([3, 3, 3, 3]), fw), final_state_indices=to_fw(np.arange(N), fw))
    assert raw(pool) == before


@pytest.mark.parametrize("bad", ["VK", "k-major", "", 0, 1, None])
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_bad_state_layout_is_refused_naming_it(fw, bad):
    p, pool, out, before = _refusal_setup(fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    message = re.escape(f"state_layout: expected 'vk' (V-major states [.., V, K]) or 'kv' (K-major [.., K, V]), "
                        f"got {bad!r}")
    with pytest.raises(ValueError, match=message):
        flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool, cu_seqlens=cu,
                         state_indices=to_fw(np.arange(N), fw), state_layout=bad)
    with pytest.raises(ValueError, match=message):
        flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, pool, pool, cu, state_layout=bad)
    assert raw(pool) == before


@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_pool_arguments_missing_or_of_the_wrong_kind(fw):
    p, pool, out, before = _refusal_setup(fw)
    q, k, v, g, beta, A_log, dt_bias, cu = call_args(p, fw)
    idx = to_fw(np.arange(N), fw)

    def forward(**kw):
        return flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, out=out, **kw)

    with pytest.raises(ValueError, match=re.escape("state_indices: given without initial_state; with state_indices, "
                                                   "initial_state is the pool")):
        forward(state_indices=idx, output_final_state=True)
    with pytest.raises(ValueError, match=re.escape("final_state_indices: given without state_indices")):
        forward(initial_state=pool[:N], final_state_indices=idx, output_final_state=True)
    with pytest.raises(ValueError, match=re.escape("state_indices: given without initial_state or final_state")):
        flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, None, None, cu, state_indices=idx)
    with pytest.raises(TypeError, match=re.escape("state_indices: expected dtype int64 or int32, got float32")):
        forward(initial_state=pool, state_indices=to_fw(np.arange(N, dtype=np.float32), fw))
    with pytest.raises(ValueError, match=re.escape("state_indices: expected shape [4] [N], got [3]")):
        forward(initial_state=pool, state_indices=idx[:3])
    with pytest.raises(TypeError, match=re.escape("state_indices: expected a tensor or array")):
        forward(initial_state=pool, state_indices=[0, 1, 2, 3])
    with pytest.raises(TypeError, match=re.escape("final_state_indices: expected a tensor or array")):
        forward(initial_state=pool, state_indices=idx, final_state_indices=(4, 5, 6, 7))
    with pytest.raises(ValueError, match=re.escape("initial_state: expected shape [8, 2, 128, 128] [P, H, V, K], "
                                                   "got [8, 2, 128, 64]")):
        forward(initial_state=to_fw(np.zeros((P, H, K, 64), np.float32), fw), state_indices=idx)
    assert raw(pool) == before and np.all(as_f64(out) == SENTINEL)


def test_pools_of_jax_arrays_are_refused():
    p = problem(110)
    pool = random_pool("float32", 111)
    fake = FakeJaxArray(pool)
    message = re.escape("state_indices: state pools are updated in place, and JAX arrays are immutable")
    args = [p[name] for name in ("q", "k", "v", "g", "beta")]
    with pytest.raises(TypeError, match=message):
        flashkda.forward(*args, A_log=p["A_log"], dt_bias=p["dt_bias"], initial_state=fake,
                         cu_seqlens=p["cu_seqlens"], state_indices=np.arange(N))
    with pytest.raises(TypeError, match=message):
        flashkda.fwd(*args, None, np.zeros((1, 31, H, K), BF16), p["A_log"], p["dt_bias"], -5.0, pool, fake,
                     p["cu_seqlens"], state_indices=np.arange(N))


def test_pools_of_real_jax_arrays_are_refused():
    jnp = pytest.importorskip("jax.numpy", reason="JAX is not installed")
    p = problem(112)
    pj = {name: (None if x is None else jnp.asarray(x)) for name, x in p.items()}
    pool = jnp.asarray(random_pool("float32", 113))
    with pytest.raises(TypeError, match=re.escape("state_indices: state pools are updated in place, and JAX arrays "
                                                  "are immutable")):
        flashkda.forward(pj["q"], pj["k"], pj["v"], pj["g"], pj["beta"], A_log=pj["A_log"], dt_bias=pj["dt_bias"],
                         initial_state=pool, cu_seqlens=pj["cu_seqlens"], state_indices=jnp.arange(N))
    # K-major states without pools are allocated, not mutated: fine for JAX.
    _, fs = flashkda.forward(pj["q"], pj["k"], pj["v"], pj["g"], pj["beta"], A_log=pj["A_log"],
                             dt_bias=pj["dt_bias"], cu_seqlens=pj["cu_seqlens"], output_final_state=True,
                             state_layout="kv")
    assert fs.shape == (N, H, K, K)


# ---------------------------------------------------------------------------------------------
# torch: the custom ops, FakeTensorMode, torch.compile

def _compile_available():
    try:
        import torch._dynamo

        return torch._dynamo.is_dynamo_supported()
    except Exception:  # noqa: BLE001
        return False


def _torch_problem(seed, state_dtype="float32"):
    p = to_torch(problem(seed))
    pool = to_fw(random_pool(state_dtype, seed + 1), "torch")
    idx = torch.from_numpy(shuffled_slots(seed + 2))
    return p, pool, idx


@needs_torch
@pytest.mark.skipif(torch is None or not _compile_available(),
                    reason="torch.compile (dynamo) is not supported on this platform")
@pytest.mark.parametrize("call", ["forward", "fwd"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_updates_the_pool(backend, call):
    torch._dynamo.reset()
    p, pool0, _ = _torch_problem(120)
    perm = torch.from_numpy(shuffled_slots(122, count=P))
    idx, fidx = perm[:N], (perm[N:] if call == "fwd" else None)  # fwd: the final states into other slots

    def step(q, k, v, g, beta, A_log, dt_bias, pool, cu, idx, fidx):
        if call == "forward":
            out, got = flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                        cu_seqlens=cu, state_indices=idx, final_state_indices=fidx)
            return out.float().sum(-1), got
        out = torch.zeros_like(v)
        flashkda.fwd(q, k, v, g, beta, None, out, A_log, dt_bias, -5.0, pool, pool, cu, state_indices=idx,
                     final_state_indices=fidx)
        return out.float().sum(-1), pool

    def run(fn, pool):
        return fn(p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], pool, p["cu_seqlens"],
                  idx, fidx)

    want_pool = pool0.clone()
    want = run(step, want_pool)
    assert not torch.equal(want_pool, pool0)
    pool = pool0.clone()
    got = run(torch.compile(step, fullgraph=True, backend=backend), pool)
    assert got[1] is pool or torch.equal(got[1], pool)
    assert torch.equal(pool, want_pool), "the compiled call did not update the pool as the eager one does"
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    # The oracle, for the written slots.
    ref_out, ref_state = pool_oracle(problem(120), pool0.numpy(), idx.numpy(), "vk")
    written = idx if fidx is None else fidx
    for n in range(N):
        assert rel(pool[written[n]], ref_state[n]) <= BAR


@needs_torch
@pytest.mark.skipif(torch is None or not _compile_available(),
                    reason="torch.compile (dynamo) is not supported on this platform")
def test_torch_compile_keeps_the_one_buffer_refusal():
    """Under torch.compile the pool stays one buffer: a slot written by one sequence and read by
    another is refused as in eager mode (not silently read from a functional copy)."""
    torch._dynamo.reset()
    p, pool, _ = _torch_problem(130)
    before = pool.clone()

    def step(q, k, v, g, beta, A_log, dt_bias, pool, cu, idx, fidx):
        return flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool, cu_seqlens=cu,
                                state_indices=idx, final_state_indices=fidx)[0]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match=re.escape("final_state_indices: sequence 0 writes slot 1, which sequence "
                                                   "1 starts from in the same buffer")):
        compiled(p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], pool, p["cu_seqlens"],
                 torch.tensor([0, 1, 2, 3]), torch.tensor([1, 4, 5, 6]))
    assert torch.equal(pool, before)


@needs_torch
def test_functional_op_returns_a_new_pool():
    p, pool, idx = _torch_problem(140, "bfloat16")
    before = pool.clone()
    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], pool, p["cu_seqlens"], -5.0,
            K ** -0.5, 0, False, True, idx, None, 0)
    out, new_pool = torch.ops.flashkda.forward(*args)
    assert torch.equal(pool, before) and new_pool.shape == pool.shape and new_pool.dtype == pool.dtype
    want_pool = pool.clone()
    want_out, _ = flashkda.forward(p["q"], p["k"], p["v"], p["g"], p["beta"], A_log=p["A_log"],
                                   dt_bias=p["dt_bias"], initial_state=want_pool, cu_seqlens=p["cu_seqlens"],
                                   state_indices=idx)
    assert torch.equal(out, want_out) and torch.equal(new_pool, want_pool)
    torch.library.opcheck(torch.ops.flashkda.forward.default, args)


@needs_torch
def test_opcheck_in_place_op_with_a_pool():
    p, pool, idx = _torch_problem(150)
    out = torch.zeros(1, sum(LENGTHS), H, K, dtype=torch.bfloat16)
    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], None, p["cu_seqlens"], out, pool,
            None, None, -5.0, K ** -0.5, 0, True, idx, None, 1, True)
    torch.library.opcheck(torch.ops.flashkda.forward_out.default, args)


@needs_torch
def test_fake_tensor_mode_gives_pool_and_k_major_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real, pool, idx = _torch_problem(160, "bfloat16")
    with FakeTensorMode() as mode:
        p = {name: (None if x is None else mode.from_tensor(x)) for name, x in real.items()}
        fake_pool, fake_idx = mode.from_tensor(pool), mode.from_tensor(idx)
        args = (p["q"], p["k"], p["v"], p["g"], p["beta"])
        kw = dict(A_log=p["A_log"], dt_bias=p["dt_bias"], cu_seqlens=p["cu_seqlens"])
        out, got = flashkda.forward(*args, initial_state=fake_pool, state_indices=fake_idx, **kw)
        assert got is fake_pool and out.shape == (1, sum(LENGTHS), H, K)
        _, fs = flashkda.forward(*args, output_final_state=True, state_layout="kv", **kw)
        assert fs.shape == (N, H, K, K) and fs.dtype == torch.float32
        _, fs = torch.ops.flashkda.forward(*args, p["A_log"], p["dt_bias"], fake_pool, p["cu_seqlens"], -5.0,
                                           K ** -0.5, 0, False, True, fake_idx, None, 1)
        assert fs.shape == pool.shape and fs.dtype == torch.bfloat16

