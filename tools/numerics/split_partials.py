#!/usr/bin/env python3
"""What the split pass's partial outputs would cost in accuracy if stored narrower (NumPy, fp64).

The split pass (few heads, one long sequence) runs each segment s >= 1 twice from the segment's
start: from a zero state (the B run: out_b, the rows' outputs without the true initial state) and
from the identity with v = 0 (the A run: out_a[t] = scale Phi_t^T q^_t, Phi_t the transition
from the segment's start to token t). The rows kernel then forms
    out[t] = out_b[t] + S_{s-1}^T out_a[t]
from fp32 out_b and out_a (written by the chains, read back: ~2/3 of the rows kernel's bytes).
Storing either in bf16 would cut that traffic; this measures what it adds to `out`'s error,
with every piece exact (fp64) except the roundings named, against the fp64 oracle:
    floor     bf16(out) alone: the output's own rounding, in every variant
    fp32      out_b and out_a rounded to fp32 (the kernels' storage now)
    bf16-b    out_b in bf16 (the B runs could write out's bf16 rows directly, the rows kernel
              adding the correction in place: out_b's 4 bytes a value become 2 read and 2 written)
    bf16-a    out_a in bf16
The contract's bar is 3e-3 rel (||x - ref||_2 / ||ref||_2, docs/contract.md); the GPU's whole
error on P7 / P8 is ~1.75e-3 (bench/results/h200.md), so what a variant adds beyond `fp32`
comes on top of the chains' own.

  python3 tools/numerics/split_partials.py [--tokens 4096] [--segments 4] [--seed 1]
"""
import argparse

import numpy as np


def bf16(x):
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def fp32(x):
    return np.asarray(x, np.float32).astype(np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def run(q, k, v, g, beta, A_log, dt_bias, lb, scale, S0):
    """The per-token recurrence of docs/contract.md in fp64 (safe gate). S0: [K, V]; returns
    out [T, V] and the final state [K, V]."""
    S = S0.astype(np.float64).copy()
    out = np.zeros((q.shape[0], S.shape[1]))
    for t in range(q.shape[0]):
        qh = q[t] / np.sqrt((q[t] ** 2).sum() + 1e-6)
        kh = k[t] / np.sqrt((k[t] ** 2).sum() + 1e-6)
        a = lb * sigmoid(np.exp(A_log) * (g[t] + dt_bias))
        S = np.exp(a)[:, None] * S
        S = S + sigmoid(beta[t]) * np.outer(kh, v[t] - S.T @ kh)
        out[t] = scale * S.T @ qh
    return out, S


def rel(x, ref):
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    T, K, lb, scale = args.tokens, 128, -5.0, 128 ** -0.5
    per = T // args.segments
    print(f"{'case':28s} {'floor':>9s} {'fp32':>9s} {'bf16-b':>9s} {'bf16-a':>9s}   (out rel, segments 1.. only)")
    for name, s0_scale in [("g ~ N(0,1)", 1.0), ("g = -8 (little decay)", 1.0), ("g = -8, |S0| ~ 1e3", 1e3)]:
        q, k, v = (bf16(rng.standard_normal((T, K))) for _ in range(3))
        g = bf16(np.full((T, K), -8.0) if "-8" in name else rng.standard_normal((T, K)))
        beta = bf16(rng.standard_normal(T))
        A_log, dt_bias = rng.uniform(0, 1), rng.uniform(0, 1, K)
        S0 = bf16(rng.standard_normal((K, K)) * s0_scale)
        ref, _ = run(q, k, v, g, beta, A_log, dt_bias, lb, scale, S0)
        # The true state where each segment starts, then each segment's two runs.
        starts = [S0]
        for s in range(args.segments - 1):
            rows = slice(s * per, (s + 1) * per)
            starts.append(run(q[rows], k[rows], v[rows], g[rows], beta[rows], A_log, dt_bias, lb, scale, starts[-1])[1])
        forms = {"floor": [], "fp32": [], "bf16-b": [], "bf16-a": []}
        refs = []
        for s in range(1, args.segments):
            rows = slice(s * per, (s + 1) * per)
            args_s = (q[rows], k[rows]), (g[rows], beta[rows], A_log, dt_bias, lb, scale)
            out_b, _ = run(*args_s[0], v[rows], *args_s[1], np.zeros((K, K)))
            out_a, _ = run(*args_s[0], np.zeros_like(v[rows]), *args_s[1], np.eye(K))  # [t, k]: scale Phi_t^T q^_t
            prev = starts[s]  # S_{s-1} [K, V]
            refs.append(ref[rows])
            forms["floor"].append(bf16(ref[rows]))
            forms["fp32"].append(bf16(fp32(out_b) + fp32(out_a) @ fp32(prev)))
            forms["bf16-b"].append(bf16(bf16(out_b) + fp32(out_a) @ fp32(prev)))
            forms["bf16-a"].append(bf16(fp32(out_b) + bf16(out_a) @ fp32(prev)))
        r = np.concatenate(refs)
        errors = [rel(np.concatenate(forms[f]), r) for f in ("floor", "fp32", "bf16-b", "bf16-a")]
        print(f"{name:28s} " + " ".join(f"{e:9.2e}" for e in errors), flush=True)


if __name__ == "__main__":
    main()
