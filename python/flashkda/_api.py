"""The Python API: forward(), fwd() and info(), over the native extension flashkda._ext (the
decode entry points, decode() and fused_recurrent_kda(), are in _decode, over _run_into here).

Torch tensors go through the torch.library custom ops of _torch_ops (so torch.compile traces
through them); every other framework through _frameworks, which allocates outputs in the
caller's framework. Either way the tensors reach the C++ API through DLPack without copies.
"""

from __future__ import annotations

from . import _ext, _frameworks

try:  # torch is optional: without it the custom ops are simply not registered.
    import torch as _torch
except ImportError:  # pragma: no cover - exercised on machines without torch
    _torch = None

if _torch is not None:
    from . import _torch_ops
else:  # pragma: no cover
    _torch_ops = None

_GATES = {"safe": 0, "softplus": 1}
_STATE_LAYOUTS = {"vk": 0, "kv": 1}  # flashkda::StateLayout: V-major [.., V, K], K-major [.., K, V]


def _gate_id(gate) -> int:
    if isinstance(gate, str) and gate in _GATES:
        return _GATES[gate]
    raise ValueError(f"gate: expected 'safe' or 'softplus', got {gate!r}")


def _state_layout_id(state_layout) -> int:
    if isinstance(state_layout, str) and state_layout in _STATE_LAYOUTS:
        return _STATE_LAYOUTS[state_layout]
    raise ValueError(
        f"state_layout: expected 'vk' (V-major states [.., V, K]) or 'kv' (K-major [.., K, V]), got {state_layout!r}"
    )


def _refuse_jax_writes(name: str, target, arrays, why: str) -> None:
    """Refuses, naming `name`, an in-place write into `target` when it or one of `arrays` is a
    JAX array: JAX arrays are immutable (and may share their buffers)."""
    if target is None:
        return
    for x in (target,) + tuple(arrays):
        if x is not None and _frameworks.framework_of(x) == "jax":
            raise TypeError(f"{name}: {why}")


_JAX_POOLS = ("state pools are updated in place, and JAX arrays are immutable; pools take torch tensors, "
              "NumPy or CuPy arrays (for JAX, pass [N, H, V, K] states without state_indices and gather / "
              "scatter the pool yourself)")
_JAX_CHECKPOINTS = ("it is written in place, and JAX arrays are immutable; for JAX, call "
                    "flashkda.forward(..., checkpoint_offsets=offsets) without checkpoint_state: it returns the "
                    "checkpoint states as a new array")


def _check_workspace(workspace) -> None:
    """workspace= (fwd): a writable buffer of any framework but JAX's (it is scratch memory,
    written by the kernels); its size and device are checked where it is used (the CUDA path)."""
    if workspace is None:
        return
    if not _is_array(workspace):
        raise TypeError(
            f"workspace: expected a tensor or array (a torch uint8 tensor on q's device, say), "
            f"got {type(workspace).__name__}"
        )
    if _frameworks.framework_of(workspace) == "jax":
        raise TypeError(
            "workspace: it is written as scratch memory, and JAX arrays are immutable; pass workspace=None "
            "(a workspace is then allocated per call)"
        )


def _default_scale(q) -> float:
    shape = _frameworks.shape_of("q", q)
    if len(shape) != 4:
        raise ValueError(
            f"q: expected 4 dimensions [B, T, H, K], got {len(shape)} dimensions with shape {list(shape)}"
        )
    return float(shape[3]) ** -0.5


def _is_torch(x) -> bool:
    return _torch is not None and isinstance(x, _torch.Tensor)


def _is_array(x) -> bool:
    """What the extension can import: DLPack, the array interfaces or the buffer protocol."""
    if _is_torch(x) or hasattr(x, "__dlpack__") or hasattr(x, "__array_interface__") \
            or hasattr(x, "__cuda_array_interface__"):
        return True
    try:
        memoryview(x)
    except TypeError:
        return False
    return True


# The tensor arguments in the extension's order, and which of them forward() requires (the C++
# argument table, src/api/arguments.h, through the extension).
_TENSOR_NAMES = tuple(_ext.ARG_NAMES)
_REQUIRED = tuple(_ext.ARG_REQUIRED)


