"""torch.library custom ops, so torch.compile(fullgraph=True) traces through flashkda.

    flashkda::forward      functional: returns (out, final_state); final_state has 0 elements
                           unless output_final_state; with state_indices it is a new pool: a
                           copy of initial_state with the sequences' slots written
    flashkda::forward_out  writes out (and final_state, when given) in place; returns nothing.
                           With state_in_place, final_state is the initial state too (a pool
                           read and updated in place; initial_state is then None): the pool is
                           one mutated argument, not an input aliasing a mutated one

Both take the state pool arguments (state_indices, final_state_indices: optional [N] int64 or
int32) and state_layout (0: V-major [.., V, K], 1: K-major [.., K, V]) after the others, with
defaults, so calls without them are unchanged. forward_out's written tensors come first and have
no defaults (out, final_state, then checkpoint_state: [N, C, H, V, K] float32 or None, and
workspace: a caller's reusable CUDA workspace, any dtype, its bytes count, ignored on the CPU, or
None), because torch 2.11's in-place bookkeeping indexes the positional arguments by the schema
and the dispatcher drops trailing arguments equal to their defaults (an IndexError under
torch.compile when a mutated argument was among them). It takes, last, with defaults None:
checkpoint_offsets ([N, C] int64 or int32) and token_state_indices ([N, T_max] int64 or int32:
per-token states into slots of the final_state pool, as flashkda.decode and the speculative verify
of flashkda.fused_recurrent_kda write them). Prefix checkpoints go through forward_out only: the
functional op's outputs stay (out, final_state), and flashkda.forward(checkpoint_offsets=...)
allocates the checkpoint states itself (zeros) and calls forward_out, as it does for pools.

Both have fake (meta) implementations, which take fake and meta tensors. The real ones pass the
tensors to the extension through DLPack (no copies; a meta tensor has no data, and the extension
refuses it with a ValueError), allocate the CUDA workspace with torch.empty (the caching
allocator, and a CUDA graph's private pool while capturing) and run on
torch.cuda.current_stream(). Tensors that require grad never get here with grad mode on: the API
(_api) refuses them first, as flashkda has no backward yet.
Imported only when torch is importable.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _ext
from ._frameworks import check_rank


def _detach(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach()


def _given_workspace(workspace: Tensor, device: torch.device):
    """The extension's workspace_alloc for the caller's buffer (fwd's workspace=): checks its device
    and contiguity now, its size when the extension asks for n bytes, and returns the first n
    bytes of it (a uint8 view). ValueError naming workspace otherwise."""
    if workspace.device != device:
        raise ValueError(f"workspace: is on {workspace.device} but q is on {device}; pass a buffer on q's device")
    if not workspace.is_contiguous():
        raise ValueError("workspace: expected a contiguous tensor (its bytes are used as one block)")
    flat = workspace.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8) if flat.numel() else flat.new_empty((0,), dtype=torch.uint8)
    nbytes = flat.numel()

    def alloc(n):
        if nbytes < n:
            raise ValueError(
                f"workspace: expected at least {n} bytes for this call, got a buffer of {nbytes} bytes "
                f"({workspace.dtype} {list(workspace.shape)}); pass a larger one, or workspace=None to allocate "
                f"one per call"
            )
        return flat[:n]

    return alloc


def _launch(q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens,
            lower_bound, scale, gate, check_cu_seqlens, state_indices=None, final_state_indices=None,
            state_layout=0, checkpoint_offsets=None, checkpoint_state=None, workspace=None,
            token_state_indices=None) -> None:
    tensors = [_detach(t) for t in (q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens)]
    extra = dict(state_indices=_detach(state_indices), final_state_indices=_detach(final_state_indices),
                 state_layout=state_layout, checkpoint_offsets=_detach(checkpoint_offsets),
                 checkpoint_state=_detach(checkpoint_state), token_state_indices=_detach(token_state_indices))
    device = q.device
    if device.type != "cuda":  # the CPU backend needs no workspace: a given one is ignored
        _ext.forward(*tensors, lower_bound, scale, gate, check_cu_seqlens, 0, None, 0, **extra)
        return
    if workspace is not None:
        workspace_alloc = _given_workspace(workspace, device)
    else:
        def workspace_alloc(n):
            return torch.empty(n, dtype=torch.uint8, device=device)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        _ext.forward(*tensors, lower_bound, scale, gate, check_cu_seqlens, stream, workspace_alloc, 0, **extra)


def _state_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], state_layout: int = 0):
    # Shape arithmetic without int(): stays symbolic under torch.compile(dynamic=True). A
    # cu_seqlens without N + 1 >= 2 entries gets an empty state here, and the C++ validation's
    # error ("cu_seqlens: expected at least 2 entries ...") at the call.
    if cu_seqlens is None or cu_seqlens.dim() != 1:
        N = q.shape[0]
    else:
        n = cu_seqlens.shape[0] - 1
        # A plain int under static shapes (torch 2.11's dynamo cannot trace torch.sym_max on ints).
        N = max(n, 0) if isinstance(n, int) else torch.sym_max(n, 0)
    if state_layout == 1:  # K-major [N, H, K, V]
        return (N, q.shape[2], q.shape[3], v.shape[3])
    return (N, q.shape[2], v.shape[3], q.shape[3])


def _checkpoint_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], checkpoint_offsets, state_layout: int = 0):
    """[N, C, H, V, K] (or K-major) for offsets [N, C]; offsets of another rank get a placeholder
    (0,), and the C++ validation's error about the offsets themselves at the call."""
    if len(checkpoint_offsets.shape) != 2:
        return (0,)
    state = _state_shape(q, v, cu_seqlens, state_layout)
    return (state[0], checkpoint_offsets.shape[1]) + tuple(state[1:])


def _state_dtype(initial_state: Optional[Tensor]) -> torch.dtype:
    return torch.float32 if initial_state is None else initial_state.dtype


def _empty_outputs(q, v, initial_state, cu_seqlens, output_final_state, state_indices=None, state_layout=0):
    check_rank(q, v)
    out_shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    if state_indices is not None:
        # A new pool: initial_state's slots, the sequences' written over them (padding sequences'
        # out rows are not written: zeros).
        if initial_state is None:
            raise ValueError("state_indices: given without initial_state; the functional op returns a new pool, "
                             "a copy of initial_state [P, H, V, K] with the sequences' slots written, and needs it")
        return q.new_zeros(out_shape, dtype=torch.bfloat16), initial_state.clone()
    out = q.new_empty(out_shape, dtype=torch.bfloat16)
    if output_final_state:
        final_state = q.new_empty(_state_shape(q, v, cu_seqlens, state_layout), dtype=_state_dtype(initial_state))
    else:
        final_state = q.new_empty((0,), dtype=_state_dtype(initial_state))
    return out, final_state


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor,
                initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], lower_bound: float, scale: float,
                gate: int, output_final_state: bool, check_cu_seqlens: bool,
                state_indices: Optional[Tensor] = None, final_state_indices: Optional[Tensor] = None,
                state_layout: int = 0) -> Tuple[Tensor, Tensor]:
    out, final_state = _empty_outputs(q, v, initial_state, cu_seqlens, output_final_state, state_indices,
                                      state_layout)
    if state_indices is not None:  # the copy is read and written in place, as a pool is
        _launch(q, k, v, g, beta, A_log, dt_bias, out, final_state, final_state, cu_seqlens, lower_bound, scale,
                gate, check_cu_seqlens, state_indices, final_state_indices, state_layout)
        return out, final_state
    _launch(q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state if output_final_state else None,
            cu_seqlens, lower_bound, scale, gate, check_cu_seqlens, None, final_state_indices, state_layout)
    return out, final_state


