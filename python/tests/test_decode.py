"""Decode through the Python API: flashkda.decode (a few tokens per request over a state pool) and
flashkda.fused_recurrent_kda (the Triton decode kernel's keywords), on the CPU backend with torch
tensors and NumPy arrays, against the fp64 oracle: T = 1..8 tokens per request, both gates, both
state layouts, float32 and bfloat16 pools, int32 and int64 indices, padding requests; speculative
verify (per-token states into their slots, the start slot the accepted one); slots nobody
addresses left bit for bit; prefill into the pool then decode equal to one longer prefill; the
refusals, each naming its keyword. Every framework-parametrized case also runs on CUDA tensors
where there is a GPU (the recurrent kernel), and a decode step runs inside a captured CUDA graph."""

import re

import numpy as np
import pytest

import flashkda
from flashkda import _ext, _frameworks
from kda_helpers import BAR, BF16, K, FakeJaxArray, as_f64, make_problem, rel, to_torch, normal_pool, to_fw, torch, needs_torch, needs_cuda, DEVICE_FRAMEWORKS

H = 2
N = 4  # requests
P = 12  # slots in a decode pool
SENTINEL = 7.0  # what a given out holds before a call (bfloat16-exact)
LAYOUTS = {"vk": 0, "kv": 1}
GATE_IDS = {"safe": 0, "softplus": 1}
INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


# ---------------------------------------------------------------------------------------------
# Helpers: NumPy masters, converted to the framework under test for the call

def requests(T, seed, n=N):
    """n requests of T tokens each, [n, T, H, *] (no initial states: the pool holds them)."""
    return make_problem(B=n, T=T, H=H, state=None, seed=seed)


def random_pool(dtype, seed, slots=P):
    return normal_pool(dtype, seed, slots, H)


def call_inputs(p, fw):
    return [to_fw(p[name], fw) for name in INPUTS]


def kda(x, **kw):
    """flashkda.fused_recurrent_kda on call_inputs' list (A_log and dt_bias are keywords)."""
    return flashkda.fused_recurrent_kda(*x[:5], A_log=x[5], dt_bias=x[6], **kw)


def raw(x):
    """The bytes of an array or tensor (for bit-for-bit comparisons)."""
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def slot_bytes(pool):
    return [raw(pool[s]) for s in range(pool.shape[0])]


def v_major(state, layout):
    """One slot [H, V, K] (or [H, K, V] K-major) as float64 [H, V, K]."""
    s = as_f64(state)
    return s.swapaxes(-1, -2) if layout == "kv" else s


def pool_oracle(p, pool, start, layout, gate="safe", lower_bound=-5.0, tokens=None):
    """fp64 (out, final states [N, H, V, K]) of the first `tokens` tokens of each request (all of
    them by default; packed ones with cu_seqlens), request n starting from pool[start[n]] in
    `layout`. Padding requests (negative start) get zeros."""
    cut = {name: p[name] for name in ("q", "k", "v", "g", "beta")}
    if tokens is not None:
        cut = {name: np.ascontiguousarray(x[:, :tokens]) for name, x in cut.items()}
    args, views = _frameworks._prepare(dict(cut, initial_state=pool))
    start = np.ascontiguousarray(start, dtype=np.int64)
    return _ext.oracle_forward(args["q"], args["k"], args["v"], args["g"], args["beta"], p["A_log"], p["dt_bias"],
                               args["initial_state"], p["cu_seqlens"], lower_bound, K ** -0.5, GATE_IDS[gate], views,
                               state_indices=start, state_layout=LAYOUTS[layout])


def check_out(out, ref_out, start, sentinel=0.0):
    """out [N, T, H, V] against the oracle for the requests that ran; padding requests' rows as
    they were (`sentinel`)."""
    ran = [n for n in range(len(start)) if start[n] >= 0]
    e = rel(np.stack([as_f64(out[n]) for n in ran]), np.stack([ref_out[n] for n in ran]))
    assert e <= BAR, f"out: rel error {e:.2e} > {BAR}"
    for n in range(len(start)):
        if start[n] < 0:
            assert np.all(as_f64(out[n]) == sentinel), f"padding request {n} wrote out"


def check_slots(pool, before, want, layout):
    """`want`: {slot: fp64 V-major state}; those slots against it, every other slot bit for bit
    as `before`."""
    for s in range(pool.shape[0]):
        if s in want:
            e = rel(v_major(pool[s], layout), want[s])
            assert e <= BAR, f"slot {s}: rel error {e:.2e} > {BAR}"
        else:
            assert raw(pool[s]) == before[s], f"slot {s} was not addressed but changed"


