"""nonapprox: softmax over time of one self-gated scalar per token (Eq. 7-8 and 18).

Per head::

    s_j = sum_d SiLU(q_j)_d * k_j_d / sqrt(d_h)                 (one scalar per token and head)
    o_i = sum_{j<=i} exp(s_j) v_j / sum_{j<=i} exp(s_j)          (Eq. 18)

There is no pairwise q_i.k_j: token j's weight does not depend on the query position i, only the
normaliser grows with i. The op applies SiLU to q itself (callers pass the raw projection).

Numerical stability: a running maximum. With ``r_i = max_{j<=i} s_j`` every weight is
``exp(s_j - r_i) <= 1`` and the denominator is >= 1 (it holds the maximum's own ``exp(0)``), so
nothing overflows and nothing underflows to 0/0 however large |s| gets. The running sums are kept
relative to the running max and rescaled by ``exp(old_max - new_max)`` when it grows — the online
softmax, with one scalar per token instead of a score row.

Forms: ``nonapprox_attention_quadratic`` (the O(L^2) definition through a masked softmax, for
checks), ``nonapprox_attention_chunked`` (chunks of C tokens: a masked [C, C] weight block inside
the chunk, the running (num, den, max) state across chunks — the reference implementation) and the
recurrent decode form ``nonapprox_decode_step``; ``nonapprox_prefill`` continues from and returns a
``NonapproxState``. fp32 inside (fp64 for fp64 inputs), q's dtype out.

GQA: s is per query head (SiLU(q) of head h against k of its group), so the state is per query
head: ``num`` [B, H, D], ``den`` and ``max`` [B, H] — for 2-byte storage exactly Table 8's
``2Bd + 4Bh`` bytes.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..kernels.nonapprox.state import NonapproxState
from ..kernels.nonapprox.state import check_state as _check_state
from .dispatch import check_qkv, choose_impl, repeat_kv

DEFAULT_CHUNK = 64


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/fp32 inputs, fp64 for fp64 inputs (so float64 gradchecks are exact)."""
    return torch.promote_types(dtype, torch.float32)


