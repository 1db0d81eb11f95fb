#!/usr/bin/env python3
"""How to form L and M of a 16-token chunk for the softplus gate in fp32 (NumPy emulation).

L_ij = beta_i (k_i . k_j exp(G_i - G_j)) and M_ij = q_i . k_j exp(G_i - G_j), i >= j, need the decay
between tokens j and i per key channel. The prep kernel forms them as products of two factored rows,
(k_i e^{G_i - r}) . (k_j e^{r - G_j}), on the tensor cores. With the safe gate |G| <= 80 in a chunk
and r = 0 is fine. The softplus gate is unbounded (a = -exp(A_log) softplus(g + dt_bias) reaches
-400 a token with Kimi-Linear-like parameters), so some factor overflows fp32 for any single r.
Forms compared against the pairwise fp64 values (entries of |L|, |M| relative to the largest):

  one-ref      r = G at the chunk's first token: what the safe-gate kernel does (overflows)
  mid-ref      r = G at the middle token (still overflows on strong decay)
  two-level    the cross block (i in tokens 8..15, j in 0..7) with r = G_7, where both factors
               are <= 1 (exact; only true zeros underflow), and the two diagonal 8x8 blocks each with
               r = G at their middle, per-token log-decays clamped at -20 for these factors only
               (e^-20 = 2e-9, under fp32's resolution): spans <= 8 x 20, factors within e^+-80
  pairwise     exp(G_i - G_j) per pair and channel (the CPU backend's form; 16x the exponentials)

  python3 tools/numerics/softplus_chunk_forms.py [--chunks 2000] [--seed 1]

Result (500 chunks, seed 1, log-decays down to -446 a token): one-ref 62848 and mid-ref 28466
non-finite entries; two-level none, max error 2.4e-7 (L) and 1.0e-6 (M) relative to the chunk's
largest entry, fp32's own level. The two-level form costs a second factored product per matrix
(the cross block), so L and M take about twice their tensor-core work in the prep kernel.
"""
import argparse

import numpy as np

C, K = 16, 128


def softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def decays(rng, chunks):
    """Per-token log-decays [chunks, C, K] with Kimi-Linear-like parameters: A_log in [-1, 2.7],
    g + dt_bias in [-30, 30], whole chunks of near-zero decay and of wiping decay mixed in."""
    A = np.exp(rng.uniform(-1.0, 2.7, size=(chunks, 1, 1)))
    x = rng.uniform(-30, 30, size=(chunks, C, K))
    kind = rng.integers(0, 3, size=(chunks, 1, 1))
    x = np.where(kind == 0, -30.0, np.where(kind == 1, 30.0, x))
    return -A * softplus(x)


def pairwise_fp64(G, k, q):
    """L' = k_i . k_j e^{G_i - G_j} and M' = q_i . k_j e^{G_i - G_j} for i >= j (no beta)."""
    d = G[:, :, None, :] - G[:, None, :, :]  # [chunks, i, j, K]
    mask = np.tril(np.ones((C, C), bool))[None, :, :, None]
    e = np.where(mask, np.exp(np.where(mask, d, 0.0)), 0.0)
    L = np.einsum("nik,njk,nijk->nij", k, k, e)
    M = np.einsum("nik,njk,nijk->nij", q, k, e)
    return L, M


def factored(G, k, q, r_rows, r_cols, block_mask, clamp=None):
    """sum over blocks of (x_i e^{G_i - r}) . (k_j e^{r - G_j}) in fp32, r per (block) row/col."""
    f = np.float32
    Gc = G if clamp is None else clamp
    with np.errstate(over="ignore", invalid="ignore"):  # the overflows are what the table counts
        kt = (k * np.exp(f(Gc - r_rows))).astype(f)   # rows i
        km = (k * np.exp(f(r_cols - Gc))).astype(f)   # cols j
        qt = (q * np.exp(f(Gc - r_rows))).astype(f)
        L = np.einsum("nik,njk->nij", kt, km).astype(f)
        M = np.einsum("nik,njk->nij", qt, km).astype(f)
    return np.where(block_mask, L, 0), np.where(block_mask, M, 0)


def forms(G, k, q):
    n = G.shape[0]
    lower = np.tril(np.ones((C, C), bool))[None]
    out = {}
    r = np.repeat(G[:, :1, :], C, axis=1)
    out["one-ref"] = factored(G, k, q, r, r, lower)
    r = np.repeat(G[:, C // 2 - 1:C // 2, :], C, axis=1)
    out["mid-ref"] = factored(G, k, q, r, r, lower)
    # two-level: cross block exact with r = G_7; diagonal halves with clamped per-token decay
    cross = np.zeros((C, C), bool)
    cross[C // 2:, :C // 2] = True
    r7 = np.repeat(G[:, C // 2 - 1:C // 2, :], C, axis=1)
    Lx, Mx = factored(G, k, q, r7, r7, cross[None])
    a = np.diff(G, axis=1, prepend=np.zeros((n, 1, K)))
    Gcl = np.cumsum(np.maximum(a, -20.0), axis=1)  # clamped running sums, for the diagonal blocks only
    half = np.repeat(np.arange(2), C // 2)
    r_half = np.concatenate([np.repeat(Gcl[:, 3:4], C // 2, 1), np.repeat(Gcl[:, 11:12], C // 2, 1)], axis=1)
    diag = (half[:, None] == half[None, :]) & np.tril(np.ones((C, C), bool))
    Ld, Md = factored(G, k, q, r_half, r_half, diag[None], clamp=Gcl)
    out["two-level"] = (Lx + Ld, Mx + Md)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    a = decays(rng, args.chunks)
    G = np.cumsum(a, axis=1)
    k = rng.standard_normal((args.chunks, C, K))
    k /= np.linalg.norm(k, axis=2, keepdims=True)
    q = rng.standard_normal((args.chunks, C, K))
    q /= np.linalg.norm(q, axis=2, keepdims=True)
    Lr, Mr = pairwise_fp64(G, k, q)
    print(f"{args.chunks} chunks, per-token log-decay min {a.min():.1f}, chunk spans up to {(G[:, 0] - G[:, -1]).max():.0f}")
    print(f"{'form':10s} {'non-finite':>10s} {'max |dL|':>10s} {'max |dM|':>10s}   (relative to max |L|, |M| of each chunk)")
    scale_L = np.abs(Lr).max(axis=(1, 2), keepdims=True)
    scale_M = np.abs(Mr).max(axis=(1, 2), keepdims=True)
    for name, (L, M) in forms(G, k, q).items():
        bad = int((~np.isfinite(L)).sum() + (~np.isfinite(M)).sum())
        with np.errstate(invalid="ignore"):
            dL = np.nanmax(np.where(np.isfinite(L), np.abs(L - Lr) / scale_L, np.nan))
            dM = np.nanmax(np.where(np.isfinite(M), np.abs(M - Mr) / scale_M, np.nan))
        print(f"{name:10s} {bad:10d} {dL:10.2e} {dM:10.2e}")
    print("pairwise   (reference: fp64 exp(G_i - G_j) per pair and channel)")


if __name__ == "__main__":
    main()