def decode_slots(seed, n=N, slots=P, padding=(1,)):
    """n distinct shuffled slots, the requests in `padding` marked -1."""
    idx = np.random.default_rng(seed).permutation(slots)[:n].astype(np.int64)
    idx[list(padding)] = -1
    return idx


# ---------------------------------------------------------------------------------------------
# flashkda.decode against the oracle

DECODE_CASES = [  # T, gate, layout, pool dtype, index dtype: T = 1 most
    (1, "safe", "vk", "float32", "int64"),
    (1, "safe", "kv", "bfloat16", "int32"),
    (1, "softplus", "vk", "bfloat16", "int64"),
    (1, "softplus", "kv", "float32", "int32"),
    (2, "safe", "kv", "float32", "int64"),
    (3, "softplus", "vk", "float32", "int32"),
    (4, "safe", "vk", "bfloat16", "int64"),
    (5, "safe", "vk", "bfloat16", "int32"),
    (7, "softplus", "kv", "float32", "int64"),
    (8, "softplus", "kv", "bfloat16", "int64"),
]


@pytest.mark.parametrize("T, gate, layout, pool_dtype, index_dtype", DECODE_CASES)
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_decode_against_the_oracle(fw, T, gate, layout, pool_dtype, index_dtype):
    seed = 1000 + 37 * T + 5 * LAYOUTS[layout] + 3 * GATE_IDS[gate]
    p = requests(T, seed)
    pool0 = random_pool(pool_dtype, seed + 1)
    idx = decode_slots(seed + 2).astype(index_dtype)
    ref_out, ref_state = pool_oracle(p, pool0, idx, layout, gate)

    pool = to_fw(pool0.copy(), fw)
    before = slot_bytes(pool)
    out = flashkda.decode(*call_inputs(p, fw)[:5], A_log=to_fw(p["A_log"], fw), dt_bias=to_fw(p["dt_bias"], fw),
                          state_pool=pool, state_indices=to_fw(idx, fw), gate=gate, state_layout=layout)
    assert out.shape == (N, T, H, K)
    check_out(out, ref_out, idx)  # padding rows: zeros (out allocated zero-filled)
    check_slots(pool, before, {int(idx[n]): ref_state[n] for n in range(N) if idx[n] >= 0}, layout)


@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_decode_packed_requests_with_cu_seqlens_into_a_given_out(fw):
    """Packed [1, total, H, *] with cu_seqlens, requests of 1, 3, 0 and 2 tokens; a given out keeps
    the padding request's rows."""
    p = make_problem(lengths=[1, 3, 0, 2], H=H, state=None, seed=2000)
    pool0 = random_pool("float32", 2001)
    idx = np.array([7, 2, 9, -1])
    ref_out, ref_state = pool_oracle(p, pool0, idx, "vk")

    pool = to_fw(pool0.copy(), fw)
    before = slot_bytes(pool)
    out = to_fw(np.full((1, 6, H, K), SENTINEL, BF16), fw)
    q, k, v, g, beta, A_log, dt_bias = call_inputs(p, fw)
    got = flashkda.decode(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, state_pool=pool,
                          state_indices=to_fw(idx, fw), cu_seqlens=to_fw(p["cu_seqlens"], fw), out=out)
    assert got is out
    e = rel(out[0, :4], ref_out[0, :4])
    assert e <= BAR, f"out: rel error {e:.2e} > {BAR}"
    assert np.all(as_f64(out[0, 4:]) == SENTINEL)  # request 3 is padding
    check_slots(pool, before, {7: ref_state[0], 2: ref_state[1], 9: ref_state[2]}, "vk")


# ---------------------------------------------------------------------------------------------
# Speculative verify: per-token states

def verify_slots(T, seed, index_dtype):
    """ssm_state_indices [N, T] (distinct slots; request 2 padding, all -1; request 0's last draft
    token not stored, -1) and num_accepted_tokens [N] in [1, T] (request 0's below T, so that its
    start slot is one that exists)."""
    rng = np.random.default_rng(seed)
    slots = N * T + 3
    idx = rng.permutation(slots)[:N * T].reshape(N, T).astype(index_dtype)
    idx[2] = -1
    accepted = rng.integers(1, T + 1, N).astype(index_dtype)
    if T > 1:
        idx[0, T - 1] = -1
        accepted[0] = rng.integers(1, T)
    return idx, accepted, slots


