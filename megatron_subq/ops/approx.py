"""approx: deconstructing-attention's Taylor-form linear attention (Appendix I, Eq. 14-17).

Per head, with q and k pre-scaled by ``d_h^{-1/4}`` (so that ``q~.k~ = q.k / sqrt(d_h)``, the
softmax logit it stands in for) and ``phi(x) = x * x / sqrt(2)`` (element-wise square)::

    o_i  = o0_i + o1_i + o2_i                                                       (14)
    o0_i = sum_{j<=i} v_j / (i + 1)                  (0-based i: the running mean)    (15)
    o1_i = q~_i (sum_{j<=i} k~_j^T v_j)       / safe(q~_i . sum_{j<=i} k~_j)          (16)
    o2_i = phi(q~_i) (sum_{j<=i} phi(k~_j)^T v_j) / safe(phi(q~_i) . sum_{j<=i} phi(k~_j))  (17)

Three separately normalised terms (not Based's single ``1 + qk + (qk)^2/2`` normaliser), and the
second-order term uses element-wise squares of q and k, exactly as the paper's Eq. 17 writes it.

Denominators near zero. o1's denominator ``q~_i . sum k~_j`` has no sign: it can be 0 or cross 0
(identity features are not positive). o2's is >= 0 and is 0 when ``q = 0``. ``safe`` therefore
replaces a denominator with ``|den| < eps`` by ``eps`` carrying the denominator's sign (+eps for
+-0 and for o2): outputs stay finite (``|o1_i| <= |numerator| / eps``), the gradient through the
guarded denominator is zero there, and every form below (O(L^2), chunked, recurrent) applies the
same rule, so they agree. ``eps`` (default 1e-6) is an op argument.

Forms: ``approx_attention_quadratic`` (the O(L^2) definition, for checks),
``approx_attention_chunked`` (the O(L d_h^2) chunked form: inside a chunk the masked O(C^2) product,
across chunks the running states — the reference implementation), ``approx_prefill`` (the same,
continuing from and returning an ``ApproxState``) and the recurrent decode form
``approx_decode_step``. Everything is computed in fp32 (fp64 for fp64 inputs) and returned in q's
dtype.

GQA: k/v have ``H_kv`` heads; query head ``h`` reads the states of key/value head ``h // (H/H_kv)``.
The decode state is per key/value head: ``3 d_h`` vector entries (sum v, sum k~, sum phi(k~)) and
``2 d_h^2`` matrix entries (sum k~^T v, sum phi(k~)^T v) per head — for H_kv = h, B sequences and
2-byte storage exactly Table 8's ``6Bd + 4Bd^2/h`` bytes.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..kernels.approx.state import ApproxState
from ..kernels.approx.state import check_eps as _check_eps
from ..kernels.approx.state import check_state as _check_state
from .dispatch import check_qkv, choose_impl, repeat_kv

DEFAULT_EPS = 1e-6
DEFAULT_CHUNK = 64
_SQRT2 = math.sqrt(2.0)


def _phi2(x: torch.Tensor) -> torch.Tensor:
    """The second-order feature map of Eq. 17: element-wise square scaled by 1/sqrt(2)."""
    return x * x / _SQRT2


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/fp32 inputs, fp64 for fp64 inputs (so float64 gradchecks are exact)."""
    return torch.promote_types(dtype, torch.float32)


def _prescale(x: torch.Tensor) -> torch.Tensor:
    """Accumulation-dtype copy scaled by d_h^{-1/4} (applied to q and k alike)."""
    return x.to(accumulation_dtype(x.dtype)) * x.shape[-1] ** -0.25


def safe_denominator(den: torch.Tensor, eps: float) -> torch.Tensor:
    """``den`` with every entry of magnitude below ``eps`` replaced by ``+-eps`` (sign kept, +eps
    for zero), so that a division by it is finite."""
    guard = torch.where(den < 0, -eps, eps).to(den.dtype)
    return torch.where(den.abs() < eps, guard, den)