def token_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """s = sum_d SiLU(q) * k / sqrt(D) in the accumulation dtype. q: [..., H, D]; k: [..., H_kv, D]
    (GQA: query head h uses key head h // (H / H_kv)) -> [..., H]."""
    H, D = q.shape[-2], q.shape[-1]
    acc = accumulation_dtype(q.dtype)
    kf = k.to(acc).repeat_interleave(H // k.shape[-2], dim=-2)
    return (F.silu(q.to(acc)) * kf).sum(-1) / math.sqrt(D)


def nonapprox_attention_quadratic(q, k, v) -> torch.Tensor:
    """The O(L^2) definition: row i is softmax over j <= i of s_j. q: [B, T, H, D]; k, v:
    [B, T, H_kv, D] -> [B, T, H, D]."""
    B, T, H, H_kv, D = check_qkv("nonapprox_attention_quadratic", q, k, v)
    s = token_scores(q, k).transpose(1, 2)  # [B, H, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    logits = s.unsqueeze(2).expand(B, H, T, T).masked_fill(~causal, float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", logits.softmax(-1), repeat_kv(v, H).to(s.dtype))
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Decode state and the recurrent form
# ---------------------------------------------------------------------------------------------
def nonapprox_empty_state(batch: int, heads: int, head_dim: int, device=None,
                          dtype: torch.dtype = torch.float32) -> NonapproxState:
    """The state before the first token. ``heads`` is the query head count; ``dtype`` the storage
    dtype (fp32 default; fp16/bf16 gives Table 8's byte count, with bf16's 8-bit mantissa the
    denominator stops growing after a few hundred equal-weight tokens)."""
    return NonapproxState(torch.zeros(batch, heads, head_dim, dtype=dtype, device=device),
                          torch.zeros(batch, heads, dtype=dtype, device=device),
                          torch.full((batch, heads), float("-inf"), dtype=dtype, device=device), 0)


def nonapprox_decode_step(q, k, v, state: NonapproxState) -> torch.Tensor:
    """One token of the recurrent form. q: [B, H, D]; k, v: [B, H_kv, D]; ``state`` is updated in
    place. Returns o: [B, H, D] in q.dtype — row ``state.length`` of a full forward."""
    op = "nonapprox_decode_step"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{op}: {name} must be a tensor of shape [B, H, D] (one token)")
    B, _, H, H_kv, D = check_qkv(op, q[:, None], k[:, None], v[:, None])
    _check_state(op, state, B, H, D)
    s = token_scores(q, k)  # [B, H]
    vf = repeat_kv(v[:, None], H)[:, 0].to(s.dtype)
    old_max = state.max.to(s.dtype)
    new_max = torch.maximum(old_max, s)
    rescale = torch.exp(old_max - new_max)  # 0 for the first token (old_max = -inf)
    weight = torch.exp(s - new_max)  # <= 1
    num = state.num.to(s.dtype) * rescale.unsqueeze(-1) + weight.unsqueeze(-1) * vf
    den = state.den.to(s.dtype) * rescale + weight  # >= 1
    for stored, new in zip(state.tensors(), (num, den, new_max)):
        stored.copy_(new)
    state.length += 1
    return (num / den.unsqueeze(-1)).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# The chunked form (the reference implementation)
# ---------------------------------------------------------------------------------------------
def nonapprox_attention_chunked(q, k, v, chunk_size: int = DEFAULT_CHUNK,
                                state: Optional[NonapproxState] = None
                                ) -> Tuple[torch.Tensor, NonapproxState]:
    """Eq. 18 in chunks with a running max (O(T * C * D)). q: [B, T, H, D]; k, v: [B, T, H_kv, D].

    ``state`` (default: empty, in the accumulation dtype) is the sequence so far; it is not
    modified. Returns (out
    [B, T, H, D] in q.dtype, the state after the T tokens).
    """
    op = "nonapprox_attention"
    B, T, H, H_kv, D = check_qkv(op, q, k, v)
    if T < 1:
        raise ValueError(f"{op}: q, k, v must hold at least one token (T >= 1)")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size={chunk_size!r} is invalid: allowed a positive integer")
    if state is None:
        state = nonapprox_empty_state(B, H, D, device=q.device, dtype=accumulation_dtype(q.dtype))
    _check_state(op, state, B, H, D)
    s = token_scores(q, k)  # [B, T, H]
    vf = repeat_kv(v, H).to(s.dtype)
    num, den, run_max = (t.to(s.dtype) for t in state.tensors())
    outs = []
    for start in range(0, T, chunk_size):
        s_c, v_c = s[:, start:start + chunk_size], vf[:, start:start + chunk_size]
        C = s_c.shape[1]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril().view(1, C, C, 1)
        # the reference of query i: the max over all j <= i (earlier chunks included)
        ref = torch.maximum(run_max.unsqueeze(1), s_c.cummax(1).values)  # [B, C, H]
        # weight of token j for query i: exp(s_j - ref_i) <= 1 for j <= i; above the diagonal
        # -inf is set before exp, so no inf (and no inf * 0 = nan) enters the graph
        logit = torch.where(causal, s_c.unsqueeze(1) - ref.unsqueeze(2), float("-inf"))
        weight = logit.exp()  # [B, C_i, C_j, H]
        carry = torch.exp(run_max.unsqueeze(1) - ref)  # rescales the earlier chunks' sums
        num_c = (carry.unsqueeze(-1) * num.unsqueeze(1)
                 + torch.einsum("bijh,bjhd->bihd", weight, v_c))
        den_c = carry * den.unsqueeze(1) + weight.sum(2)  # >= 1: holds exp(0) of the max
        outs.append(num_c / den_c.unsqueeze(-1))
        num, den, run_max = num_c[:, -1], den_c[:, -1], ref[:, -1]
    out = torch.cat(outs, 1).to(q.dtype)
    dtype = state.num.dtype
    final = NonapproxState(num.to(dtype), den.to(dtype), run_max.to(dtype), state.length + T)
    return out, final


# ---------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------
def _kernel():
    """The Triton implementation, or None when it (or triton) is missing. Its
    signature: ``kernel(q, k, v, state=None, output_final_state=False)``."""
    try:
        from megatron_subq.kernels.nonapprox import nonapprox_attention_kernel  # noqa: PLC0415
    except ImportError:
        return None
    return nonapprox_attention_kernel


def nonapprox_attention(q, k, v, impl: Optional[str] = None,
                        chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """The nonapprox variant's attention. q: [B, T, H, D] raw query projection (the op applies
    SiLU); k, v: [B, T, H_kv, D]. Returns [B, T, H, D] in q.dtype.

    ``impl``: "reference" (the chunked PyTorch form, fp32), "kernel" (Triton,
    ``kernels/nonapprox``), None (the kernel on CUDA when available, else the reference).
    """
    check_qkv("nonapprox_attention", q, k, v)
    kernel = _kernel()
    if choose_impl("nonapprox_attention", impl, (q, k, v), kernel) == "kernel":
        return kernel(q, k, v)
    return nonapprox_attention_chunked(q, k, v, chunk_size=chunk_size)[0]


def nonapprox_prefill(q, k, v, state: Optional[NonapproxState] = None,
                      impl: Optional[str] = None) -> Tuple[torch.Tensor, NonapproxState]:
    """``nonapprox_attention`` continuing from ``state`` (default: empty) and returning the new
    state, so that prefill chunks and ``nonapprox_decode_step`` continue one another. Both forms
    are differentiable through the states (the kernel too: gradients of the starting state's
    tensors, and from the returned ones): context parallelism's state passing uses it."""
    check_qkv("nonapprox_prefill", q, k, v)
    kernel = _kernel()
    if choose_impl("nonapprox_prefill", impl, (q, k, v), kernel) == "kernel":
        return kernel(q, k, v, state=state, output_final_state=True)
    return nonapprox_attention_chunked(q, k, v, state=state)