def start_slots(idx, accepted):
    """Each request's start slot in a verify: the slot of its last accepted token."""
    return np.array([idx[n, accepted[n] - 1] for n in range(N)], dtype=idx.dtype)


def verify_case(T, seed, pool_dtype, index_dtype):
    """A verify's requests, slots (verify_slots) and pool: (p, idx, accepted, slots, pool0)."""
    idx, accepted, slots = verify_slots(T, seed + 1, index_dtype)
    return requests(T, seed), idx, accepted, slots, random_pool(pool_dtype, seed + 2, slots)


def check_verify(p, pool0, pool, before, out, idx, accepted, layout, gate, lower_bound=-5.0):
    T = idx.shape[1]
    start = start_slots(idx, accepted)
    assert start[2] < 0 and all(start[n] >= 0 for n in (0, 1, 3))
    ref_out, _ = pool_oracle(p, pool0, start, layout, gate, lower_bound)
    check_out(out, ref_out, start)
    want = {}
    for t in range(T):  # the state after draft token t: the oracle on the first t + 1 tokens
        _, ref_state = pool_oracle(p, pool0, start, layout, gate, lower_bound, tokens=t + 1)
        for n in range(N):
            if start[n] >= 0 and idx[n, t] >= 0:
                want[int(idx[n, t])] = ref_state[n]
    check_slots(pool, before, want, layout)
    return want


VERIFY_CASES = [  # T, gate, layout, pool dtype, index dtype
    (2, "safe", "vk", "float32", "int64"),
    (3, "softplus", "kv", "bfloat16", "int32"),
    (4, "safe", "kv", "float32", "int32"),
    (8, "softplus", "vk", "bfloat16", "int64"),
]


@pytest.mark.parametrize("T, gate, layout, pool_dtype, index_dtype", VERIFY_CASES)
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_verify_with_decode_and_token_state_indices(fw, T, gate, layout, pool_dtype, index_dtype):
    p, idx, accepted, slots, pool0 = verify_case(T, 3000 + 11 * T, pool_dtype, index_dtype)
    start = start_slots(idx, accepted)
    pool = to_fw(pool0.copy(), fw)
    before = slot_bytes(pool)
    q, k, v, g, beta, A_log, dt_bias = call_inputs(p, fw)
    out = flashkda.decode(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, state_pool=pool,
                          state_indices=to_fw(start, fw), token_state_indices=to_fw(idx, fw), gate=gate,
                          state_layout=layout)
    check_verify(p, pool0, pool, before, out, idx, accepted, layout, gate)


@pytest.mark.parametrize("T, gate, layout, pool_dtype, index_dtype", VERIFY_CASES)
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_verify_with_fused_recurrent_kda_and_random_accepted_counts(fw, T, gate, layout, pool_dtype, index_dtype):
    """ssm_state_indices [N, T] with num_accepted_tokens: request n starts from the slot of its
    last accepted token, and the state after each draft token lands in that token's slot."""
    p, idx, accepted, slots, pool0 = verify_case(T, 4000 + 11 * T, pool_dtype, index_dtype)
    pool = to_fw(pool0.copy(), fw)
    before = slot_bytes(pool)
    q, k, v, g, beta, A_log, dt_bias = call_inputs(p, fw)
    lower_bound = None if gate == "softplus" else -5.0
    out, final = flashkda.fused_recurrent_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                              ssm_state_indices=to_fw(idx, fw),
                                              num_accepted_tokens=to_fw(accepted, fw), lower_bound=lower_bound,
                                              state_v_first=(layout == "vk"))
    assert final is pool
    check_verify(p, pool0, pool, before, out, idx, accepted, layout, gate)


# The verify that writes one state a request (README, "Verify writing one state"): a first call
# with every token_state_indices entry -1 writes out only; once the accepted counts are known, a
# second call over the same inputs writes request n's state after its accepted[n] tokens back to
# its start slot (its other columns -1) and its out goes to a scratch buffer. Against the
# per-token-state verify on the same inputs: the same out and, in each start slot, the state the
# per-token verify wrote for the last accepted token, bit for bit (the same kernel, the same
# arithmetic); every other slot untouched.
ONE_STATE_CASES = [(4, "safe", "vk", "float32", "int64"), (3, "softplus", "kv", "bfloat16", "int32")]


