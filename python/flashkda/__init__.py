"""FlashKDA: Kimi Delta Attention forward (prefill), CUDA kernels for Hopper and a CPU backend.

    out, final_state = flashkda.forward(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                        output_final_state=True)

Tensors are torch tensors, NumPy arrays (bfloat16 through ml_dtypes), CuPy or JAX arrays, or
anything else with DLPack; they are passed to the C++ library without copies. CUDA tensors run
the CUDA kernels on the caller's current stream (when this build has them: see ``info()``),
CPU tensors the CPU backend. ``flashkda.fwd`` is the call of the existing ``flash_kda.fwd``, so
``import flashkda as flash_kda`` is a drop-in change.
"""

from ._api import fwd, forward, info
from ._ext import cuda_compiled as _cuda_compiled

__version__ = "0.1.0"

#: True when this build of flashkda includes the CUDA kernels (nvcc was found at build time);
#: False for a CPU-backend-only build.
WITH_CUDA: bool = bool(_cuda_compiled())

__all__ = ["forward", "fwd", "info", "WITH_CUDA", "__version__"]