def _check_tensors(tensors, allocated=()) -> None:
    """Refuses, naming the argument, what no backend can take: None for a required tensor (one
    this call does not allocate itself: `allocated` names those), an object that is no array (a
    list, a number), and, with torch grad mode on, a torch tensor that requires grad (flashkda
    has no backward yet). `tensors` are in _TENSOR_NAMES order."""
    grad = _torch is not None and _torch.is_grad_enabled()
    for name, required, x in zip(_TENSOR_NAMES, _REQUIRED, tensors):
        if x is None:
            if required and name not in allocated:
                raise TypeError(f"{name}: required tensor is missing")
        elif _is_torch(x):
            if grad and x.requires_grad:
                raise RuntimeError(
                    f"{name}: requires grad, but flashkda is inference only (there is no backward yet): "
                    f"call it under torch.no_grad() or torch.inference_mode(), or pass {name}.detach()"
                )
        elif not _is_array(x):
            raise TypeError(
                f"{name}: expected a tensor or array (torch, NumPy, CuPy, JAX; anything with "
                f"DLPack or the buffer protocol), got {type(x).__name__}"
            )


def _number(name: str, x) -> float:
    """A scalar argument as a float; TypeError naming it for anything that is not a real number."""
    if type(x) is float or type(x) is int:
        return float(x)
    if not isinstance(x, (bool, str, bytes, complex)) and hasattr(type(x), "__float__"):
        try:  # NumPy scalars, one-element arrays and tensors
            return float(x)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"{name}: expected a real number, got {type(x).__name__}")