@pytest.mark.parametrize("T, gate, layout, pool_dtype, index_dtype", ONE_STATE_CASES)
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_verify_writing_one_state_matches_the_per_token_verify(fw, T, gate, layout, pool_dtype, index_dtype):
    p, idx, accepted, slots, pool0 = verify_case(T, 5000 + 11 * T, pool_dtype, index_dtype)
    start = start_slots(idx, accepted)
    q, k, v, g, beta, A_log, dt_bias = call_inputs(p, fw)
    common = dict(A_log=A_log, dt_bias=dt_bias, state_indices=to_fw(start, fw), gate=gate, state_layout=layout)

    per_token_pool = to_fw(pool0.copy(), fw)  # the reference: a state per draft token
    per_token_out = flashkda.decode(q, k, v, g, beta, state_pool=per_token_pool,
                                    token_state_indices=to_fw(idx, fw), **common)

    pool = to_fw(pool0.copy(), fw)
    before = slot_bytes(pool)
    none = np.full(idx.shape, -1, dtype=index_dtype)
    out = flashkda.decode(q, k, v, g, beta, state_pool=pool, token_state_indices=to_fw(none, fw), **common)
    assert raw(out) == raw(per_token_out), "the out-only call's out differs from the per-token verify's"
    assert slot_bytes(pool) == before, "the out-only call wrote the pool"

    accepted_column = none.copy()
    for n in range(N):
        if start[n] >= 0:
            accepted_column[n, accepted[n] - 1] = start[n]
    scratch = flashkda.decode(q, k, v, g, beta, state_pool=pool, token_state_indices=to_fw(accepted_column, fw),
                              **common)
    assert raw(scratch) == raw(per_token_out)
    owner = {int(start[n]): n for n in range(N) if start[n] >= 0}  # start slot -> its request
    for s in range(slots):
        if s in owner:
            n = owner[s]
            assert raw(pool[s]) == raw(per_token_pool[int(idx[n, accepted[n] - 1])]), f"request {n}'s state in slot {s}"
        else:
            assert raw(pool[s]) == before[s], f"slot {s} was not a start slot but changed"
    check_verify(p, pool0, per_token_pool, before, per_token_out, idx, accepted, layout, gate)  # the reference itself


@needs_torch
def test_verify_packed_without_num_accepted_tokens_starts_from_column_0():
    """Packed drafts of 3, 1 and 2 tokens with cu_seqlens against [N, 3] slots; without
    num_accepted_tokens every request starts from its column 0 (the Triton kernel's rule); entries
    past a request's tokens are not written."""
    p = make_problem(lengths=[3, 1, 2], H=H, state=None, seed=4500)
    idx = np.array([[4, 0, 8], [6, 1, 2], [3, 5, 7]])
    pool0 = random_pool("float32", 4501, slots=10)
    pool = to_fw(pool0.copy(), "torch")
    before = slot_bytes(pool)
    q, k, v, g, beta, A_log, dt_bias = call_inputs(p, "torch")
    out, _ = flashkda.fused_recurrent_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                          ssm_state_indices=torch.from_numpy(idx),
                                          cu_seqlens=torch.from_numpy(p["cu_seqlens"]), lower_bound=-5.0)
    ref_out, _ = pool_oracle(p, pool0, idx[:, 0], "kv")
    e = rel(out, ref_out)
    assert e <= BAR, f"out: rel error {e:.2e} > {BAR}"
    want = {}
    for n, length in enumerate([3, 1, 2]):
        for t in range(length):
            lo = int(p["cu_seqlens"][n])  # request n's first t + 1 tokens, alone
            one = dict(p, cu_seqlens=None, **{name: np.ascontiguousarray(p[name][:, lo:lo + t + 1])
                                              for name in ("q", "k", "v", "g", "beta")})
            _, ref_state = pool_oracle(one, pool0, idx[n:n + 1, 0], "kv")
            want[int(idx[n, t])] = ref_state[0]
    assert sorted(want) == [0, 3, 4, 5, 6, 8]
    check_slots(pool, before, want, "kv")


# ---------------------------------------------------------------------------------------------
# fused_recurrent_kda: one slot per request, and per-request states

