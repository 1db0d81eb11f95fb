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
    shape = q.shape
    if len(shape) != 4:
        raise ValueError(
            f"q: expected 4 dimensions [B, T, H, K], got {len(shape)} dimensions with shape {list(shape)}"
        )
    return float(shape[3]) ** -0.5


def _is_torch(x) -> bool:
    return _torch is not None and isinstance(x, _torch.Tensor)


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
        TypeError for a wrong dtype or a non-array argument, ValueError for a wrong shape, layout,
        device or value, NotImplementedError for what this backend does not support yet (head
        sizes other than 128, the softplus gate on CUDA), RuntimeError for CUDA failures. The
        messages name the argument, the expectation and what was given.
    """
    gate_id = _gate_id(gate)
    if scale is None:
        scale = _default_scale(q)
    if _is_torch(q):
        if stream is not None:
            raise ValueError(
                "stream: torch tensors run on torch.cuda.current_stream(); "
                "select a stream with `with torch.cuda.stream(s):` instead of stream="
            )
        return _torch_ops.forward(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out,
            float(lower_bound), float(scale), gate_id, bool(output_final_state), bool(check_cu_seqlens),
        )
    return _frameworks.forward(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out,
        float(lower_bound), float(scale), gate_id, bool(output_final_state), bool(check_cu_seqlens), stream,
    )


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None, final_state=None,
        cu_seqlens=None, *, check_cu_seqlens=True):
    """The call of the existing ``flash_kda.fwd``: writes ``out`` (and ``final_state``) in place.

    Same arguments and layouts as :func:`forward` (state ``[N, H, V, K]``), given positionally in
    ``flash_kda.fwd``'s order; ``final_state``, when given, is written with the state after each
    sequence. Returns None. Unlike the original it also takes CPU tensors (the CPU backend), and
    refuses bad arguments with the exceptions :func:`forward` raises. ``check_cu_seqlens``
    (keyword only, an addition) is :func:`forward`'s: False skips the host check of CUDA
    ``cu_seqlens`` and with it the one synchronisation of a call.
    """
    if _is_torch(q):
        _torch_ops.forward_out(
            q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state,
            float(lower_bound), float(scale), 0, bool(check_cu_seqlens),
        )
        return None
    _frameworks.run(
        q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens,
        float(lower_bound), float(scale), 0, bool(check_cu_seqlens), None,
    )
    return None


def info() -> dict:
    """What this build has: version, whether the CUDA kernels are compiled in, visible devices."""
    compiled = bool(_ext.cuda_compiled())
    devices = int(_ext.cuda_device_count()) if compiled else 0
    return {
        "version": _ext.version(),
        "cuda_kernels": compiled,
        "backends": ["cpu", "cuda"] if compiled else ["cpu"],
        "cuda_devices": devices,
        "cuda_device_name": _ext.cuda_device_name() if devices else "",
        "torch_ops": _torch_ops is not None,
        "note": (
            "CUDA kernels built in (sm_90a)" if compiled
            else "built without CUDA kernels (no nvcc at build time): CPU backend only"
        ),
    }
