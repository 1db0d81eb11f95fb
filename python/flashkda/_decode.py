"""Decode entry points over the pool calls: flashkda.decode (this library's own call) and
flashkda.fused_recurrent_kda (the keywords of the Triton decode kernel, as engines call it).

Both are thin: they resolve the arguments (scale, gate, layout, the start slots of a speculative
verify) and run the one call under flashkda.fwd (_api._run_into), which writes ``out`` and the
state pool in place. Everything else (shapes, dtypes, slot rules) is the C++ validation's, whose
errors come through as they are. On CUDA tensors the call runs the recurrent kernel (one read
and one write of each state); on host arrays the CPU backend.
"""

from __future__ import annotations

from . import _api, _frameworks

_torch = _api._torch


# ---------------------------------------------------------------------------------------------
# Helpers

def _zeros(like, shape, dtype):
    """Zeros of `shape` in the framework of `like` (on its device). `dtype`: "bfloat16", or a
    dtype of that framework (a pool's)."""
    if _api._is_torch(like):
        if isinstance(dtype, str):
            dtype = getattr(_torch, dtype)
        return _torch.zeros(shape, dtype=dtype, device=like.device)
    fw = _frameworks.framework_of(like)
    return _frameworks._Allocator(like, _frameworks._stream_handle(fw, None)).empty(shape, dtype, zeros=True)


def _zero_out(q, v):
    """The ``out`` a decode call allocates: zeros, as padding requests' rows are not written."""
    _frameworks.check_rank(q, v)
    if _api._is_torch(q):  # shapes kept symbolic under torch.compile
        return q.new_zeros((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), dtype=_torch.bfloat16)
    return _zeros(q, (int(q.shape[0]), int(q.shape[1]), int(q.shape[2]), int(v.shape[3])), "bfloat16")


def _size(x) -> int:
    n = 1
    for d in x.shape:
        n *= int(d)
    return n


def _array_module(name: str, x):
    """NumPy or CuPy, for index arithmetic on `x` (torch tensors are handled apart)."""
    fw = _frameworks.framework_of(x)
    if fw == "numpy":
        import numpy

        return numpy
    if fw == "cupy":
        import cupy

        return cupy
    raise TypeError(f"{name}: expected a torch tensor, a NumPy or a CuPy array, got {type(x).__name__}")


def _start_slots(ssm_state_indices, num_accepted_tokens):
    """The slot each request of a speculative verify starts from: ssm_state_indices[n,
    num_accepted_tokens[n] - 1] ([N], the indices' dtype, contiguous); column 0 without
    num_accepted_tokens. Checks num_accepted_tokens: [N] integers in [1, T]."""
    idx = ssm_state_indices
    N, T = int(idx.shape[0]), int(idx.shape[1])
    torch_idx = _api._is_torch(idx)
    if num_accepted_tokens is None:
        if torch_idx:
            return idx[:, 0].contiguous()
        return _array_module("ssm_state_indices", idx).ascontiguousarray(idx[:, 0])
    nat = num_accepted_tokens
    if not _api._is_array(nat):
        raise TypeError(f"num_accepted_tokens: expected a tensor or array of integers [N], got {type(nat).__name__}")
    shape = tuple(int(d) for d in _frameworks.shape_of("num_accepted_tokens", nat))
    if shape != (N,):
        raise ValueError(
            f"num_accepted_tokens: expected shape [N] = [{N}] (one count per row of ssm_state_indices [N, T] = "
            f"[{N}, {T}]), got {list(shape)}"
        )
    if torch_idx:
        if not _api._is_torch(nat):
            raise TypeError(f"num_accepted_tokens: expected a torch tensor beside torch ssm_state_indices, "
                            f"got {type(nat).__name__}")
        if nat.dtype.is_floating_point or nat.dtype.is_complex or nat.dtype == _torch.bool:
            raise TypeError(f"num_accepted_tokens: expected an integer dtype (int32 or int64), got {nat.dtype}")
        if _torch_checkable(nat):  # not under torch.compile / fake tensors: values need the data
            bad = (nat < 1) | (nat > T)
            if bool(bad.any()):
                n = int(bad.nonzero()[0, 0])
                _bad_count(n, int(nat[n]), T)
        return idx.gather(1, (nat.to(_torch.int64) - 1).unsqueeze(1)).squeeze(1)
    xp = _array_module("ssm_state_indices", idx)
    if _frameworks.framework_of(nat) != _frameworks.framework_of(idx):
        raise TypeError(f"num_accepted_tokens: expected an array of ssm_state_indices' framework "
                        f"({type(idx).__name__}), got {type(nat).__name__}")
    if nat.dtype.kind not in "iu":
        raise TypeError(f"num_accepted_tokens: expected an integer dtype (int32 or int64), got {nat.dtype}")
    bad = (nat < 1) | (nat > T)
    if bool(bad.any()):
        n = int(xp.flatnonzero(bad)[0])
        _bad_count(n, int(nat[n]), T)
    return xp.ascontiguousarray(xp.take_along_axis(idx, (nat.astype(xp.int64) - 1)[:, None], axis=1)[:, 0])