@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("lower_bound", [None, -3.0])
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("inplace", [True, False])
@needs_torch
def test_fused_recurrent_kda_one_slot_per_request(inplace, state_v_first, lower_bound, packed):
    """ssm_state_indices [N], one token per request ([N, 1, H, *], or packed [1, N, H, *] with
    cu_seqlens as engines batch decode tokens); engines' A_log [1, 1, H, 1] and flat dt_bias [H * K]."""
    layout = "vk" if state_v_first else "kv"
    gate = "softplus" if lower_bound is None else "safe"
    p = requests(1, 5000 + 2 * packed + 4 * state_v_first)
    pool0 = random_pool("bfloat16" if inplace else "float32", 5001)
    idx = decode_slots(5002, padding=(2,))
    lb = -5.0 if lower_bound is None else lower_bound
    ref_out, ref_state = pool_oracle(p, pool0, idx, layout, gate, lb)

    t = to_torch(p)
    args = [t[name] for name in ("q", "k", "v", "g", "beta")]
    cu = None
    if packed:
        args = [x.reshape((1, N) + tuple(x.shape[2:])) for x in args]
        cu = torch.arange(N + 1, dtype=torch.int32)
    pool = to_fw(pool0.copy(), "torch")
    before = slot_bytes(pool)
    out, final = flashkda.fused_recurrent_kda(*args, A_log=t["A_log"].reshape(1, 1, H, 1),
                                              dt_bias=t["dt_bias"].reshape(H * K), initial_state=pool,
                                              inplace_final_state=inplace, ssm_state_indices=torch.from_numpy(idx),
                                              cu_seqlens=cu, lower_bound=lower_bound, state_v_first=state_v_first)
    out = out.reshape(N, 1, H, K)
    check_out(out, ref_out, idx)
    written = {int(idx[n]): ref_state[n] for n in range(N) if idx[n] >= 0}
    if inplace:
        assert final is pool
        check_slots(pool, before, written, layout)
    else:
        assert raw(pool) == raw(pool0), "inplace_final_state=False wrote the pool"
        assert final.shape == (N, H, K, K) and final.dtype == torch.float32
        for n in range(N):
            if idx[n] < 0:
                assert (final[n] == 0).all(), "the padding request's final state is not zeros"
            else:
                assert rel(v_major(final[n], layout), ref_state[n]) <= BAR

    # The same step through flashkda.decode: the same numbers, bit for bit.
    pool2 = to_fw(pool0.copy(), "torch")
    out2 = flashkda.decode(*args, A_log=t["A_log"], dt_bias=t["dt_bias"], state_pool=pool2,
                           state_indices=torch.from_numpy(idx), cu_seqlens=cu, lower_bound=lb, gate=gate,
                           state_layout=layout)
    assert torch.equal(out2.reshape(N, 1, H, K), out)
    if inplace:
        assert torch.equal(pool2, pool)


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_fused_recurrent_kda_per_request_states(fw, inplace, state_v_first):
    """Without ssm_state_indices: initial_state [N, H, K, V] (V-major with state_v_first), updated in
    place and returned, or left as it was with a new final state returned."""
    layout = "vk" if state_v_first else "kv"
    p = requests(2, 6000)
    states0 = random_pool("float32", 6001, slots=N)
    ref_out, ref_state = pool_oracle(p, states0, np.arange(N), layout)
    states = to_fw(states0.copy(), fw)
    out, final = kda(call_inputs(p, fw), initial_state=states,
                                              inplace_final_state=inplace, state_v_first=state_v_first,
                                              lower_bound=-5.0)
    assert rel(out, ref_out) <= BAR
    assert (final is states) == inplace
    if not inplace:
        assert raw(states) == raw(states0)
    for n in range(N):
        assert rel(v_major(final[n], layout), ref_state[n]) <= BAR


@needs_torch
def test_fused_recurrent_kda_without_initial_state_starts_from_zero():
    p = requests(3, 6100)
    ref_out, ref_state = pool_oracle(p, np.zeros((N, H, K, K), np.float32), np.arange(N), "kv", "softplus")
    out, final = kda(call_inputs(p, "torch"))  # defaults: softplus, K-major
    assert final.shape == (N, H, K, K) and final.dtype == torch.float32
    assert rel(out, ref_out) <= BAR
    assert rel(final.transpose(-1, -2), ref_state) <= BAR


# ---------------------------------------------------------------------------------------------
# Decode after prefill from the same pool