def forward(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    lower_bound: float = -5.0,
    gate: str = "safe",
    scale: float | None = None,
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens=None,
    out=None,
    check_cu_seqlens: bool = True,
    state_indices=None,
    final_state_indices=None,
    state_layout: str = "vk",
    checkpoint_offsets=None,
    checkpoint_state=None,
    stream=None,
):
    """Kimi Delta Attention forward; returns ``(out, final_state)``, or
    ``(out, final_state, checkpoint_state)`` when ``checkpoint_offsets`` is given.

    Args:
        q, k: bfloat16 ``[B, T, H, K]`` queries and keys (L2-normalised inside).
        v: bfloat16 ``[B, T, H, V]`` values.
        g: bfloat16 ``[B, T, H, K]`` gate before activation.
        beta: bfloat16 ``[B, T, H]`` write strength as a logit (sigmoid inside).
        A_log: float32 ``[H]``; dt_bias: float32 ``[H, K]``.
        lower_bound: bound of the "safe" gate, in ``[-5, 0)``.
        gate: ``"safe"`` or ``"softplus"``.
        scale: output scale; ``None`` means ``K ** -0.5``.
        initial_state: optional ``[N, H, V, K]`` bfloat16 or float32 state before each sequence.
        output_final_state: also return the state after each sequence, ``[N, H, V, K]``, with
            ``initial_state``'s dtype (float32 when there is no initial state).
        cu_seqlens: optional int64 or int32 ``[N + 1]`` offsets of a packed batch (then ``B = 1``).
        out: optional bfloat16 ``[B, T, H, V]`` to write into (else one is allocated).
        check_cu_seqlens: for CUDA tensors, copy ``cu_seqlens`` to the host and check its values
            before launching (a stream synchronisation, skipped anyway while the stream is being
            captured into a CUDA graph). ``False`` skips it for the lowest latency: the kernels
            still never read out of bounds, but bad offsets then give undefined results.
        state_indices: optional int64 or int32 ``[N]``: makes ``initial_state`` a *pool* of
            slots ``[P, H, V, K]``, updated in place. Sequence ``n`` starts from slot
            ``state_indices[n]`` and its final state is written back to that slot (or to
            ``final_state_indices[n]``). A negative index marks a padding sequence: it is
            skipped, its ``out`` rows are not written (zeros in an ``out`` allocated here; an
            ``out=`` keeps its values). Slots no sequence writes are left bit for bit as they
            were. ``initial_state`` is required with it; ``output_final_state`` is then
            ignored: the pool is the output, returned as ``final_state``. Indices outside the
            pool, two sequences writing one slot, and a slot written by one sequence and read by
            another are refused (``ValueError``). On CUDA tensors pools run on the chunked
            prefill (decode-shaped calls on the recurrent kernel); not for JAX arrays (immutable: ``TypeError``).
        final_state_indices: optional int64 or int32 ``[N]`` (needs ``state_indices``): the slot
            of the pool each sequence's final state goes to; negative: not written.
        state_layout: ``"vk"`` (default): states are V-major ``[.., V, K]``; ``"kv"``: K-major
            ``[.., K, V]`` (fla's recurrent layout), for the pool, ``initial_state`` and the
            ``final_state`` allocated here alike.
        checkpoint_offsets: optional int64 or int32 ``[N, C]``: prefix checkpoints. Entry
            ``[n, c] = t`` asks for the state of sequence ``n`` after its first ``t`` tokens, equal
            (bit for bit, on the same backend) to the final state of a prefill of those ``t``
            tokens from the same initial state. Offsets are multiples of 16, at most the
            sequence's length, non-decreasing along ``c`` (0 gives the initial state); a negative
            offset is an unused entry, not written. Bad offsets are refused (``ValueError``,
            naming ``checkpoint_offsets``). With it the call returns a third value, the
            checkpoint states. On CUDA tensors bit for bit where the prefix prefill takes the
            same kernels and state-pass layout (docs/contract.md).
        checkpoint_state: optional float32 ``[N, C, H, V, K]`` (``[N, C, H, K, V]`` with
            ``state_layout="kv"``) the checkpoints are written into, in place, and returned as
            the third value (unused entries keep their values). Without it (and with
            ``checkpoint_offsets``) the call allocates one in ``q``'s framework, zero-filled, so
            unused entries are zeros. Only with ``checkpoint_offsets`` (alone it is refused); not
            for JAX arrays (immutable: ``TypeError``; let the call allocate it instead).
        stream: for CUDA arrays of frameworks other than torch: the stream to run on (an int
            ``cudaStream_t`` or an object with ``.ptr`` / ``.cuda_stream``). Torch tensors always
            run on ``torch.cuda.current_stream()``; use ``with torch.cuda.stream(s):``.

    Returns:
        ``(out, final_state)``, arrays of the caller's framework; ``final_state`` is ``None``
        unless ``output_final_state``. With ``state_indices``, ``final_state`` is the pool
        itself (``initial_state``, updated in place). With ``checkpoint_offsets``, a 3-tuple
        ``(out, final_state, checkpoint_state)``: the arity follows whether checkpoints are
        asked for, never whether the buffer was passed, so calls without checkpoints keep
        their 2-tuple.

    Raises:
        TypeError for a wrong dtype, a non-array argument, a missing (None) required tensor or a
        non-number scalar; ValueError for a wrong shape, layout, device (meta tensors have no
        data) or value; NotImplementedError for what this backend does not support yet (head
        sizes other than 128, the softplus gate on CUDA); RuntimeError for CUDA failures, and for
        torch tensors that require grad while grad mode is on: flashkda is inference only (no
        backward yet), so call it under ``torch.no_grad()`` or ``torch.inference_mode()``, or
        pass detached tensors. The messages name the argument, the expectation and what was given.
    """
    _check_tensors((q, k, v, g, beta, A_log, dt_bias, out, initial_state, None, cu_seqlens, state_indices,
                    final_state_indices, checkpoint_offsets, checkpoint_state), allocated=("out",))
    gate_id = _gate_id(gate)
    layout = _state_layout_id(state_layout)
    scale = _default_scale(q) if scale is None else _number("scale", scale)
    lower_bound = _number("lower_bound", lower_bound)
    if state_indices is not None and initial_state is None:
        raise ValueError(
            "state_indices: given without initial_state; with state_indices, initial_state is the pool "
            "[P, H, V, K] the sequences start from and their final states are written to (in place): pass it "
            "(zeros for fresh slots), or flashkda.fwd(..., final_state=pool) to start from zero states"
        )
    _refuse_jax_writes("state_indices", state_indices, (q, initial_state, out), _JAX_POOLS)
    _refuse_jax_writes("checkpoint_state", checkpoint_state, (q, initial_state, out), _JAX_CHECKPOINTS)
    if _is_torch(q):
        if stream is not None:
            raise ValueError(
                "stream: torch tensors run on torch.cuda.current_stream(); "
                "select a stream with `with torch.cuda.stream(s):` instead of stream="
            )
        return _torch_ops.forward(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out,
            lower_bound, scale, gate_id, bool(output_final_state), bool(check_cu_seqlens),
            state_indices, final_state_indices, layout, checkpoint_offsets, checkpoint_state,
        )
    return _frameworks.forward(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out,
        lower_bound, scale, gate_id, bool(output_final_state), bool(check_cu_seqlens), stream,
        state_indices, final_state_indices, layout, checkpoint_offsets, checkpoint_state,
    )


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None, *, check_cu_seqlens=True, state_indices=None, final_state_indices=None, state_layout="vk",
        checkpoint_state=None, checkpoint_offsets=None, workspace=None):
    """The call of the existing ``flash_kda.fwd``: writes ``out`` (and ``final_state``) in place.

    Same arguments and layouts as :func:`forward` (state ``[N, H, V, K]``), given positionally in
    ``flash_kda.fwd``'s order; ``final_state``, when given, is written with the state after each
    sequence. ``scale=None`` means ``K ** -0.5``, as in :func:`forward`. Returns None. Unlike the
    original it also takes CPU tensors (the CPU backend), and refuses bad arguments with the
    exceptions :func:`forward` raises. ``check_cu_seqlens`` (keyword only, an addition) is
    :func:`forward`'s: False skips the host check of CUDA ``cu_seqlens`` and with it the one
    synchronisation of a call. Inference only, like :func:`forward`.

    State pools (keyword only, additions; they map onto the C++ arguments): with
    ``state_indices`` ``[N]``, ``initial_state`` and ``final_state`` are pools ``[P, H, V, K]``
    (each optional, possibly of different sizes, or the same tensor: updated in place). Sequence
    ``n`` starts from ``initial_state[state_indices[n]]`` (zeros without ``initial_state``) and
    writes its final state to ``final_state[final_state_indices[n]]`` (``state_indices[n]``
    without ``final_state_indices``). Negative indices: padding (the sequence is skipped, its
    ``out`` rows are not written), or, in ``final_state_indices``, no final state written.
    ``state_layout="kv"`` takes K-major states ``[.., K, V]``. See :func:`forward`.

    Prefix checkpoints and a workspace (keyword only; the interface of the ``flash_kda.fwd`` of
    the FlashKDA fork that vLLM maintains, so engine code can switch):
    ``checkpoint_offsets`` int64 or int32 ``[N, C]`` and ``checkpoint_state`` float32
    ``[N, C, H, V, K]`` (``[N, C, H, K, V]`` with ``state_layout="kv"``), both or neither:
    ``checkpoint_state[n, c]`` is written in place with the state of sequence ``n`` after its
    first ``checkpoint_offsets[n, c]`` tokens (multiples of 16, at most the sequence's length,
    non-decreasing along ``c``; negative: unused, left as it was).
    ``workspace``: a reusable device buffer (a torch uint8 tensor, or any contiguous writable
    array; its bytes count) used as the CUDA workspace instead of allocating one per call; one
    too small, on another device or not contiguous is refused (``ValueError`` naming
    ``workspace``). CPU calls need no workspace and ignore it.
    """
    _check_tensors((q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens, state_indices,
                    final_state_indices, checkpoint_offsets, checkpoint_state))
    _check_workspace(workspace)
    layout = _state_layout_id(state_layout)
    scale = _default_scale(q) if scale is None else _number("scale", scale)
    lower_bound = _number("lower_bound", lower_bound)
    _refuse_jax_writes("state_indices", state_indices, (q, initial_state, final_state, out), _JAX_POOLS)
    _refuse_jax_writes("checkpoint_state", checkpoint_state, (q, initial_state, final_state, out), _JAX_CHECKPOINTS)
    if _is_torch(q):
        _torch_ops.forward_out(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state,
            lower_bound, scale, 0, bool(check_cu_seqlens), state_indices, final_state_indices, layout,
            checkpoint_offsets=checkpoint_offsets, checkpoint_state=checkpoint_state, workspace=workspace,
        )
        return None
    _frameworks.run(
        q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens,
        lower_bound, scale, 0, bool(check_cu_seqlens), None, state_indices, final_state_indices, layout,
        checkpoint_offsets, checkpoint_state, workspace,
    )
    return None


