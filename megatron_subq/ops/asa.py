"""ASA — Adaptive Subquadratic Attention, ``[B, T, H, D]`` (definition: ../shared/variants.md).

Per head ``h``, learned ``P_Q[h], P_K[h] ∈ R^{D×m}`` turn queries and keys into probability
vectors over ``m`` features::

    q'_i = softmax(q_i P_Q)          k'_j = softmax(k_j P_K)          (softmax over the m features)
    o_i  = q'_i · S_i / norm_i       S_i  = Σ_{j≤i} k'_jᵀ v_j  ∈ R^{m×Dv}

i.e. causal linear attention whose feature maps are the two softmaxes. ``normalize``:

* ``"linear"`` — ``norm_i = q'_i · z_i`` with ``z_i = Σ_{j≤i} k'_j``: the weights
  ``q'_i·k'_j / norm_i`` over ``j ≤ i`` sum to 1 (the paper's "probabilistic weighting");
* ``"none"``   — ``norm_i = 1``: the paper's literal two-stage product;
* ``"mean"``   — ``norm_i = i + 1``.

GQA: ``P_K`` has one matrix per *query* head (``p_k`` is ``[H, D, m]`` like ``p_q``). A key head
shared by a group of query heads is projected by each query head's own ``P_K``, so every query
head has its own ``k'`` and its own state ``(S, z)``; only ``k`` and ``v`` themselves are shared.
This keeps ASA's parameters per attention head as in the paper, whatever ``num_query_groups`` is.

No ``1/sqrt(D)`` scale: the definition feeds ``q P_Q`` to the softmax unscaled (the learned
``P_Q`` sets the temperature).

Decode state per (batch, query head): ``S`` ``[B, H, m, Dv]`` and ``z`` ``[B, H, m]`` in fp32 —
constant memory in the sequence length. Because every ``k'_j`` sums to 1, ``Σ_m z`` is the number
of tokens seen, which is the ``i + 1`` that ``"mean"`` needs when a state is continued.

Functions (all in fp32 internally, outputs in ``q.dtype``):

* ``asa_attention``            the op (``impl="reference" | "kernel" | None``; ``cu_seqlens``
                               for packed variable-length sequences);
* ``asa_prefill``              the op that also takes/returns a state (chunked prefill);
* ``asa_decode_step``          one token, updates ``(S, z)`` in place;
* ``asa_attention_chunked``    the readable chunked reference (what ``impl="reference"`` runs);
* ``asa_attention_quadratic``  the O(T²) form ``Σ_{j≤i} (q'_i·k'_j) v_j / norm_i`` (tests).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernels.asa.state import ASAState
from .dispatch import check_cu_seqlens, check_qkv, choose_impl, repeat_kv

ASA_NORMALIZE_MODES = ("linear", "none", "mean")
REFERENCE_CHUNK = 64


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/fp32 inputs, fp64 for fp64 inputs (so float64 gradchecks are exact)."""
    return torch.promote_types(dtype, torch.float32)


def asa_empty_state(batch: int, heads: int, rank: int, v_dim: int, device=None,
                    dtype: torch.dtype = torch.float32) -> ASAState:
    """The state before the first token (zeros); ``dtype`` is the accumulation dtype."""
    return ASAState(torch.zeros(batch, heads, rank, v_dim, dtype=dtype, device=device),
                    torch.zeros(batch, heads, rank, dtype=dtype, device=device))


# ------------------------------------------------------------------------------------------
# argument checks
# ------------------------------------------------------------------------------------------
def check_asa_args(op: str, q, k, v, p_q, p_k, normalize: str
                   ) -> Tuple[int, int, int, int, int, int]:
    """Validate the op's arguments; return ``(B, T, H, H_kv, D, m)``."""
    B, T, H, H_kv, D = check_qkv(op, q, k, v)
    for name, p in (("p_q", p_q), ("p_k", p_k)):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(p).__name__}")
        if p.dim() != 3 or p.shape[0] != H or p.shape[1] != D:
            raise ValueError(f"{op}: {name} must have shape [H={H}, D={D}, m], got "
                             f"{tuple(p.shape)}")
        if not p.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating-point tensor, got {p.dtype}")
        if p.device != q.device:
            raise ValueError(f"{op}: {name} must be on q's device {q.device}, got {p.device}")
    if p_q.shape != p_k.shape:
        raise ValueError(f"{op}: p_q and p_k must have the same shape [H, D, m], got "
                         f"{tuple(p_q.shape)} and {tuple(p_k.shape)}")
    if p_q.dtype != p_k.dtype:
        raise ValueError(f"{op}: p_q and p_k must share a dtype, got {p_q.dtype} and {p_k.dtype}")
    if normalize not in ASA_NORMALIZE_MODES:
        raise ValueError(f"{op}: normalize={normalize!r} is not one of {ASA_NORMALIZE_MODES}")
    return B, T, H, H_kv, D, p_q.shape[2]