_forward_op = torch.library.custom_op("flashkda::forward", mutates_args=())(_forward_impl)


@_forward_op.register_fake
def _forward_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, lower_bound, scale, gate,
                  output_final_state, check_cu_seqlens, state_indices=None, final_state_indices=None, state_layout=0):
    return _empty_outputs(q, v, initial_state, cu_seqlens, output_final_state, state_indices, state_layout)


def _forward_out_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor,
                    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], out: Tensor,
                    final_state: Optional[Tensor], checkpoint_state: Optional[Tensor],
                    workspace: Optional[Tensor], lower_bound: float, scale: float, gate: int,
                    check_cu_seqlens: bool, state_indices: Optional[Tensor] = None,
                    final_state_indices: Optional[Tensor] = None, state_layout: int = 0,
                    state_in_place: bool = False, checkpoint_offsets: Optional[Tensor] = None,
                    token_state_indices: Optional[Tensor] = None) -> None:
    if state_in_place:
        if initial_state is not None or final_state is None:
            raise ValueError("state_in_place: final_state is the initial state too; pass it as final_state, "
                             "and initial_state=None")
        initial_state = final_state
    _launch(q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens,
            lower_bound, scale, gate, check_cu_seqlens, state_indices, final_state_indices, state_layout,
            checkpoint_offsets, checkpoint_state, workspace, token_state_indices)


