"""The low-rank algebra of AttentionPack (backends/attention_pack.py): randomized SVD with
oversampling (Halko, Martinsson and Tropp, "Finding structure with randomness", arXiv:0909.4061,
Sec. 1.3 and 4.2), the ranks that fit a byte budget, and reading values rebuilt from their factors
(fully or at a reduced rank, the paper's attention-aware decompression, Sec. 7.1.1)."""

from __future__ import annotations

import math

import torch

OVERSAMPLE = 10  # extra random test vectors of the randomized SVD (Halko et al. 2011: 5-10)


def randomized_svd(matrix: torch.Tensor, sketch: int, niter: int = 2, seed: int = 0):
    """(U, S, V) of ``matrix`` from ``sketch`` Gaussian test vectors and ``niter`` power iterations
    (Halko, Martinsson and Tropp, arXiv:0909.4061, Alg. 4.4; what ``torch.svd_lowrank`` computes),
    the test vectors drawn from a generator of its own seeded with ``seed``: the same input gives
    the same factors, and the global generator is left alone."""
    generator = torch.Generator(device=matrix.device).manual_seed(seed)
    tests = torch.randn(matrix.shape[1], sketch, generator=generator, device=matrix.device, dtype=matrix.dtype)
    basis = torch.linalg.qr(matrix @ tests).Q
    for _ in range(niter):
        basis = torch.linalg.qr(matrix.T @ basis).Q
        basis = torch.linalg.qr(matrix @ basis).Q
    u, s, vh = torch.linalg.svd(basis.T @ matrix, full_matrices=False)
    return basis @ u, s, vh.T


def factorise(matrix: torch.Tensor, rank: int, dtype: torch.dtype | None = None,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, W) ~ coef (T, R) @ basis (R, W), components by decreasing singular value, stored in ``dtype``."""
    dtype = dtype or matrix.dtype
    sketch = min(rank + OVERSAMPLE, *matrix.shape)  # oversampled: the top R of R + 10 fit better
    u, s, v = randomized_svd(matrix.float(), sketch, seed=seed)  # float32: no half-precision SVD kernels
    u, s, v = u[:, :rank], s[:rank], v[:, :rank]
    return (u * s).to(dtype), v.T.contiguous().to(dtype)


def factor_bytes(tokens: int, width: int, rank_k: int, rank_v: int, itemsize: int, scalars: int) -> int:
    """Bytes of a block: both factor pairs in the cache dtype plus ``scalars`` (rotary ids, groups)."""
    return (rank_k + rank_v) * (tokens + width) * itemsize + scalars


def fitted_rank(spare: float, tokens: int, width: int, itemsize: int, scalars: int) -> int:
    """The largest R (at least 1) whose key and value factors fit ``spare`` bytes beside ``scalars``."""
    return max(1, math.floor((spare - scalars) / (2 * (tokens + width) * itemsize)))


def block_ranks(requested: tuple[int, int], spare: float, tokens: int, width: int, itemsize: int,
                scalars: int) -> tuple[int, int]:
    """(R_k, R_v): the requested ranks (0: the largest fitting ``spare`` bytes), at most min(T, W)."""
    fitted = fitted_rank(spare, tokens, width, itemsize, scalars)
    return tuple(max(1, min(r or fitted, tokens, width)) for r in requested)


def rebuild(coef: torch.Tensor, basis: torch.Tensor, full: torch.Tensor | None, reduced: int) -> torch.Tensor:
    """Rows in ``full`` use every component, the others only the first ``reduced`` (fewer FLOPs)."""
    if full is None or reduced >= coef.shape[1]:
        return coef @ basis
    out = torch.empty(coef.shape[0], basis.shape[1], dtype=coef.dtype, device=coef.device)
    out[full] = coef[full] @ basis
    out[~full] = coef[~full, :reduced] @ basis[:reduced]
    return out


def mix_factors(probs: torch.Tensor, coef: torch.Tensor, basis: torch.Tensor, full: torch.Tensor | None,
                reduced: int) -> torch.Tensor:
    """probs (H_kv, G, T) @ values rebuilt by :func:`rebuild`, computed in factor space, float32:
    (H_kv, G, D). ``u = p @ coef`` (full-rank rows only beyond the first ``reduced`` components),
    then each KV head's slice of ``basis``."""
    kv_heads, groups, tokens = probs.shape
    p, coef = probs.reshape(-1, tokens), coef.float()
    if full is None or reduced >= coef.shape[1]:
        u = p @ coef
    else:
        u = torch.cat([p @ coef[:, :reduced], p[:, full] @ coef[full, reduced:]], dim=1)
    per_head = basis.float().view(basis.shape[0], kv_heads, -1).transpose(0, 1)  # (H_kv, R, D)
    return torch.matmul(u.view(kv_heads, groups, -1), per_head)