def _check_state(op: str, state, B: int, H: int, m: int, Dv: int, q: torch.Tensor) -> None:
    if not (isinstance(state, tuple) and len(state) == 2):
        raise TypeError(f"{op}: state must be an ASAState(S, z), got {type(state).__name__}")
    S, z = state
    if tuple(S.shape) != (B, H, m, Dv) or tuple(z.shape) != (B, H, m):
        raise ValueError(f"{op}: state must be S [B={B}, H={H}, m={m}, Dv={Dv}] and z [B, H, m]; "
                         f"got S {tuple(S.shape)}, z {tuple(z.shape)}")
    acc = accumulation_dtype(q.dtype)
    if S.dtype != acc or z.dtype != acc:
        raise ValueError(f"{op}: state S and z must be {acc} for {q.dtype} inputs, got {S.dtype} "
                         f"and {z.dtype}")
    if S.device != q.device or z.device != q.device:
        raise ValueError(f"{op}: state must be on q's device {q.device}, got {S.device}, "
                         f"{z.device}")


# ------------------------------------------------------------------------------------------
# the reference
# ------------------------------------------------------------------------------------------
def asa_feature_maps(q, k, p_q, p_k) -> Tuple[torch.Tensor, torch.Tensor]:
    """``q' = softmax(q P_Q)``, ``k' = softmax(k P_K)`` in fp32 (fp64 for fp64 q), both
    ``[B, T, H, m]``.

    ``k`` may have fewer heads (GQA): each query head projects its group's key with its own P_K.
    """
    H, acc = q.shape[2], accumulation_dtype(q.dtype)
    q_feat = torch.einsum("bthd,hdm->bthm", q.to(acc), p_q.to(acc)).softmax(dim=-1)
    return q_feat, asa_key_features(k, p_k, H, acc)


def asa_key_features(k, p_k, heads: int, acc: torch.dtype) -> torch.Tensor:
    """``k' = softmax(k P_K)`` alone, ``[B, T, heads, m]`` in ``acc`` (``asa_feature_maps``'
    keys; a chunk's state needs no query features)."""
    return torch.einsum("bthd,hdm->bthm", repeat_kv(k, heads).to(acc),
                        p_k.to(acc)).softmax(dim=-1)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    # q'·z > 0 mathematically (softmax features are positive); the clamp only keeps an fp32
    # underflow of both numerator and denominator from turning into 0/0 = NaN.
    return num / den.clamp_min(torch.finfo(den.dtype).tiny)


def asa_attention_quadratic(q, k, v, p_q, p_k, normalize: str = "linear") -> torch.Tensor:
    """The O(T²) form: ``o_i = Σ_{j≤i} (q'_i·k'_j) v_j / norm_i`` (fp32; for tests)."""
    B, T, H, H_kv, D, m = check_asa_args("asa_attention_quadratic", q, k, v, p_q, p_k, normalize)
    q_feat, k_feat = asa_feature_maps(q, k, p_q, p_k)
    weights = torch.einsum("bihm,bjhm->bhij", q_feat, k_feat)
    weights = weights.tril()  # causal: j <= i
    if normalize == "linear":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    elif normalize == "mean":
        weights = weights / torch.arange(1, T + 1, device=q.device, dtype=weights.dtype)[:, None]
    out = torch.einsum("bhij,bjhd->bihd", weights, repeat_kv(v, H).to(weights.dtype))
    return out.to(q.dtype)


