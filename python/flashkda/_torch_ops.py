"""torch.library custom ops, so torch.compile(fullgraph=True) traces through flashkda.

    flashkda::forward      functional: returns (out, final_state); final_state has 0 elements
                           unless output_final_state
    flashkda::forward_out  writes out (and final_state, when given) in place; returns nothing

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


def _launch(q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens,
            lower_bound, scale, gate, check_cu_seqlens) -> None:
    tensors = [_detach(t) for t in (q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens)]
    device = q.device
    if device.type != "cuda":
        _ext.forward(*tensors, lower_bound, scale, gate, check_cu_seqlens, 0, None, 0)
        return
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        _ext.forward(*tensors, lower_bound, scale, gate, check_cu_seqlens, stream,
                     lambda n: torch.empty(n, dtype=torch.uint8, device=device), 0)


def _state_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]):
    # Shape arithmetic without int(): stays symbolic under torch.compile(dynamic=True). A
    # cu_seqlens without N + 1 >= 2 entries gets an empty state here, and the C++ validation's
    # error ("cu_seqlens: expected at least 2 entries ...") at the call.
    if cu_seqlens is None or cu_seqlens.dim() != 1:
        N = q.shape[0]
    else:
        N = torch.sym_max(cu_seqlens.shape[0] - 1, 0)
    return (N, q.shape[2], v.shape[3], q.shape[3])


def _state_dtype(initial_state: Optional[Tensor]) -> torch.dtype:
    return torch.float32 if initial_state is None else initial_state.dtype


def _empty_outputs(q, v, initial_state, cu_seqlens, output_final_state):
    check_rank(q, v)
    out = q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), dtype=torch.bfloat16)
    if output_final_state:
        final_state = q.new_empty(_state_shape(q, v, cu_seqlens), dtype=_state_dtype(initial_state))
    else:
        final_state = q.new_empty((0,), dtype=_state_dtype(initial_state))
    return out, final_state


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor,
                initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], lower_bound: float, scale: float,
                gate: int, output_final_state: bool, check_cu_seqlens: bool) -> Tuple[Tensor, Tensor]:
    out, final_state = _empty_outputs(q, v, initial_state, cu_seqlens, output_final_state)
    _launch(q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state if output_final_state else None,
            cu_seqlens, lower_bound, scale, gate, check_cu_seqlens)
    return out, final_state


_forward_op = torch.library.custom_op("flashkda::forward", mutates_args=())(_forward_impl)


@_forward_op.register_fake
def _forward_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, lower_bound, scale, gate,
                  output_final_state, check_cu_seqlens):
    return _empty_outputs(q, v, initial_state, cu_seqlens, output_final_state)


def _forward_out_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor,
                    initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], out: Tensor,
                    final_state: Optional[Tensor], lower_bound: float, scale: float, gate: int,
                    check_cu_seqlens: bool) -> None:
    _launch(q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens,
            lower_bound, scale, gate, check_cu_seqlens)


_forward_out_op = torch.library.custom_op("flashkda::forward_out", mutates_args=("out", "final_state"))(
    _forward_out_impl)


@_forward_out_op.register_fake
def _forward_out_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state,
                      lower_bound, scale, gate, check_cu_seqlens):
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
        _ext.check_array(_ext.ARG_NAMES.index(name), x)  # raises the extension's error, naming the argument
        raise TypeError(f"{name}: torch cannot import this {type(x).__name__} beside torch tensors ({e}); "
                        f"pass a torch tensor") from None


_FORWARD_NAMES = ("k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens", "out")
_FORWARD_OUT_NAMES = _FORWARD_NAMES + ("final_state",)


def forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out,
            lower_bound, scale, gate, output_final_state, check_cu_seqlens):
    """flashkda.forward for torch tensors."""
    k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out = (
        _as_tensor(x, name) for x, name in zip((k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out),
                                               _FORWARD_NAMES))
    if out is None:
        op = _forward_impl if _plain_eager(q) else torch.ops.flashkda.forward
        out, final_state = op(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                              lower_bound, scale, gate, output_final_state, check_cu_seqlens)
        return out, (final_state if output_final_state else None)
    final_state = None
    if output_final_state:
        final_state = q.new_empty(_state_shape(q, v, cu_seqlens), dtype=_state_dtype(initial_state))
    forward_out(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state,
                lower_bound, scale, gate, check_cu_seqlens)
    return out, final_state


def forward_out(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state,
                lower_bound, scale, gate, check_cu_seqlens) -> None:
    """flashkda.fwd (and forward(out=...)) for torch tensors."""
    k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state = (
        _as_tensor(x, name) for x, name in zip((k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out,
                                                final_state), _FORWARD_OUT_NAMES))
    op = _forward_out_impl if _plain_eager(q) else torch.ops.flashkda.forward_out
    op(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, out, final_state,
       lower_bound, scale, gate, check_cu_seqlens)