_forward_out_op = torch.library.custom_op(
    "flashkda::forward_out", mutates_args=("out", "final_state", "checkpoint_state", "workspace"))(_forward_out_impl)


@_forward_out_op.register_fake
def _forward_out_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state,
                      checkpoint_state, workspace, lower_bound, scale, gate, check_cu_seqlens, state_indices=None,
                      final_state_indices=None, state_layout=0, state_in_place=False, checkpoint_offsets=None,
                      token_state_indices=None):
    return None


def _plain_eager(q) -> bool:
    """True outside torch.compile tracing, dispatch modes (FakeTensorMode, ...) and tensor
    subclasses: then the ops' implementations are called directly, skipping the custom-op
    machinery's ~90 us of host time per call (measured on an H200 host). Either way the same
    code runs."""
    return (type(q) is Tensor and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0)


def _as_tensor(x, name: str):
    """Other frameworks' arrays beside torch tensors (q is one): zero-copy views through DLPack
    (NumPy bfloat16 through its bits), so that the custom ops see tensors only. `name` (one of
    _ext.ARG_NAMES) is for the error when torch cannot take the array."""
    if x is None or isinstance(x, Tensor):
        return x
    if getattr(getattr(x, "dtype", None), "name", "") == "bfloat16" and type(x).__module__ == "numpy":
        import numpy as np

        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    try:
        return torch.from_dlpack(x)
    except Exception as e:  # noqa: BLE001 - the exporters raise all kinds
        if not hasattr(x, "__dlpack__"):  # the buffer protocol or the array interface only
            try:
                import numpy as np

                return torch.from_numpy(np.asarray(x))
            except Exception:  # noqa: BLE001
                pass
        if name in _ext.ARG_NAMES:  # workspace is not one of the C++ arguments
            _ext.check_array(_ext.ARG_NAMES.index(name), x)  # raises the extension's error, naming the argument
        raise TypeError(f"{name}: torch cannot import this {type(x).__name__} beside torch tensors ({e}); "
                        f"pass a torch tensor") from None


_FORWARD_NAMES = ("k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens", "out",
                  "state_indices", "final_state_indices")
_FORWARD_OUT_NAMES = _FORWARD_NAMES + ("final_state", "checkpoint_offsets", "checkpoint_state", "workspace",
                                       "token_state_indices")


def forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out,
            lower_bound, scale, gate, output_final_state, check_cu_seqlens,
            state_indices=None, final_state_indices=None, state_layout=0, checkpoint_offsets=None,
            checkpoint_state=None):
    """flashkda.forward for torch tensors. With state_indices, initial_state is a pool: updated in
    place through flashkda::forward_out (which declares it mutated) and returned. With
    checkpoint_offsets, returns (out, final_state, checkpoint_state): the checkpoint states (given,
    or allocated here, zero-filled) are written through flashkda::forward_out too."""
    checkpoints = checkpoint_offsets is not None
    if checkpoints and checkpoint_state is None:
        cu_seqlens = _as_tensor(cu_seqlens, "cu_seqlens")  # its shape gives N (it may be another framework's)
        checkpoint_state = q.new_zeros(_checkpoint_shape(q, v, cu_seqlens, checkpoint_offsets, state_layout),
                                       dtype=torch.float32)  # unused entries (negative offsets) stay zeros
    ckpt = dict(checkpoint_offsets=checkpoint_offsets, checkpoint_state=checkpoint_state)

    def result(out, final_state):
        return (out, final_state, checkpoint_state) if checkpoints else (out, final_state)

    if state_indices is not None:
        if out is None:
            check_rank(q, v)  # padding sequences' rows are not written: zeros
            out = q.new_zeros((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), dtype=torch.bfloat16)
        forward_out(q, k, v, g, beta, A_log, dt_bias, None, cu_seqlens, out, initial_state, lower_bound, scale,
                    gate, check_cu_seqlens, state_indices, final_state_indices, state_layout, state_in_place=True,
                    **ckpt)
        return result(out, initial_state)  # the pool itself (of its own framework, updated through a view)
    k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, _, final_state_indices = (
        _as_tensor(x, name) for x, name in zip((k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out,
                                                None, final_state_indices), _FORWARD_NAMES))
    if out is None and checkpoint_state is None:
        op = _forward_impl if _plain_eager(q) else torch.ops.flashkda.forward
        out, final_state = op(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                              lower_bound, scale, gate, output_final_state, check_cu_seqlens,
                              None, final_state_indices, state_layout)
        return out, (final_state if output_final_state else None)
    if out is None:
        check_rank(q, v)
        out = q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), dtype=torch.bfloat16)
    final_state = None
    if output_final_state:
        final_state = q.new_empty(_state_shape(q, v, cu_seqlens, state_layout), dtype=_state_dtype(initial_state))
    forward_out(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state,
                lower_bound, scale, gate, check_cu_seqlens, None, final_state_indices, state_layout, **ckpt)
    return result(out, final_state)


def forward_out(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state,
                lower_bound, scale, gate, check_cu_seqlens, state_indices=None, final_state_indices=None,
                state_layout=0, state_in_place=False, checkpoint_offsets=None, checkpoint_state=None,
                workspace=None, token_state_indices=None) -> None:
    """flashkda.fwd (and forward(out=...), decode, fused_recurrent_kda) for torch tensors. One
    tensor given as both initial_state and final_state (a pool updated in place, or states overwritten) goes to the op
    once, as final_state with state_in_place: under torch.compile the op then mutates that one
    tensor, instead of reading an input that aliases one it mutates."""
    if not state_in_place and initial_state is not None and initial_state is final_state:
        initial_state, state_in_place = None, True
    k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, state_indices, final_state_indices, \
        final_state, checkpoint_offsets, checkpoint_state, workspace, token_state_indices = (
            _as_tensor(x, name) for x, name in zip(
                (k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, state_indices, final_state_indices,
                 final_state, checkpoint_offsets, checkpoint_state, workspace, token_state_indices),
                _FORWARD_OUT_NAMES))
    op = _forward_out_impl if _plain_eager(q) else torch.ops.flashkda.forward_out
    op(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state, checkpoint_state, workspace,
       lower_bound, scale, gate, check_cu_seqlens, state_indices, final_state_indices, state_layout, state_in_place,
       checkpoint_offsets, token_state_indices)
