"""Shared by the pytest suites: random KDA problems (docs/contract.md's test inputs), the fp64 oracle
(the extension's testing hook) and the error measure rel = ||x - ref|| / ||ref||."""

import numpy as np
import pytest

import flashkda
from flashkda import _ext, _frameworks

try:
    import ml_dtypes

    BF16 = ml_dtypes.bfloat16
except ImportError:  # the NumPy suites need it; conftest skips them without
    ml_dtypes = None
    BF16 = None

try:
    import torch
except ImportError:
    torch = None

# The framework suites run each case on NumPy arrays and, where torch is installed, torch tensors.
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed: the torch cases are skipped")
FRAMEWORKS = ["numpy", pytest.param("torch", marks=needs_torch)]
# ... and, for the suites that run on both backends, torch tensors on the GPU where there is one.
# The CUDA cases need a GPU torch and a flashkda built with its kernels; each skips saying which is missing.
needs_cuda = [
    pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                       reason="torch.cuda is not available: the CUDA cases are skipped"),
    pytest.mark.skipif(not flashkda.WITH_CUDA, reason="flashkda was built without its CUDA kernels"),
]
DEVICE_FRAMEWORKS = FRAMEWORKS + [pytest.param("cuda", marks=needs_cuda)]

K = 128
BAR = 3e-3  # docs/contract.md: rel <= 3e-3 on out and on final_state
GATES = {"safe": 0, "softplus": 1}


def make_problem(B=1, T=16, H=2, lengths=None, state="float32", cu_dtype="int64", seed=0, state_scale=1.0):
    """NumPy inputs (bfloat16 through ml_dtypes): q, k, v, g ~ N(0,1), beta_logit ~ N(0,1),
    A_log, dt_bias ~ U(0,1), initial_state ~ N(0,1) * state_scale (or None)."""
    rng = np.random.default_rng(seed)
    cu = None
    if lengths is not None:
        B, T = 1, int(sum(lengths))
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(cu_dtype)
    N = B if cu is None else len(cu) - 1
    p = {name: rng.standard_normal((B, T, H, K)).astype(BF16) for name in ("q", "k", "v", "g")}
    p["beta"] = rng.standard_normal((B, T, H)).astype(BF16)
    p["A_log"] = rng.uniform(0, 1, H).astype(np.float32)
    p["dt_bias"] = rng.uniform(0, 1, (H, K)).astype(np.float32)
    p["initial_state"] = None
    if state is not None:
        p["initial_state"] = (rng.standard_normal((N, H, K, K)) * state_scale).astype(BF16 if state == "bfloat16" else np.float32)
    p["cu_seqlens"] = cu
    return p


def to_torch(p, device="cpu"):
    """The same problem as torch tensors (bfloat16 bits carried over exactly)."""
    def conv(x):
        if x is None:
            return None
        if x.dtype == BF16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(device)
        return torch.from_numpy(x).to(device)

    return {name: conv(x) for name, x in p.items()}


def oracle(p, lower_bound=-5.0, scale=None, gate="safe"):
    """fp64 reference (out [B, T, H, V], final_state [N, H, V, K]) for NumPy or torch inputs."""
    if torch is not None and isinstance(p["q"], torch.Tensor):
        p = {name: (None if x is None else x.detach().cpu()) for name, x in p.items()}
    scale = K ** -0.5 if scale is None else scale
    args, views = _frameworks._prepare({name: p[name] for name in _ext.ARG_NAMES if name in p})
    return _ext.oracle_forward(args["q"], args["k"], args["v"], args["g"], args["beta"], args["A_log"],
                               args["dt_bias"], args["initial_state"], args["cu_seqlens"], lower_bound, scale,
                               GATES[gate], views)


def as_f64(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x).astype(np.float64)


def rel(x, ref):
    x, ref = as_f64(x), np.asarray(ref, dtype=np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert np.isfinite(x).all(), "NaN or Inf in the result"
    den = np.linalg.norm(ref)
    num = np.linalg.norm(x - ref)
    return num / den if den > 0 else num  # an all-zero reference must be matched exactly


def run_forward(p, **kw):
    return flashkda.forward(p["q"], p["k"], p["v"], p["g"], p["beta"], A_log=p["A_log"], dt_bias=p["dt_bias"],
                            initial_state=p["initial_state"], cu_seqlens=p["cu_seqlens"], **kw)


def check_against_oracle(p, out, final_state, lower_bound=-5.0, scale=None, gate="safe"):
    ref_out, ref_state = oracle(p, lower_bound=lower_bound, scale=scale, gate=gate)
    e_out = rel(out, ref_out)
    assert e_out <= BAR, f"out: rel error {e_out:.2e} > {BAR}"
    e_state = None
    if final_state is not None:
        e_state = rel(final_state, ref_state)
        assert e_state <= BAR, f"final_state: rel error {e_state:.2e} > {BAR}"
    return e_out, e_state


class FakeJaxArray:
    """Stands for a JAX array where JAX is not installed: flashkda tells frameworks apart by the
    type's module."""

    __module__ = "jax._src.array"

    def __init__(self, x):
        self._x = x
        self.shape = x.shape
        self.dtype = x.dtype

    @property
    def __array_interface__(self):
        return self._x.__array_interface__


def to_fw(x, fw):
    """A NumPy master array in the framework under test ("numpy", "torch", or "cuda": torch on the
    GPU)."""
    if x is None or fw == "numpy":
        return x
    return to_torch({"x": x}, "cuda" if fw == "cuda" else "cpu")["x"]


def normal_pool(dtype, seed, slots, heads):
    """A state pool [slots, heads, K, K] of N(0, 1) values, float32 or bfloat16 (NumPy)."""
    x = np.random.default_rng(seed).standard_normal((slots, heads, K, K))
    return x.astype(BF16 if dtype == "bfloat16" else np.float32)
