"""The Python API: forward(), fwd() and info(), over the native extension flashkda._ext.

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


def _gate_id(gate) -> int:
    if isinstance(gate, str) and gate in _GATES:
        return _GATES[gate]
    raise ValueError(f"gate: expected 'safe' or 'softplus', got {gate!r}")


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
    stream=None,
):
    """Kimi Delta Attention forward; returns ``(out, final_state)``.

    Args:
        q, k: bfloat16 ``[B, T, H, K]`` queries and keys (L2-normalised inside).
        v: bfloat16 ``[B, T, H, V]`` values.
        g: bfloat16 ``[B, T, H, K]`` gate before activation.
        beta: bfloat16 ``[B, T, H]`` write strength as a logit (sigmoid inside).
        A_log: float32 ``[H]``; dt_bias: float32 ``[H, K]``.
        lower_bound: bound of the "safe" gate, in ``[-5, 0)``.
        gate: ``"safe"`` or ``"softplus"`` (the softplus gate runs on the CPU backend only, so far).
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
        stream: for CUDA arrays of frameworks other than torch: the stream to run on (an int
            ``cudaStream_t`` or an object with ``.ptr`` / ``.cuda_stream``). Torch tensors always
            run on ``torch.cuda.current_stream()``; use ``with torch.cuda.stream(s):``.

    Returns:
        ``(out, final_state)``, arrays of the caller's framework; ``final_state`` is ``None``
        unless ``output_final_state``.

    Raises:
        TypeError for a wrong dtype, a non-array argument, a missing (None) required tensor or a
        non-number scalar; ValueError for a wrong shape, layout, device (meta tensors have no
        data) or value; NotImplementedError for what this backend does not support yet (head
        sizes other than 128, the softplus gate on CUDA); RuntimeError for CUDA failures, and for
        torch tensors that require grad while grad mode is on: flashkda is inference only (no
        backward yet), so call it under ``torch.no_grad()`` or ``torch.inference_mode()``, or
        pass detached tensors. The messages name the argument, the expectation and what was given.
    """
    _check_tensors((q, k, v, g, beta, A_log, dt_bias, out, initial_state, None, cu_seqlens), allocated=("out",))
    gate_id = _gate_id(gate)
    scale = _default_scale(q) if scale is None else _number("scale", scale)
    lower_bound = _number("lower_bound", lower_bound)
    if _is_torch(q):
        if stream is not None:
            raise ValueError(
                "stream: torch tensors run on torch.cuda.current_stream(); "
                "select a stream with `with torch.cuda.stream(s):` instead of stream="
            )
        return _torch_ops.forward(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out,
            lower_bound, scale, gate_id, bool(output_final_state), bool(check_cu_seqlens),
        )
    return _frameworks.forward(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out,
        lower_bound, scale, gate_id, bool(output_final_state), bool(check_cu_seqlens), stream,
    )


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None, *, check_cu_seqlens=True):
    """The call of the existing ``flash_kda.fwd``: writes ``out`` (and ``final_state``) in place.

    Same arguments and layouts as :func:`forward` (state ``[N, H, V, K]``), given positionally in
    ``flash_kda.fwd``'s order; ``final_state``, when given, is written with the state after each
    sequence. ``scale=None`` means ``K ** -0.5``, as in :func:`forward`. Returns None. Unlike the
    original it also takes CPU tensors (the CPU backend), and refuses bad arguments with the
    exceptions :func:`forward` raises. ``check_cu_seqlens`` (keyword only, an addition) is
    :func:`forward`'s: False skips the host check of CUDA ``cu_seqlens`` and with it the one
    synchronisation of a call. Inference only, like :func:`forward`.
    """
    _check_tensors((q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens))
    scale = _default_scale(q) if scale is None else _number("scale", scale)
    lower_bound = _number("lower_bound", lower_bound)
    if _is_torch(q):
        _torch_ops.forward_out(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state,
            lower_bound, scale, 0, bool(check_cu_seqlens),
        )
        return None
    _frameworks.run(
        q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens,
        lower_bound, scale, 0, bool(check_cu_seqlens), None,
    )
    return None


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