# ---------------------------------------------------------------------------------------------
# The O(L^2) definition
# ---------------------------------------------------------------------------------------------
def approx_attention_quadratic(q, k, v, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Eq. 14-17 with explicit [T, T] weight matrices. q: [B, T, H, D]; k, v: [B, T, H_kv, D]."""
    B, T, H, H_kv, D = check_qkv("approx_attention_quadratic", q, k, v)
    _check_eps("approx_attention_quadratic", eps)
    qs, ks = _prescale(q), _prescale(repeat_kv(k, H))
    vf = repeat_kv(v, H).to(qs.dtype)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()

    def normalised(weights):  # weights: [B, H, T, T], masked causally
        weights = weights.masked_fill(~causal, 0.0)
        num = torch.einsum("bhij,bjhd->bihd", weights, vf)
        den = weights.sum(-1).transpose(1, 2)  # [B, T, H]
        return num / safe_denominator(den, eps).unsqueeze(-1)

    o0 = torch.einsum("ij,bjhd->bihd", causal.to(vf.dtype), vf)
    o0 = o0 / torch.arange(1, T + 1, device=q.device, dtype=vf.dtype).view(1, T, 1, 1)
    o1 = normalised(torch.einsum("bihd,bjhd->bhij", qs, ks))
    o2 = normalised(torch.einsum("bihd,bjhd->bhij", _phi2(qs), _phi2(ks)))
    return (o0 + o1 + o2).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Decode state and the recurrent form
# ---------------------------------------------------------------------------------------------
def approx_empty_state(batch: int, kv_heads: int, head_dim: int, device=None,
                       dtype: torch.dtype = torch.float32) -> ApproxState:
    """The state before the first token (zeros). ``dtype`` is the storage dtype: fp32 by default;
    fp16/bf16 gives Table 8's byte count but accumulates rounding error over long sequences."""
    def zeros(*shape):
        return torch.zeros(batch, kv_heads, *shape, dtype=dtype, device=device)

    return ApproxState(zeros(head_dim), zeros(head_dim), zeros(head_dim),
                       zeros(head_dim, head_dim), zeros(head_dim, head_dim), 0)


def approx_decode_step(q, k, v, state: ApproxState, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """One token of the recurrent form. q: [B, H, D]; k, v: [B, H_kv, D]; ``state`` is updated in
    place (token i is added first: Eq. 15-17 include j = i). Returns o: [B, H, D] in q.dtype — row
    ``state.length`` of a full forward."""
    op = "approx_decode_step"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{op}: {name} must be a tensor of shape [B, H, D] (one token)")
    B, _, H, H_kv, D = check_qkv(op, q[:, None], k[:, None], v[:, None])
    _check_eps(op, eps)
    _check_state(op, state, B, H_kv, D)
    qs = _prescale(q).reshape(B, H_kv, H // H_kv, D)
    ks = _prescale(k)
    vf = v.to(ks.dtype)
    sums = [t.to(ks.dtype) for t in state.tensors()]
    updates = (vf, ks, _phi2(ks), ks.unsqueeze(-1) * vf.unsqueeze(-2),
               _phi2(ks).unsqueeze(-1) * vf.unsqueeze(-2))
    sum_v, sum_k1, sum_k2, kv1, kv2 = (s + u for s, u in zip(sums, updates))
    for stored, new in zip(state.tensors(), (sum_v, sum_k1, sum_k2, kv1, kv2)):
        stored.copy_(new)
    state.length += 1

    def term(qf, kv, ksum):  # qf: [B, H_kv, G, D]
        num = torch.einsum("bhgd,bhde->bhge", qf, kv)
        den = torch.einsum("bhgd,bhd->bhg", qf, ksum)
        return num / safe_denominator(den, eps).unsqueeze(-1)

    out = (sum_v / state.length).unsqueeze(2) + term(qs, kv1, sum_k1) + term(_phi2(qs), kv2,
                                                                              sum_k2)
    return out.reshape(B, H, D).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# The chunked form (the reference implementation)
# ---------------------------------------------------------------------------------------------
def _exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum of the entries strictly before each index along ``dim``."""
    c = x.cumsum(dim)
    return torch.cat([torch.zeros_like(c.narrow(dim, 0, 1)), c.narrow(dim, 0, c.shape[dim] - 1)],
                     dim)


def _chunked_term(qf, kf, vf, kv0, ksum0, eps):
    """One normalised term (Eq. 16 or 17) in chunks, from the states ``kv0``/``ksum0`` before it.

    qf: [B, N, C, H_kv, G, D] (features of q); kf, vf: [B, N, C, H_kv, D];
    kv0: [B, H_kv, D, D]; ksum0: [B, H_kv, D]. Returns (out [B, N, C, H_kv, G, D], kv, ksum) with
    the states after the last chunk.
    """
    C = qf.shape[2]
    causal = torch.ones(C, C, dtype=torch.bool, device=qf.device).tril()
    chunk_kv = torch.einsum("bnchd,bnche->bnhde", kf, vf)  # each chunk's sum k^T v
    chunk_ksum = kf.sum(2)  # [B, N, H_kv, D]
    kv_before = kv0.unsqueeze(1) + _exclusive_cumsum(chunk_kv, 1)  # state entering each chunk
    ksum_before = ksum0.unsqueeze(1) + _exclusive_cumsum(chunk_ksum, 1)

    scores = torch.einsum("bnihgd,bnjhd->bnhgij", qf, kf).masked_fill(~causal, 0.0)
    num = (torch.einsum("bnhgij,bnjhe->bnihge", scores, vf)  # inside the chunk
           + torch.einsum("bnchgd,bnhde->bnchge", qf, kv_before))  # earlier chunks
    ksum_through = ksum_before.unsqueeze(2) + kf.cumsum(2)  # sum over j <= i: [B, N, C, H_kv, D]
    den = torch.einsum("bnchgd,bnchd->bnchg", qf, ksum_through)
    out = num / safe_denominator(den, eps).unsqueeze(-1)
    return out, kv_before[:, -1] + chunk_kv[:, -1], ksum_through[:, -1, -1]


def approx_attention_chunked(q, k, v, eps: float = DEFAULT_EPS, chunk_size: int = DEFAULT_CHUNK,
                             state: Optional[ApproxState] = None
                             ) -> Tuple[torch.Tensor, ApproxState]:
    """Eq. 14-17 in O(T * D^2): chunks of ``chunk_size`` tokens, running states between chunks.

    q: [B, T, H, D]; k, v: [B, T, H_kv, D]. ``state`` (default: empty, in the accumulation
    dtype) is the sequence so far; it is not modified. Returns (out [B, T, H, D] in q.dtype, the
    state after the T tokens).
    """
    op = "approx_attention"
    B, T, H, H_kv, D = check_qkv(op, q, k, v)
    _check_eps(op, eps)
    if T < 1:
        raise ValueError(f"{op}: q, k, v must hold at least one token (T >= 1)")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size={chunk_size!r} is invalid: allowed a positive integer")
    if state is None:
        state = approx_empty_state(B, H_kv, D, device=q.device,
                                   dtype=accumulation_dtype(q.dtype))
    _check_state(op, state, B, H_kv, D)
    G, C = H // H_kv, min(chunk_size, T)
    N = -(-T // C)
    pad = N * C - T  # zero tokens at the end change no earlier output and no running sum

    def chunks(x):  # [B, T, h, D] -> [B, N, C, h, D]
        return F.pad(x, (0, 0, 0, 0, 0, pad)).reshape(B, N, C, *x.shape[2:])

    qs, ks = _prescale(q), _prescale(k)
    vf = v.to(ks.dtype)
    s0 = [t.to(ks.dtype) for t in state.tensors()]
    qc, kc, vc = chunks(qs).reshape(B, N, C, H_kv, G, D), chunks(ks), chunks(vf)
    o1, kv1, sum_k1 = _chunked_term(qc, kc, vc, s0[3], s0[1], eps)
    o2, kv2, sum_k2 = _chunked_term(_phi2(qc), _phi2(kc), vc, s0[4], s0[2], eps)

    v_through = s0[0].unsqueeze(1) + vf.cumsum(1)  # [B, T, H_kv, D]: sum over j <= i
    count = state.length + torch.arange(1, T + 1, device=q.device, dtype=vf.dtype)
    o0 = (v_through / count.view(1, T, 1, 1)).unsqueeze(3)  # [B, T, H_kv, 1, D]
    o12 = (o1 + o2).reshape(B, N * C, H_kv, G, D)[:, :T]
    out = (o0 + o12).reshape(B, T, H, D).to(q.dtype)
    dtype = state.sum_v.dtype
    final = ApproxState(*(t.to(dtype) for t in (v_through[:, -1], sum_k1, sum_k2, kv1, kv2)),
                        state.length + T)
    return out, final


# ---------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------
def _kernel(q: torch.Tensor, impl: Optional[str]):
    """The Triton implementation, or None when triton (or the kernel package) is missing — or,
    for ``impl=None`` on CUDA, when the head dim is outside the kernel's GPU-verified sizes (the
    reference runs instead; ``impl="kernel"`` gets the kernel itself). Signature:
    ``kernel(q, k, v, eps, state=None, output_final_state=False)``."""
    try:
        from megatron_subq.kernels.approx import (  # noqa: PLC0415
            approx_attention_kernel,
            kernel_supports,
        )
    except ImportError:
        return None
    if impl is None and q.is_cuda and not kernel_supports(q.shape[3]):
        return None
    return approx_attention_kernel


def approx_attention(q, k, v, impl: Optional[str] = None, eps: float = DEFAULT_EPS,
                     chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """The approx variant's attention. q: [B, T, H, D] raw query projections; k, v: [B, T, H_kv, D]
    raw key/value projections (the op applies the d_h^{-1/4} pre-scaling). Returns [B, T, H, D] in
    q.dtype.

    ``impl``: "reference" (the chunked PyTorch form, fp32), "kernel" (Triton, ``kernels/approx``),
    None (the kernel on CUDA when available, else the reference).
    """
    check_qkv("approx_attention", q, k, v)
    kernel = _kernel(q, impl)
    if choose_impl("approx_attention", impl, (q, k, v), kernel) == "kernel":
        return kernel(q, k, v, eps=eps)
    return approx_attention_chunked(q, k, v, eps=eps, chunk_size=chunk_size)[0]


def approx_prefill(q, k, v, state: Optional[ApproxState] = None, impl: Optional[str] = None,
                   eps: float = DEFAULT_EPS) -> Tuple[torch.Tensor, ApproxState]:
    """``approx_attention`` continuing from ``state`` (default: empty) and returning the new state,
    so that prefill chunks and ``approx_decode_step`` continue one another. Both forms are
    differentiable through the states (the kernel too: gradients of the starting state's
    tensors, and from the returned ones): context parallelism's state passing uses it."""
    check_qkv("approx_prefill", q, k, v)
    kernel = _kernel(q, impl)
    if choose_impl("approx_prefill", impl, (q, k, v), kernel) == "kernel":
        return kernel(q, k, v, eps=eps, state=state, output_final_state=True)
    return approx_attention_chunked(q, k, v, eps=eps, state=state)