@pytest.mark.parametrize("gate", ["safe", "softplus"])
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_decode_after_prefill_equals_one_longer_prefill(fw, gate):
    """Prefill 40 tokens into the pool (flashkda.forward with state_indices), then 3 decode steps of
    1 token each (flashkda.decode) from the same pool: the 3 outputs and the final states equal
    those of one forward over the 43 tokens, within the bar of each other and of the oracle."""
    p = make_problem(B=2, T=43, H=H, state=None, seed=7000 + GATE_IDS[gate])
    pool0 = random_pool("float32", 7001, slots=8)
    slots = np.array([6, 3])
    ref_out, ref_state = pool_oracle(p, pool0, slots, "vk", gate)
    x = call_inputs(p, fw)
    acts, params = x[:5], dict(A_log=x[5], dt_bias=x[6])

    def tokens(lo, hi):
        return [to_fw(np.ascontiguousarray(p[name][:, lo:hi]), fw) for name in ("q", "k", "v", "g", "beta")]

    pool = to_fw(pool0.copy(), fw)
    before = slot_bytes(pool)
    si = to_fw(slots, fw)
    _, got = flashkda.forward(*tokens(0, 40), **params, gate=gate, initial_state=pool, state_indices=si)
    assert got is pool
    steps = [as_f64(flashkda.decode(*tokens(t, t + 1), **params, gate=gate, state_pool=pool, state_indices=si))
             for t in range(40, 43)]
    decoded = np.concatenate(steps, axis=1)  # [2, 3, H, V]

    whole_out, whole_state = flashkda.forward(*acts, **params, gate=gate, initial_state=to_fw(pool0[slots], fw),
                                              output_final_state=True)
    tail = as_f64(whole_out)[:, 40:]
    for name, e in (("decode vs one prefill", rel(decoded, tail)), ("decode vs oracle", rel(decoded, ref_out[:, 40:])),
                    ("one prefill vs oracle", rel(tail, ref_out[:, 40:]))):
        assert e <= BAR, f"last 3 outputs, {name}: rel error {e:.2e} > {BAR}"
    for n, s in enumerate(slots):
        for name, e in (("decode vs one prefill", rel(pool[s], as_f64(whole_state[n]))),
                        ("decode vs oracle", rel(pool[s], ref_state[n])),
                        ("one prefill vs oracle", rel(whole_state[n], ref_state[n]))):
            assert e <= BAR, f"final state of request {n}, {name}: rel error {e:.2e} > {BAR}"
    check_slots(pool, before, {int(s): ref_state[n] for n, s in enumerate(slots)}, "vk")


# ---------------------------------------------------------------------------------------------
# Refusals

def _verify_setup(fw, T=3):
    p = requests(T, 8000)
    idx, accepted, slots = verify_slots(T, 8001, "int64")
    pool = to_fw(random_pool("float32", 8002, slots), fw)
    return p, idx, accepted, pool, raw(pool)


@pytest.mark.parametrize("bad", [0, 4, -1])
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_num_accepted_tokens_outside_1_to_T_is_refused(fw, bad):
    p, idx, accepted, pool, before = _verify_setup(fw)
    accepted[3] = bad
    with pytest.raises(ValueError, match=re.escape(f"num_accepted_tokens: expected values in [1, 3] (the tokens "
                                                   f"accepted in each request's previous step") + ".*" +
                       re.escape(f"got num_accepted_tokens[3] = {bad}")):
        kda(call_inputs(p, fw), initial_state=pool, ssm_state_indices=to_fw(idx, fw),
                                     num_accepted_tokens=to_fw(accepted, fw))
    assert raw(pool) == before


@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_num_accepted_tokens_of_the_wrong_kind_or_without_verify_is_refused(fw):
    p, idx, accepted, pool, before = _verify_setup(fw)
    x = call_inputs(p, fw)

    def call(**kw):
        return kda(x, initial_state=pool, **kw)

    with pytest.raises(ValueError, match=re.escape("num_accepted_tokens: expected shape [N] = [4]")):
        call(ssm_state_indices=to_fw(idx, fw), num_accepted_tokens=to_fw(accepted[:3], fw))
    with pytest.raises(TypeError, match=re.escape("num_accepted_tokens: expected an integer dtype")):
        call(ssm_state_indices=to_fw(idx, fw), num_accepted_tokens=to_fw(accepted.astype(np.float32), fw))
    with pytest.raises(ValueError, match=re.escape("num_accepted_tokens: given with ssm_state_indices [N]")):
        call(ssm_state_indices=to_fw(idx[:, 0].copy(), fw), num_accepted_tokens=to_fw(accepted, fw))
    with pytest.raises(ValueError, match=re.escape("num_accepted_tokens: given without ssm_state_indices")):
        kda(x, num_accepted_tokens=to_fw(accepted, fw))
    assert raw(pool) == before


