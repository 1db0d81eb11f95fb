"""FlashKDA: Kimi Delta Attention forward (prefill), CUDA kernels for Hopper and a CPU backend.

    out, final_state = flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                        output_final_state=True)

Tensors are torch tensors, NumPy arrays (bfloat16 through ml_dtypes), CuPy or JAX arrays, or
anything else with DLPack; they are passed to the C++ library without copies. CUDA tensors run
the CUDA kernels on the caller's current stream (when this build has them: see ``info()``),
CPU tensors the CPU backend. Inference only: there is no backward yet, so torch tensors that
require grad are refused while grad mode is on (call under ``torch.no_grad()`` or
``torch.inference_mode()``).

``flashkda.fwd`` is the call of the existing ``flash_kda.fwd``, so ``import flashkda as flash_kda``
is a drop-in change. For code that imports ``flash_kda`` itself (engines using fla), call
``flashkda.register_as_flash_kda()`` once, before that code runs: from then on ``import flash_kda``
in this process gives a module whose ``fwd`` is ``flashkda.fwd`` (also ``forward``, ``info``,
``WITH_CUDA``, ``__version__``). It is opt-in, calling it again is harmless, and it raises
RuntimeError, changing nothing, when a different ``flash_kda`` is already imported.

Serving: ``flashkda.decode`` runs a decode step over an engine's state pool (each request's
state read from its slot and written back in place; per-token states for speculative verify; on
CUDA tensors the recurrent kernel, on host arrays the CPU backend), and
``flashkda.fused_recurrent_kda`` takes the keywords of the Triton decode kernel that engines call
(``ssm_state_indices``, ``num_accepted_tokens``, ``inplace_final_state``, ``state_v_first``, ...),
mapped onto the same call.
"""

from ._api import fwd, forward, info
from ._decode import decode, fused_recurrent_kda
from ._ext import cuda_compiled as _cuda_compiled
from ._flash_kda import register_as_flash_kda

__version__ = "0.1.0"

#: True when this build of flashkda includes the CUDA kernels (nvcc was found at build time);
#: False for a CPU-backend-only build.
WITH_CUDA: bool = bool(_cuda_compiled())

__all__ = ["forward", "fwd", "decode", "fused_recurrent_kda", "info", "register_as_flash_kda", "WITH_CUDA",
           "__version__"]
