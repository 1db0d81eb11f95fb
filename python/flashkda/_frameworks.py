"""Arrays of frameworks other than torch: NumPy, CuPy, JAX, or anything with DLPack.

Outputs are allocated in the framework of ``q``; the device workspace too (CuPy and JAX on
CUDA). NumPy has no native bfloat16: arrays of ``ml_dtypes.bfloat16`` are passed as uint16 views
of the same memory (NumPy exports that dtype neither through DLPack nor through the buffer
protocol). Float32 NumPy inputs where bfloat16 is expected are refused with a TypeError, never
converted: the caller converts once (``x.astype(ml_dtypes.bfloat16)``) and keeps the bf16 copy.
"""

from __future__ import annotations

import contextlib
import warnings

from . import _ext

_ARG_INDEX = {name: i for i, name in enumerate(_ext.ARG_NAMES)}


def framework_of(x) -> str:
    """'numpy', 'cupy', 'jax', 'torch' or 'other', from the array's type."""
    root = type(x).__module__.split(".")[0]
    if root in ("numpy", "cupy", "torch"):
        return root
    if root in ("jax", "jaxlib"):
        return "jax"
    return "other"


def _is_numpy_bf16(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return framework_of(x) == "numpy" and getattr(dtype, "name", "") == "bfloat16"


def _prepare(arrays: dict):
    """Returns (arguments for _ext, bf16_views bit mask)."""
    views = 0
    prepared = {}
    for name, x in arrays.items():
        if x is not None and _is_numpy_bf16(x):
            import numpy as np

            x = x.view(np.uint16)
            views |= 1 << _ARG_INDEX[name]
        elif getattr(x, "requires_grad", False) and framework_of(x) == "torch":
            x = x.detach()  # torch exports no tensor that requires grad (grad mode is off: see _api)
        prepared[name] = x
    return prepared, views


def _stream_handle(fw: str, stream) -> int:
    """The cudaStream_t to run on: `stream` when given, else CuPy's current stream, else 0."""
    if stream is None:
        if fw != "cupy":
            return 0
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)
    if isinstance(stream, int):
        return stream
    for attr in ("ptr", "cuda_stream"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(
        f"stream: expected an int cudaStream_t or an object with .ptr or .cuda_stream, got {type(stream).__name__}"
    )


def _is_cuda(fw: str, x) -> bool:
    if fw == "cupy":
        return True
    if fw == "jax":
        return any(d.platform == "gpu" for d in x.devices())
    if fw == "numpy":
        return False
    device = getattr(x, "__dlpack_device__", None)
    return device is not None and device()[0] in (2, 13)  # kDLCUDA, kDLCUDAManaged


def _cupy_stream(cupy, handle: int):
    """A context making `handle` CuPy's current stream (its memory pool is stream-ordered)."""
    if handle == cupy.cuda.get_current_stream().ptr:
        return contextlib.nullcontext()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # newer CuPy prefers Stream.from_external
        return cupy.cuda.ExternalStream(handle)


class _Allocator:
    """Allocates arrays of q's framework on q's device."""

    def __init__(self, q, stream: int):
        self.fw = framework_of(q)
        self.q = q
        self.stream = stream

    def _dtype(self, dtype):
        if not isinstance(dtype, str):
            return dtype  # a dtype of the framework itself (e.g. initial_state.dtype)
        if dtype == "bfloat16" and self.fw in ("numpy", "cupy"):
            try:
                import ml_dtypes
            except ImportError:
                raise TypeError(
                    "flashkda: NumPy/CuPy outputs in bfloat16 need the ml_dtypes package (pip install ml_dtypes), "
                    "or pass out= yourself"
                ) from None
            return ml_dtypes.bfloat16
        if self.fw == "jax":
            import jax.numpy as jnp

            return getattr(jnp, dtype)
        import numpy as np

        return np.dtype(dtype)

    def empty(self, shape, dtype, zeros=False):
        """An uninitialised array (zero-filled with `zeros`; JAX's always are)."""
        dtype = self._dtype(dtype)
        if self.fw == "numpy":
            import numpy as np

            return (np.zeros if zeros else np.empty)(shape, dtype=dtype)
        if self.fw == "cupy":
            import cupy

            with cupy.cuda.Device(self.q.device.id), _cupy_stream(cupy, self.stream):
                try:
                    return (cupy.zeros if zeros else cupy.empty)(shape, dtype=dtype)
                except (TypeError, ValueError) as e:
                    raise TypeError(
                        f"flashkda: CuPy cannot allocate an array of dtype {dtype} ({e}); pass out= yourself"
                    ) from None
        if self.fw == "jax":
            import jax.numpy as jnp

            device = next(iter(self.q.devices()))
            return jnp.zeros(shape, dtype=dtype, device=device)
        raise TypeError(
            f"q: flashkda allocates outputs for torch, NumPy, CuPy and JAX arrays, got {type(self.q).__name__}; "
            "pass out= (and final_state through flashkda.fwd) to use other arrays"
        )


def _dlpack_device(x):
    """(DLPack device type, id) of an array, or None when it does not say."""
    try:
        return tuple(int(d) for d in x.__dlpack_device__())
    except Exception:  # noqa: BLE001 - no __dlpack_device__, or the exporter refuses
        return None


def _device_str(device) -> str:
    if device is None:
        return "an unknown device"
    kind, index = device
    return f"cuda:{index}" if kind in (2, 13) else ("cpu" if kind in (1, 3) else f"DLPack device {kind}:{index}")


def given_workspace(workspace, q):
    """The workspace_alloc of _ext.forward for a buffer given by the caller (fwd's workspace=), on
    the CUDA path: checks that it is on q's device and contiguous, and, when the extension asks for
    n bytes, that it holds at least n; returns the buffer itself (its bytes count, whatever its
    dtype). ValueError naming workspace otherwise."""
    want, got = _dlpack_device(q), _dlpack_device(workspace)
    if got is None or want is None or got[1] != want[1] or (got[0] in (2, 13)) != (want[0] in (2, 13)):
        raise ValueError(
            f"workspace: is on {_device_str(got)} but q is on {_device_str(want)}; pass a buffer on q's device"
        )
    flags = getattr(workspace, "flags", None)
    contiguous = getattr(flags, "c_contiguous", None) if flags is not None else None
    if contiguous is None:
        contiguous = len(shape_of("workspace", workspace)) <= 1
    if not contiguous:
        raise ValueError("workspace: expected a contiguous buffer (its bytes are used as one block)")
    nbytes = int(getattr(workspace, "nbytes"))

    def alloc(n):
        if nbytes < n:
            raise ValueError(
                f"workspace: expected at least {n} bytes for this call, got a buffer of {nbytes} bytes; pass a "
                f"larger one, or workspace=None to allocate one per call"
            )
        return workspace

    return alloc


def run(q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens,
        lower_bound, scale, gate, check_cu_seqlens, stream, state_indices=None, final_state_indices=None,
        state_layout=0, checkpoint_offsets=None, checkpoint_state=None, workspace=None, token_state_indices=None):
    """Runs the extension on arrays of any framework, writing into out and final_state (which may
    be initial_state itself: a pool updated in place, with state_indices; with token_state_indices
    the per-token states go to its slots too) and checkpoint_state.
    A given workspace is used on the CUDA path (checked there) and ignored on the CPU."""
    fw = framework_of(q)
    cuda = _is_cuda(fw, q)
    handle = _stream_handle(fw, stream)
    if fw == "jax" and cuda:
        # JAX has no stream to share: wait for the inputs, and (below) for the kernels.
        for x in (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, state_indices, final_state_indices,
                  checkpoint_offsets, token_state_indices):
            if hasattr(x, "block_until_ready"):
                x.block_until_ready()
    args, views = _prepare(dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, out=out,
                                initial_state=initial_state, final_state=final_state, cu_seqlens=cu_seqlens,
                                state_indices=state_indices, final_state_indices=final_state_indices,
                                checkpoint_offsets=checkpoint_offsets, checkpoint_state=checkpoint_state,
                                token_state_indices=token_state_indices))
    workspace_alloc = None
    if cuda:
        if workspace is not None:
            workspace_alloc = given_workspace(workspace, q)
        else:
            alloc = _Allocator(q, handle)
            workspace_alloc = lambda n: alloc.empty((n,), "uint8")  # noqa: E731
    _ext.forward(
        args["q"], args["k"], args["v"], args["g"], args["beta"], args["A_log"], args["dt_bias"], args["out"],
        args["initial_state"], args["final_state"], args["cu_seqlens"],
        lower_bound, scale, gate, check_cu_seqlens, handle, workspace_alloc, views,
        state_indices=args["state_indices"], final_state_indices=args["final_state_indices"],
        state_layout=state_layout, checkpoint_offsets=args["checkpoint_offsets"],
        checkpoint_state=args["checkpoint_state"], token_state_indices=args["token_state_indices"],
    )
    if fw == "jax" and cuda:
        _ext.stream_synchronize(handle)


