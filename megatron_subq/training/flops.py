"""Model FLOPs of one training iteration, per attention variant (for TFLOP/s/GPU and MFU).

Counted like Megatron-LM: a multiply-add is 2 FLOPs, training is 3x the forward (backward = 2x
forward), activation recomputation is not counted (model FLOPs, not hardware FLOPs), norms,
softmax and element-wise work are left out. Per sequence of L tokens (hidden h, H query heads,
G key/value groups, head dim D, FFN width F, padded vocabulary V):

    dense projections   2 L h (H D + 2 G D) + 2 L H D h      (Q, K, V, output)
    MLP                 2 L h F x 3 (SwiGLU) or x 2
    output layer        2 L h V
    core attention      per variant, below (``CORE_FLOPS``)

The per-variant formulas are written down in docs/training.md. A variant without a formula here
is counted as standard attention and the trainer says so once at start-up.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Tuple

import numpy as np


def causal_pairs(L: int) -> int:
    """(query, key) pairs of full causal attention: L(L+1)/2."""
    return L * (L + 1) // 2


def _standard_core(cfg, L: int) -> float:
    # QK^T and PV over the causal pairs, every head
    return 4.0 * causal_pairs(L) * cfg.num_attention_heads * cfg.kv_channels


def ppa_pairs(L: int, power: float, window: int) -> int:
    """Pairs attended by PPA: the dense window (offsets 0..w) plus offsets j > w in S_p."""
    from ..ops.ppa import ppa_offsets  # noqa: PLC0415

    dense = int(np.minimum(np.arange(L), window).sum()) + L
    # queries i >= j see key i - j through offset j
    sparse = sum(L - j for j in ppa_offsets(power, L - 1) if j > window) if L > 1 else 0
    return dense + sparse


def _ppa_core(cfg, L: int) -> float:
    pairs = ppa_pairs(L, cfg.ppa_power, cfg.ppa_window)
    return 4.0 * pairs * cfg.num_attention_heads * cfg.kv_channels


def _asa_core(cfg, L: int) -> float:
    # feature maps q P_Q, k P_K (D -> m), state k'^T v accumulation and readout q' S (m x D),
    # plus the normaliser q' . sum k' (m)
    H, D, m = cfg.num_attention_heads, cfg.kv_channels, cfg.asa_rank
    return L * H * (2 * 2 * D * m + 2 * 2 * m * D + 2 * 2 * m)


def _sas_core(cfg, L: int) -> float:
    H, D = cfg.num_attention_heads, cfg.kv_channels
    Hh = cfg.sas_heads or 3 * H
    Dh = cfg.sas_head_dim or 2 * math.ceil(0.75 * D)
    k = cfg.sas_kernel
    per_token = (3 * 2 * Hh * H * k * D      # Conv_{H->Hh} on q, k, v (a kernel of k along D)
                 + 3 * 2 * Hh * Hh * k * D   # RCNN's Conv_{Hh->Hh} on q, k, v
                 + 2 * 2 * Hh * D * Dh       # Lin_{D->Dh} on q, k
                 + 2 * 2 * Hh * Dh * Dh)     # RMLP's Lin_{Dh->Dh} on q, k
    core = 2.0 * causal_pairs(L) * Hh * (Dh + D)  # QK^T over Dh, PV over D
    return L * per_token + core


def superlinear_pairs(cfg, L: int) -> Tuple[float, float]:
    """(search score evaluations, attended keys) summed over queries, per head.

    Anchors of query i: floor((i+1)^p) candidates minus the floor(w^p) inside the window; top-k
    kept; each kept anchor attends span U window (span ceil(b l) + 1 + ceil(f l), l = ceil(i^p_sp)),
    the union counted as the sum capped at i+1; no anchor -> the window alone."""
    p, psp = cfg.superlinear_search_power, cfg.superlinear_span_power
    b, f, topk = (cfg.superlinear_backward_factor, cfg.superlinear_forward_factor,
                  cfg.superlinear_topk)
    w = cfg.superlinear_window
    i = np.arange(L, dtype=np.float64)
    window = np.minimum(i + 1, w)
    inside = math.floor(w ** p + 1e-9) if w > 0 else 0
    candidates = np.where(i + 1 > w, np.maximum(np.floor((i + 1) ** p + 1e-9) - inside, 0), 0)
    kept = np.minimum(candidates, topk)
    ell = np.ceil(i ** psp)
    span = np.ceil(b * ell) + 1 + np.ceil(f * ell)
    keys = np.where(kept > 0, kept * np.minimum(i + 1, span + window), window)
    return float(candidates.sum()), float(keys.sum())


def _superlinear_core(cfg, L: int) -> float:
    H, D = cfg.num_attention_heads, cfg.kv_channels
    scores, keys = superlinear_pairs(cfg, L)
    search_projection = 2.0 * L * cfg.hidden_size * H * D  # Q_s: hidden -> H*D (linear_qs)
    return search_projection + 2.0 * scores * H * D + 4.0 * keys * H * D


def _mlp_core(cfg, L: int) -> float:
    return 0.0  # a gated MLP in the attention slot, parameter-matched: its FLOPs are "dense"


def _approx_core(cfg, L: int) -> float:
    # mean of v, plus two normalised linear attentions (identity and squared features, dim D):
    # state k (x) v (D x D) and readout per token, and their normalisers
    H, D = cfg.num_attention_heads, cfg.kv_channels
    return L * H * (D + 2 * (2 * D * D + 2 * D * D + 2 * 2 * D))


def _nonapprox_core(cfg, L: int) -> float:
    # one score per token and head (SiLU(q) . k), then a running weighted sum of v
    H, D = cfg.num_attention_heads, cfg.kv_channels
    return L * H * (2 * D + 2 * D)


CORE_FLOPS: Dict[str, Callable] = {
    "standard": _standard_core,
    "static_emb_qk": _standard_core,  # Q, K from the token embeddings: same shapes and work
    "rnd_emb_qk": _standard_core,     # + the fixed input's pass, see fixed_input_extra
    "fixed_seq_qk": _standard_core,
    "ppa": _ppa_core,
    "asa": _asa_core,
    "sas": _sas_core,
    "superlinear": _superlinear_core,
    "mlp": _mlp_core,
    "approx": _approx_core,
    "nonapprox": _nonapprox_core,
}
FIXED_INPUT_VARIANTS = ("rnd_emb_qk", "fixed_seq_qk")


def _dense_layer(cfg, L: int) -> float:
    h, H, G, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    projections = 2.0 * L * h * (H * D + 2 * G * D) + 2.0 * L * H * D * h
    mlp = 2.0 * L * h * cfg.ffn_hidden_size * (3 if cfg.gated_linear_unit else 2)
    return projections + mlp


def forward_flops_per_sequence(cfg, seq_length: int, padded_vocab_size: int,
                               micro_batch_size: int = 1) -> float:
    """Forward FLOPs of one sequence through the whole model (all layers, output layer)."""
    L = seq_length
    total = 2.0 * L * cfg.hidden_size * padded_vocab_size
    layers = cfg.layer_variants or [cfg.attention_variant] * cfg.num_layers
    for name in layers:
        core = CORE_FLOPS.get(name, _standard_core)
        total += _dense_layer(cfg, L) + core(cfg, L)
    if any(name in FIXED_INPUT_VARIANTS for name in layers):
        # the fixed input (L tokens) runs through the stack once per micro-batch
        total += sum(_dense_layer(cfg, L) + _standard_core(cfg, L)
                     for _ in layers) / micro_batch_size
    return total


def unmodelled_variants(cfg) -> list:
    layers = cfg.layer_variants or [cfg.attention_variant]
    return sorted({n for n in layers if n not in CORE_FLOPS})


def flops_per_iteration(cfg, seq_length: int, padded_vocab_size: int, global_batch_size: int,
                        micro_batch_size: int = 1) -> float:
    """Model FLOPs of one training iteration (forward + backward = 3x forward)."""
    return 3.0 * global_batch_size * forward_flops_per_sequence(
        cfg, seq_length, padded_vocab_size, micro_batch_size)


# bf16 dense peak TFLOP/s of one accelerator, by device-name fragment
PEAK_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("GH200", 989.0), ("A100", 312.0),
               ("A800", 312.0), ("L40S", 362.0), ("B200", 2250.0), ("B100", 1750.0))


def peak_tflops(device_name: str):
    for fragment, peak in PEAK_TFLOPS:
        if fragment in device_name:
            return peak
    return None