def _torch_checkable(x) -> bool:
    return type(x) is _torch.Tensor and not _torch.compiler.is_compiling() and x.device.type != "meta" \
        and _torch._C._len_torch_dispatch_stack() == 0


def _bad_count(n: int, value: int, T: int):
    raise ValueError(
        f"num_accepted_tokens: expected values in [1, {T}] (the tokens accepted in each request's previous step: "
        f"at least 1, at most the {T} columns of ssm_state_indices), got num_accepted_tokens[{n}] = {value}"
    )


def _arange_like(indices, n: int):
    """0 .. n-1 in the framework, device and dtype of `indices`."""
    if _api._is_torch(indices):
        return _torch.arange(n, dtype=indices.dtype, device=indices.device)
    xp = _array_module("ssm_state_indices", indices)
    return xp.arange(n, dtype=indices.dtype)


def _head_shaped(A_log, dt_bias, q):
    """A_log as [H] and dt_bias as [H, K] when they hold H and H * K numbers in another shape
    (engines keep A_log as [1, 1, H, 1] and dt_bias as the flat [H * K] projection bias); views of
    contiguous tensors, no copies. Anything else is passed on for the C++ validation to judge."""
    shape = getattr(q, "shape", None)
    if shape is None or len(shape) != 4:
        return A_log, dt_bias
    H, K = int(shape[2]), int(shape[3])
    if A_log is not None and hasattr(A_log, "reshape") and tuple(A_log.shape) != (H,) and _size(A_log) == H:
        A_log = A_log.reshape(H)
    if dt_bias is not None and hasattr(dt_bias, "reshape") and tuple(dt_bias.shape) != (H, K) \
            and _size(dt_bias) == H * K:
        dt_bias = dt_bias.reshape(H, K)
    return A_log, dt_bias


# ---------------------------------------------------------------------------------------------
# flashkda.decode

def decode(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    state_pool,
    state_indices,
    lower_bound: float = -5.0,
    gate: str = "safe",
    scale: float | None = None,
    state_layout: str = "vk",
    token_state_indices=None,
    cu_seqlens=None,
    out=None,
):
    """A decode step over a state pool: a few tokens per request (usually one), each request
    continuing from its slot of ``state_pool`` and writing its new state back there, in place.
    Returns ``out``.

    Args:
        q, k, g: bfloat16 ``[N, T, H, K]`` (``T`` a few tokens, usually 1), or packed
            ``[1, total, H, K]`` with ``cu_seqlens``; v: bfloat16 ``[N, T, H, V]``; beta: bfloat16
            ``[N, T, H]`` logits. The same inputs as :func:`forward` (q and k normalised, the gate
            and beta's sigmoid applied inside).
        A_log: float32 ``[H]``; dt_bias: float32 ``[H, K]``.
        state_pool: ``[P, H, V, K]`` (``[P, H, K, V]`` with ``state_layout="kv"``), float32 or
            bfloat16: the engine's states, read and written in place.
        state_indices: int64 or int32 ``[N]``: request ``n`` starts from slot
            ``state_indices[n]`` and, without ``token_state_indices``, writes its state after its
            last token back to that slot. Negative: a padding request, skipped (its ``out`` rows
            are not written: zeros in an ``out`` allocated here).
        lower_bound, gate, scale, state_layout, cu_seqlens: as in :func:`forward`.
        token_state_indices: optional int64 or int32 ``[N, T]``: per-token states (speculative
            verify): the state after token ``t`` of request ``n`` goes to slot
            ``token_state_indices[n, t]`` (negative: not written), and no final state is written
            (the last token's entry is that). The start slot is still ``state_indices[n]``.
        out: optional bfloat16 ``[N, T, H, V]`` to write into.

    The slot rules of pools hold (no slot written twice, none written by one request and read by
    another; ``ValueError`` naming the indices otherwise, nothing written); slots nobody writes stay
    bit for bit as they were. CUDA tensors run the recurrent kernel, which CUDA graphs can capture
    (no host synchronisation while capturing; replay with new indices and inputs in the same
    buffers). Not for JAX arrays (immutable: ``TypeError``).
    """
    if state_pool is None:
        raise TypeError("state_pool: required tensor is missing (the [P, H, V, K] pool the requests' states live in)")
    if state_indices is None:
        raise TypeError("state_indices: required tensor is missing (the [N] slots of the requests in state_pool)")
    gate_id = _api._gate_id(gate)
    layout = _api._state_layout_id(state_layout)
    scale = _api._default_scale(q) if scale is None else _api._number("scale", scale)
    lower_bound = _api._number("lower_bound", lower_bound)
    _api._refuse_jax_writes("state_pool", state_pool, (q, out), _api._JAX_POOLS)
    if out is None:
        _api._check_tensors((q, k, v))  # the required tensors read below, named before allocating
        out = _zero_out(q, v)
    _api._run_into(q, k, v, g, beta, A_log, dt_bias, out, state_pool, state_pool, cu_seqlens,
                   lower_bound=lower_bound, scale=scale, gate_id=gate_id, layout=layout,
                   state_indices=state_indices, token_state_indices=token_state_indices)
    return out