def shape_of(name: str, x):
    """x.shape; TypeError naming the argument for an array-like object without one (bytes)."""
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{name}: expected a tensor or array with a shape, got {type(x).__name__}")
    return shape


def check_rank(q, v) -> None:
    """q and v must be 4-D before output shapes can be read off them (C++ validation's wording)."""
    for name, x, layout in (("q", q, "[B, T, H, K]"), ("v", v, "[B, T, H, V]")):
        shape = shape_of(name, x)
        if len(shape) != 4:
            raise ValueError(
                f"{name}: expected 4 dimensions {layout}, got {len(shape)} dimensions with shape {list(shape)}"
            )


def _output_shapes(q, v, cu_seqlens, state_layout=0):
    check_rank(q, v)
    B, T, H, K = (int(d) for d in q.shape)
    V = int(v.shape[3])
    N = B
    if cu_seqlens is not None and len(cu_seqlens.shape) >= 1:
        N = max(int(cu_seqlens.shape[0]) - 1, 0)
    return (B, T, H, V), ((N, H, K, V) if state_layout == 1 else (N, H, V, K))


def checkpoint_shape(state_shape, checkpoint_offsets):
    """The checkpoint states' shape [N, C, H, V, K] (or K-major) for a final state's [N, H, ., .]
    and offsets [N, C]. Offsets of another rank get a placeholder (0,): the C++ validation then
    refuses the offsets themselves, naming them (it checks them before the states)."""
    offsets_shape = shape_of("checkpoint_offsets", checkpoint_offsets)
    if len(offsets_shape) != 2:
        return (0,)
    return (state_shape[0], offsets_shape[1]) + tuple(state_shape[1:])


def forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out,
            lower_bound, scale, gate, output_final_state, check_cu_seqlens, stream,
            state_indices=None, final_state_indices=None, state_layout=0, checkpoint_offsets=None,
            checkpoint_state=None):
    """flashkda.forward for arrays that are not torch tensors. With state_indices, initial_state
    is a pool, updated in place and returned as the final state (the API checked it is given).
    With checkpoint_offsets, returns (out, final_state, checkpoint_state), allocating the last
    (zero-filled float32) when not given."""
    out_shape, state_shape = _output_shapes(q, v, cu_seqlens, state_layout)
    alloc = _Allocator(q, _stream_handle(framework_of(q), stream))
    pools = state_indices is not None
    if out is None:
        out = alloc.empty(out_shape, "bfloat16", zeros=pools)  # padding sequences' rows are not written
    final_state = None
    if pools:
        final_state = initial_state
    elif output_final_state:
        final_state = alloc.empty(state_shape, initial_state.dtype if initial_state is not None else "float32")
    checkpoints = checkpoint_offsets is not None
    if checkpoints and checkpoint_state is None:  # unused entries (negative offsets) stay zeros
        checkpoint_state = alloc.empty(checkpoint_shape(state_shape, checkpoint_offsets), "float32", zeros=True)
    run(q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens,
        lower_bound, scale, gate, check_cu_seqlens, stream, state_indices, final_state_indices, state_layout,
        checkpoint_offsets, checkpoint_state)
    return (out, final_state, checkpoint_state) if checkpoints else (out, final_state)