def _run_into(q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens, *, lower_bound: float,
              scale: float, gate_id: int, layout: int, state_indices=None, final_state_indices=None,
              token_state_indices=None) -> None:
    """The call under flashkda.decode and flashkda.fused_recurrent_kda: writes ``out`` and
    ``final_state`` (a pool, possibly ``initial_state`` itself: updated in place) as ``fwd`` does,
    with any gate and with per-token states (``token_state_indices``). Scalars are already
    resolved (``scale`` a number, ``gate_id`` and ``layout`` the extension's codes)."""
    _check_tensors((q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens, state_indices,
                    final_state_indices, None, None, token_state_indices))
    if _is_torch(q):
        _torch_ops.forward_out(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state,
            lower_bound, scale, gate_id, True, state_indices, final_state_indices, layout,
            token_state_indices=token_state_indices,
        )
        return
    _frameworks.run(
        q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens,
        lower_bound, scale, gate_id, True, None, state_indices, final_state_indices, layout,
        token_state_indices=token_state_indices,
    )


def info() -> dict:
    """What this build has: version, whether the CUDA kernels are compiled in (``cuda_kernels``),
    usable devices, and the backends a call can run on now (``backends``: "cuda" only with the
    kernels compiled in and at least one usable device)."""
    compiled = bool(_ext.cuda_compiled())
    devices = int(_ext.cuda_device_count()) if compiled else 0
    return {
        "version": _ext.version(),
        "cuda_kernels": compiled,
        # "cuda" only where it can run: kernels compiled in and at least one usable device.
        "backends": ["cpu", "cuda"] if devices > 0 else ["cpu"],
        "cuda_devices": devices,
        "cuda_device_name": _ext.cuda_device_name() if devices else "",
        "torch_ops": _torch_ops is not None,
        "note": (
            "CUDA kernels built in (sm_90a)" if compiled
            else "built without CUDA kernels (no nvcc at build time): CPU backend only"
        ),
    }