# ---------------------------------------------------------------------------------------------
# flashkda.fused_recurrent_kda

_REFUSED_KEYWORDS = {
    "use_qk_l2norm_in_kernel": (
        "flashkda always L2-normalises q and k inside (x / sqrt(sum x^2 + 1e-6), over K) and has no path "
        "without it; pass the raw q and k with use_qk_l2norm_in_kernel=True (q and k that are normalised "
        "already change only by the factor 1 / sqrt(1 + 1e-6))"
    ),
    "use_gate_in_kernel": (
        "flashkda always computes the log-decay inside, from the raw gate input g with A_log and dt_bias "
        "(lower_bound=None: -exp(A_log) * softplus(g + dt_bias); a number: lower_bound * sigmoid(exp(A_log) * "
        "(g + dt_bias))), and takes no precomputed decay; pass the raw g with use_gate_in_kernel=True"
    ),
    "use_beta_sigmoid_in_kernel": (
        "flashkda always applies the sigmoid to beta inside (beta is a logit) and takes no precomputed write "
        "strength; pass the logit with use_beta_sigmoid_in_kernel=True"
    ),
}


def fused_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    scale: float | None = None,
    initial_state=None,
    inplace_final_state: bool = True,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel: bool = True,
    use_gate_in_kernel: bool = True,
    use_beta_sigmoid_in_kernel: bool = True,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    out=None,
):
    """The Triton decode kernel's call (``fused_recurrent_kda`` as engines call it), on this
    library: returns ``(out, final_state)``.

    Args:
        q, k, v, g, beta: ``[B, T, H, *]`` bfloat16 (beta ``[B, T, H]``), or packed
            ``[1, total, H, *]`` with ``cu_seqlens`` (int64 or int32 ``[N + 1]``); g is the raw gate
            input and beta a logit (see the refusals below).
        A_log: float32 with ``H`` numbers (``[H]``, or ``[1, 1, H, 1]`` as engines keep it);
            dt_bias: float32 with ``H * K`` numbers (``[H, K]`` or the flat ``[H * K]``).
        scale: ``None`` means ``K ** -0.5``.
        initial_state: with ``ssm_state_indices``, the state pool ``[P, H, K, V]`` (``[P, H, V, K]``
            with ``state_v_first=True``), float32 or bfloat16. Without it, ``[N, H, K, V]``, one
            state per request (``None``: zeros).
        inplace_final_state: ``True``: the final states are written into the pool (or into
            ``initial_state``), which is returned as ``final_state``. ``False``: the pool is left as
            it was and the final states come back as a new ``[N, H, K, V]`` tensor (zeros for
            padding requests); refused (``ValueError``) with ``ssm_state_indices [N, T]``, whose
            states only go to pool slots.
        ssm_state_indices: int64 or int32. ``[N]``: one slot per request, read and (in place)
            written. ``[N, T]``: speculative verify: request ``n`` starts from slot
            ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` (column 0 without
            ``num_accepted_tokens``) and the state after its draft token ``t`` goes to slot
            ``ssm_state_indices[n, t]``. Negative indices: padding (the request is skipped; its
            ``out`` rows are zeros in an ``out`` allocated here), or, for a draft token, not
            written. The pool's slot rules hold (errors name flashkda's ``state_indices`` /
            ``token_state_indices``, onto which these map).
        num_accepted_tokens: int64 or int32 ``[N]``, values in ``[1, T]`` (checked: ``ValueError``
            naming it), with ``ssm_state_indices [N, T]`` only.
        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel: must be ``True``
            (the defaults): flashkda always normalises q and k, computes the gate from the raw g and
            applies beta's sigmoid inside; ``False`` raises ``NotImplementedError`` naming the
            keyword, never computes something else.
        lower_bound: ``None``: the softplus gate; a number in ``[-5, 0)``: the safe gate with that
            bound.
        state_v_first: ``False`` (default): K-major states ``[.., K, V]``; ``True``: V-major
            ``[.., V, K]`` (this library's native layout).
        out: optional bfloat16 ``[B, T, H, V]`` to write into.

    CUDA tensors run the recurrent kernel (pools, per-token states, both layouts, both gates).
    """
    for name, value in (("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
                        ("use_gate_in_kernel", use_gate_in_kernel),
                        ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)):
        if not value:
            raise NotImplementedError(f"{name}={value!r}: {_REFUSED_KEYWORDS[name]}")
    gate_id = 1 if lower_bound is None else 0
    lower_bound = -5.0 if lower_bound is None else _api._number("lower_bound", lower_bound)
    layout = 0 if state_v_first else 1
    scale = _api._default_scale(q) if scale is None else _api._number("scale", scale)
    A_log, dt_bias = _head_shaped(A_log, dt_bias, q)
    run = dict(lower_bound=lower_bound, scale=scale, gate_id=gate_id, layout=layout)
    inputs = (q, k, v, g, beta, A_log, dt_bias)

    if ssm_state_indices is None:
        if num_accepted_tokens is not None:
            raise ValueError("num_accepted_tokens: given without ssm_state_indices; it picks each request's start "
                             "slot in ssm_state_indices [N, T] (speculative verify)")
        if inplace_final_state and initial_state is not None:
            _api._refuse_jax_writes("initial_state", initial_state, (q, out),
                                    "inplace_final_state=True writes the final states into it, and JAX arrays are "
                                    "immutable; pass inplace_final_state=False (a new final state is returned)")
        _api._check_tensors(inputs)
        if out is None:
            out = _zero_out(q, v)
        if inplace_final_state and initial_state is not None:
            final_state = initial_state
        else:
            _, shape = _frameworks._output_shapes(q, v, cu_seqlens, layout)
            final_state = _zeros(q, shape, "float32" if initial_state is None else initial_state.dtype)
        _api._run_into(*inputs, out, initial_state, final_state, cu_seqlens, **run)
        return out, final_state

    if initial_state is None:
        raise ValueError("ssm_state_indices: given without initial_state; with ssm_state_indices, initial_state is "
                         "the state pool [P, H, K, V] ([P, H, V, K] with state_v_first=True) the requests read and "
                         "write: pass it (zeros for fresh slots)")
    if not _api._is_array(ssm_state_indices):
        raise TypeError(f"ssm_state_indices: expected a tensor or array of integers, got "
                        f"{type(ssm_state_indices).__name__}")
    _api._refuse_jax_writes("ssm_state_indices", ssm_state_indices, (q, initial_state, out), _api._JAX_POOLS)
    _api._check_tensors(inputs)
    ndim = len(_frameworks.shape_of("ssm_state_indices", ssm_state_indices))
    if ndim == 1:
        if num_accepted_tokens is not None:
            raise ValueError("num_accepted_tokens: given with ssm_state_indices [N], one slot per request; it "
                             "applies to speculative verify, with ssm_state_indices [N, T]")
        if out is None:
            out = _zero_out(q, v)
        if inplace_final_state:
            _api._run_into(*inputs, out, initial_state, initial_state, cu_seqlens, state_indices=ssm_state_indices,
                           **run)
            return out, initial_state
        n = int(ssm_state_indices.shape[0])
        final_state = _zeros(q, (n,) + tuple(int(d) for d in initial_state.shape[1:]), initial_state.dtype)
        _api._run_into(*inputs, out, initial_state, final_state, cu_seqlens, state_indices=ssm_state_indices,
                       final_state_indices=_arange_like(ssm_state_indices, n), **run)
        return out, final_state
    if ndim != 2:
        raise ValueError(f"ssm_state_indices: expected [N] (a slot per request) or [N, T] (speculative verify), got "
                         f"shape {list(ssm_state_indices.shape)}")
    if not inplace_final_state:
        raise ValueError(
            "inplace_final_state=False: with ssm_state_indices [N, T] (speculative verify) the state after each "
            "draft token goes to its pool slot ssm_state_indices[n, t], in place, and there is no one final state per "
            "request to return in a new tensor; pass inplace_final_state=True (the pool is returned as final_state)"
        )
    start = _start_slots(ssm_state_indices, num_accepted_tokens)
    if out is None:
        out = _zero_out(q, v)
    _api._run_into(*inputs, out, initial_state, initial_state, cu_seqlens, state_indices=start,
                   token_state_indices=ssm_state_indices, **run)
    return out, initial_state
