"""Model FLOPs of one training iteration, per attention variant (for TFLOP/s/GPU and MFU).

Counted like Megatron-LM: a multiply-add is 2 FLOPs, training is 3x the forward (backward = 2x
forward), activation recomputation is not counted (model FLOPs, not hardware FLOPs), norms,
softmax and element-wise work are left out. Per sequence of L tokens (hidden h, H query heads,
G key/value groups, head dim D, FFN width F, padded vocabulary V):

    dense projections   2 L h (H D + 2 G D) + 2 L H D h      (Q, K, V, output)
    MLP                 2 L h F x 3 (SwiGLU) or x 2
    output layer        2 L h V
    core attention      per variant: its ``Variant.core_flops(config, L)``

The per-variant formulas live in each variant's file and are written down in docs/training.md.
A hybrid (``hybrid_override_pattern``) counts its attention slots as above without the MLP, and
its Mamba-2, MLP and MoE layers (active experts only) by ``hybrid/flops.py``.
A variant without one (``core_flops=None``) is counted as standard attention and the trainer says
so once at start-up. A ``fixed_input`` variant adds one pass of its fixed row per micro-batch.
"""

from __future__ import annotations

from ..hybrid.flops import LAYER_FLOPS
from ..variants import VARIANTS, fixed_input_variants
from ..variants.base import causal_pairs
from ..variants.ppa import ppa_pairs
from ..variants.standard import standard_core_flops
from ..variants.superlinear import superlinear_pairs

__all__ = ["causal_pairs", "flops_per_iteration", "forward_flops_per_sequence", "peak_tflops",
           "ppa_pairs", "superlinear_pairs", "unmodelled_variants"]


def _core(name: str):
    variant = VARIANTS.get(name)
    core = variant.core_flops if variant is not None else None
    return core if core is not None else standard_core_flops


def _projections(cfg, L: int) -> float:
    h, H, G, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    return 2.0 * L * h * (H * D + 2 * G * D) + 2.0 * L * H * D * h


def _dense_layer(cfg, L: int) -> float:
    return _projections(cfg, L) + LAYER_FLOPS["-"](cfg, L)


def forward_flops_per_sequence(cfg, seq_length: int, padded_vocab_size: int,
                               micro_batch_size: int = 1) -> float:
    """Forward FLOPs of one sequence through the whole model (all layers, output layer)."""
    L = seq_length
    total = 2.0 * L * cfg.hidden_size * padded_vocab_size
    pattern = getattr(cfg, "hybrid_override_pattern", None)
    if pattern:
        for symbol, name in zip(pattern, cfg.layer_variants):
            total += (_projections(cfg, L) + _core(name)(cfg, L) if symbol == "*"
                      else LAYER_FLOPS[symbol](cfg, L))
        return total
    layers = cfg.layer_variants or [cfg.attention_variant] * cfg.num_layers
    for name in layers:
        total += _dense_layer(cfg, L) + _core(name)(cfg, L)
    if set(layers) & set(fixed_input_variants()):
        # the fixed input (L tokens) runs through the stack once per micro-batch
        total += sum(_dense_layer(cfg, L) + standard_core_flops(cfg, L)
                     for _ in layers) / micro_batch_size
    return total


def unmodelled_variants(cfg) -> list:
    layers = [n for n in cfg.layer_variants if n is not None] or [cfg.attention_variant]
    return sorted({n for n in layers if n not in VARIANTS or VARIANTS[n].core_flops is None})


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