@pytest.mark.parametrize("keyword, says", [
    ("use_qk_l2norm_in_kernel", "flashkda always L2-normalises q and k inside"),
    ("use_gate_in_kernel", "flashkda always computes the log-decay inside, from the raw gate input g"),
    ("use_beta_sigmoid_in_kernel", "flashkda always applies the sigmoid to beta inside"),
])
@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_use_in_kernel_false_is_not_implemented(fw, keyword, says):
    p, idx, accepted, pool, before = _verify_setup(fw)
    with pytest.raises(NotImplementedError, match=re.escape(f"{keyword}=False: {says}")):
        kda(call_inputs(p, fw), initial_state=pool, ssm_state_indices=to_fw(idx, fw),
                                     num_accepted_tokens=to_fw(accepted, fw), **{keyword: False})
    assert raw(pool) == before


@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_not_inplace_with_per_token_slots_is_refused(fw):
    p, idx, accepted, pool, before = _verify_setup(fw)
    with pytest.raises(ValueError, match=re.escape("inplace_final_state=False: with ssm_state_indices [N, T] "
                                                   "(speculative verify) the state after each draft token goes to "
                                                   "its pool slot")):
        kda(call_inputs(p, fw), initial_state=pool, ssm_state_indices=to_fw(idx, fw),
                                     num_accepted_tokens=to_fw(accepted, fw), inplace_final_state=False)
    assert raw(pool) == before


@pytest.mark.parametrize("fw", DEVICE_FRAMEWORKS)
def test_decode_and_pool_arguments_refused_naming_them(fw):
    p = requests(1, 8100)
    x = call_inputs(p, fw)
    acts, params = x[:5], dict(A_log=x[5], dt_bias=x[6])
    pool = to_fw(random_pool("float32", 8101), fw)
    before = raw(pool)
    with pytest.raises(TypeError, match=re.escape("state_pool: required tensor is missing")):
        flashkda.decode(*acts, **params, state_pool=None, state_indices=to_fw(np.arange(N), fw))
    with pytest.raises(TypeError, match=re.escape("state_indices: required tensor is missing")):
        flashkda.decode(*acts, **params, state_pool=pool, state_indices=None)
    with pytest.raises(ValueError, match=re.escape("state_indices: sequences 0 and 2 both write slot 5")):
        flashkda.decode(*acts, **params, state_pool=pool, state_indices=to_fw(np.array([5, 1, 5, 2]), fw))
    with pytest.raises(ValueError, match=re.escape("token_state_indices: sequence 1 writes slot 0, which sequence 0 "
                                                   "starts from in the same buffer")):
        flashkda.decode(*acts, **params, state_pool=pool, state_indices=to_fw(np.array([0, 1, 2, 3]), fw),
                        token_state_indices=to_fw(np.array([[4], [0], [6], [7]]), fw))
    with pytest.raises(ValueError, match=re.escape("gate: expected 'safe' or 'softplus'")):
        flashkda.decode(*acts, **params, state_pool=pool, state_indices=to_fw(np.arange(N), fw), gate="sigmoid")
    with pytest.raises(ValueError, match=re.escape("ssm_state_indices: given without initial_state")):
        kda(x, ssm_state_indices=to_fw(np.arange(N), fw))
    with pytest.raises(ValueError, match=re.escape("ssm_state_indices: expected [N] (a slot per request) or [N, T]")):
        kda(x, initial_state=pool, ssm_state_indices=to_fw(np.zeros((N, 1, 1), np.int64), fw))
    assert raw(pool) == before


def test_decode_pools_of_jax_arrays_are_refused():
    p = requests(1, 8200)
    pool = FakeJaxArray(random_pool("float32", 8201))
    x = call_inputs(p, "numpy")
    message = re.escape("state pools are updated in place, and JAX arrays are immutable")
    with pytest.raises(TypeError, match="state_pool: " + message):
        flashkda.decode(*x[:5], A_log=x[5], dt_bias=x[6], state_pool=pool, state_indices=np.arange(N))
    with pytest.raises(TypeError, match="ssm_state_indices: " + message):
        kda(x, initial_state=pool, ssm_state_indices=np.arange(N))
    with pytest.raises(TypeError, match=re.escape("initial_state: inplace_final_state=True writes the final states "
                                                  "into it, and JAX arrays are immutable")):
        kda(x, initial_state=FakeJaxArray(random_pool("float32", 8202, slots=N)))