def asa_attention_chunked(q, k, v, p_q, p_k, normalize: str = "linear",
                          state: Optional[ASAState] = None, chunk_size: int = REFERENCE_CHUNK,
                          tokens_before: Optional[int] = None
                          ) -> Tuple[torch.Tensor, ASAState]:
    """The chunked reference: exact causal products inside a chunk, the running state across.

    For a chunk of queries/keys ``c`` after the state ``(S, z)`` of all earlier tokens::

        num_c = (q'_c k'_cᵀ ⊙ tril) v_c + q'_c S       den_c = (q'_c k'_cᵀ ⊙ tril) 1 + q'_c z
        S += k'_cᵀ v_c                                  z += k'_cᵀ 1

    fp32 throughout. Returns ``(o [B, T, H, Dv] in q.dtype, final state)``; ``state`` (default:
    zeros) is not modified. Autograd runs through the state both ways (S, z and the returned
    state). ``tokens_before`` ("mean"): the count of earlier tokens (a host int, no gradient);
    None: ``Σ_m z`` of the state.
    """
    B, T, H, H_kv, D, m = check_asa_args("asa_attention", q, k, v, p_q, p_k, normalize)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"asa_attention: chunk_size={chunk_size!r} must be a positive integer")
    Dv, acc = v.shape[3], accumulation_dtype(q.dtype)
    if state is None:
        state = asa_empty_state(B, H, m, Dv, device=q.device, dtype=acc)
    _check_state("asa_attention", state, B, H, m, Dv, q)
    # Tokens before this call: Σ_m z (each k' is a probability vector), used by "mean".
    seen = state.z.sum(dim=-1)  # [B, H]
    if tokens_before is not None:
        seen = torch.full_like(seen, float(tokens_before)).detach()
    S, z = state.S.clone(), state.z.clone()
    q_feat, k_feat = asa_feature_maps(q, k, p_q, p_k)  # [B, T, H, m]
    q_feat, k_feat = q_feat.transpose(1, 2), k_feat.transpose(1, 2)  # [B, H, T, m]
    vals = repeat_kv(v, H).to(acc).transpose(1, 2)  # [B, H, T, Dv]
    out = []
    for start in range(0, T, chunk_size):
        stop = min(start + chunk_size, T)
        qc, kc, vc = q_feat[:, :, start:stop], k_feat[:, :, start:stop], vals[:, :, start:stop]
        intra = (qc @ kc.transpose(-1, -2)).tril()  # [B, H, c, c], j <= i within the chunk
        num = intra @ vc + qc @ S
        if normalize == "linear":
            den = intra.sum(dim=-1) + (qc @ z.unsqueeze(-1)).squeeze(-1)
            num = _safe_div(num, den.unsqueeze(-1))
        elif normalize == "mean":
            positions = torch.arange(start + 1, stop + 1, device=q.device, dtype=acc)
            num = num / (seen[..., None] + positions).unsqueeze(-1)
        out.append(num)
        S = S + kc.transpose(-1, -2) @ vc
        z = z + kc.sum(dim=2)
    return torch.cat(out, dim=2).transpose(1, 2).to(q.dtype), ASAState(S, z)


def asa_decode_step(q, k, v, p_q, p_k, state: ASAState, normalize: str = "linear") -> torch.Tensor:
    """One decode step. q: [B, H, D]; k, v: [B, H_kv, D(v)]; ``state`` is updated in place.

    Returns o: [B, H, Dv] in q.dtype — the same as row T of a full forward over T+1 tokens.
    """
    op = "asa_decode_step"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{op}: {name} must be a tensor of shape [B, H, D] (one token)")
    B, T, H, H_kv, D, m = check_asa_args(op, q[:, None], k[:, None], v[:, None], p_q, p_k,
                                         normalize)
    _check_state(op, state, B, H, m, v.shape[-1], q)
    q_feat, k_feat = asa_feature_maps(q[:, None], k[:, None], p_q, p_k)
    q_feat, k_feat = q_feat[:, 0], k_feat[:, 0]  # [B, H, m]
    S, z = state
    vals = repeat_kv(v[:, None], H)[:, 0].to(S.dtype)  # [B, H, Dv]
    S.add_(k_feat.unsqueeze(-1) * vals.unsqueeze(-2))
    z.add_(k_feat)
    out = (q_feat.unsqueeze(-2) @ S).squeeze(-2)  # [B, H, Dv]
    if normalize == "linear":
        out = _safe_div(out, (q_feat * z).sum(dim=-1, keepdim=True))
    elif normalize == "mean":
        out = out / z.sum(dim=-1, keepdim=True)  # = tokens seen, this one included
    return out.to(q.dtype)


# ------------------------------------------------------------------------------------------
# the op
# ------------------------------------------------------------------------------------------
def _kernel(q, v, p_q, impl: Optional[str]):
    """The Triton implementation, or None when triton (or the kernel package) is missing — or,
    for ``impl=None`` on CUDA, when the sizes are outside the kernel's GPU-verified ones
    (``kernel_verified``: the reference runs instead; ``impl="kernel"`` runs what
    ``kernel_supports`` allows, d_h up to 512, and gets the kernel's own error beyond)."""
    try:
        from megatron_subq.kernels.asa import (  # noqa: PLC0415
            asa_attention_kernel,
            kernel_verified,
        )
    except ImportError:
        return None
    if impl is None and q.is_cuda and not kernel_verified(q.shape[3], p_q.shape[2], v.shape[3]):
        return None
    return asa_attention_kernel


def asa_attention_varlen_reference(q, k, v, p_q, p_k, normalize: str, bounds: list
                                   ) -> torch.Tensor:
    """The reference on packed sequences: every segment ``[bounds[i], bounds[i+1])`` of the
    ``B = 1`` batch is run as its own sequence (fresh state, "mean" counting from its start)."""
    outs = [asa_attention_chunked(q[:, a:b], k[:, a:b], v[:, a:b], p_q, p_k, normalize)[0]
            for a, b in zip(bounds, bounds[1:]) if b > a]
    if not outs:  # T = 0: behave exactly as the op without cu_seqlens
        return asa_attention_chunked(q, k, v, p_q, p_k, normalize)[0]
    return torch.cat(outs, dim=1)