# ---------------------------------------------------------------------------------------------
# torch: the custom op with per-token states, torch.compile

@needs_torch
def test_opcheck_in_place_op_with_per_token_states():
    p = to_torch(requests(2, 9000))
    pool = torch.from_numpy(random_pool("float32", 9001))
    out = torch.zeros(N, 2, H, K, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5], [-1, 6]])
    args = (p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], None, None, out, pool, None, None,
            -5.0, K ** -0.5, 1, True, torch.tensor([1, 2, 11, 7]), None, 1, True, None, idx)
    torch.library.opcheck(torch.ops.flashkda.forward_out.default, args)


def _compile_available():
    try:
        import torch._dynamo

        return torch._dynamo.is_dynamo_supported()
    except Exception:  # noqa: BLE001
        return False


@needs_torch
@pytest.mark.skipif(torch is None or not _compile_available(),
                    reason="torch.compile (dynamo) is not supported on this platform")
@pytest.mark.parametrize("call", ["decode", "verify"])
def test_torch_compile_fullgraph_decode_updates_the_pool(call):
    torch._dynamo.reset()
    T = 1 if call == "decode" else 3
    p = to_torch(requests(T, 9100))
    idx, accepted, slots = verify_slots(T, 9101, "int64")
    pool0 = torch.from_numpy(random_pool("float32", 9102, slots))
    if call == "decode":
        idx, accepted = idx[:, 0].copy(), None
        idx[2] = -1
    idx, accepted = torch.from_numpy(idx), None if accepted is None else torch.from_numpy(accepted)

    def step(q, k, v, g, beta, A_log, dt_bias, pool, idx, accepted):
        if call == "decode":
            out = flashkda.decode(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, state_pool=pool, state_indices=idx,
                                  gate="softplus", state_layout="kv")
        else:
            out, _ = flashkda.fused_recurrent_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                                  initial_state=pool, ssm_state_indices=idx,
                                                  num_accepted_tokens=accepted)
        return out.float().sum(-1)

    def run(fn, pool):
        return fn(p["q"], p["k"], p["v"], p["g"], p["beta"], p["A_log"], p["dt_bias"], pool, idx, accepted)

    want_pool = pool0.clone()
    want = run(step, want_pool)
    assert not torch.equal(want_pool, pool0)
    pool = pool0.clone()
    got = run(torch.compile(step, fullgraph=True, backend="aot_eager"), pool)
    assert torch.equal(pool, want_pool), "the compiled call did not update the pool as the eager one does"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# CUDA graphs: how engines run decode

@needs_torch
@needs_cuda[0]
@needs_cuda[1]
def test_cuda_decode_in_a_captured_graph_replayed_with_new_slots_and_inputs():
    """One decode step captured in a torch CUDA graph (pool, indices, inputs and out in fixed
    buffers), replayed with new slots and inputs copied in: each replay matches the oracle, the
    padding request's out rows and every slot not addressed stay as they were."""
    T = 1
    x = [to_fw(a, "cuda") for a in call_inputs(requests(T, 9900), "numpy")]
    pool = to_fw(random_pool("float32", 9901), "cuda")
    idx = torch.arange(N, dtype=torch.int32, device="cuda")
    out = torch.full((N, T, H, K), SENTINEL, dtype=torch.bfloat16, device="cuda")

    def step():
        flashkda.decode(*x[:5], A_log=x[5], dt_bias=x[6], state_pool=pool, state_indices=idx, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for r in range(3):
        p = requests(T, 9910 + r)
        for dst, src in zip(x, call_inputs(p, "cuda")):
            dst.copy_(src)
        slots = decode_slots(9920 + r, padding=(r,))
        idx.copy_(torch.from_numpy(slots.astype(np.int32)))
        out.fill_(SENTINEL)
        pool0 = pool.cpu().numpy()
        before = slot_bytes(pool)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_state = pool_oracle(p, pool0, slots, "vk")
        check_out(out, ref_out, slots, sentinel=SENTINEL)
        check_slots(pool, before, {int(slots[n]): ref_state[n] for n in range(N) if slots[n] >= 0}, "vk")