def asa_attention(q, k, v, p_q, p_k, normalize: str = "linear", impl: Optional[str] = None,
                  cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal ASA. q: [B, T, H, D]; k, v: [B, T, H_kv, D] (GQA: H % H_kv == 0); p_q, p_k:
    [H, D, m]. Returns [B, T, H, Dv] in q.dtype.

    ``impl``: "reference" (chunked PyTorch, fp32), "kernel" (Triton; CUDA or TRITON_INTERPRET=1),
    None (the kernel on CUDA when available, else the reference). ``cu_seqlens`` (optional,
    B = 1): variable-length sequences packed along T, ``[0, end_1, ..., T]``; each is an
    independent causal sequence (the state ``(S, z)`` restarts at every boundary and "mean"
    counts from the sequence's start), so no token sees another sequence.
    """
    check_asa_args("asa_attention", q, k, v, p_q, p_k, normalize)
    bounds = None if cu_seqlens is None else check_cu_seqlens("asa_attention", cu_seqlens, q)
    kernel = _kernel(q, v, p_q, impl)
    if choose_impl("asa_attention", impl, (q, k, v, p_q, p_k), kernel) == "kernel":
        if bounds is not None:
            return kernel(q, k, v, p_q, p_k, normalize=normalize, cu_seqlens=cu_seqlens,
                          seq_bounds=bounds)
        return kernel(q, k, v, p_q, p_k, normalize=normalize)
    if bounds is not None:
        return asa_attention_varlen_reference(q, k, v, p_q, p_k, normalize, bounds)
    return asa_attention_chunked(q, k, v, p_q, p_k, normalize)[0]


def asa_chunk_state(q, k, v, p_q, p_k, impl: Optional[str] = None) -> ASAState:
    """``(S, z) = (Σ k'ᵀ v, Σ k')`` of these tokens alone, fp32, differentiable: additive over
    chunks (context parallelism's state passing sums them across ranks). Where ``asa_prefill``
    takes the kernel: its state scan's final state from an empty one (the backward seeds its
    reverse scan with this state's gradient; the output it also writes is dropped, normalize
    "none"); else an fp32 einsum over the key features, which on a GPU runs as FFMA GEMMs (3.5
    of an 8.4 ms state-passing step at 64K tokens, 16 heads x 128, H200, 2026-11-27)."""
    check_asa_args("asa_chunk_state", q, k, v, p_q, p_k, "none")
    kernel = _kernel(q, v, p_q, impl)
    if choose_impl("asa_chunk_state", impl, (q, k, v, p_q, p_k), kernel) == "kernel":
        return kernel(q, k, v, p_q, p_k, normalize="none", initial_state=None,
                      output_final_state=True)[1]
    k_feat = asa_key_features(k, p_k, q.shape[2], accumulation_dtype(q.dtype))
    vals = repeat_kv(v, q.shape[2]).to(k_feat.dtype)
    return ASAState(torch.einsum("bthm,bthd->bhmd", k_feat, vals), k_feat.sum(dim=1))


def asa_prefill(q, k, v, p_q, p_k, normalize: str = "linear", state: Optional[ASAState] = None,
                impl: Optional[str] = None, tokens_before: Optional[int] = None
                ) -> Tuple[torch.Tensor, ASAState]:
    """``asa_attention`` continuing from ``state`` (default: empty) and returning the final state,
    so that prefill chunks and ``asa_decode_step`` continue one another.

    Both implementations differentiate through the state: ``state``'s S and z get their
    gradient and the returned state is differentiable (context parallelism's state passing
    trains through them; the kernel's backward returns the initial state's gradient).
    ``tokens_before`` ("mean"): the count of earlier tokens as a host int (exact, no gradient);
    None: ``Σ_m z`` of ``state``, which is that count up to fp32 rounding."""
    check_asa_args("asa_prefill", q, k, v, p_q, p_k, normalize)
    if tokens_before is not None and state is None:
        raise ValueError("asa_prefill: tokens_before is given without a state")
    kernel = _kernel(q, v, p_q, impl)
    if choose_impl("asa_prefill", impl, (q, k, v, p_q, p_k), kernel) == "kernel":
        return kernel(q, k, v, p_q, p_k, normalize=normalize, initial_state=state,
                      output_final_state=True, tokens_before=tokens_before)
    return asa_attention_chunked(q, k, v, p_q, p_k, normalize, state=state,
                                 tokens_before=tokens_before)
