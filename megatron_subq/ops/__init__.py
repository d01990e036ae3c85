"""Functional attention ops, one per variant, all in the ``[B, T, H, D]`` layout of flash-attn / fla.

Each op takes ``impl="reference" | "kernel" | None`` (see ``dispatch.choose_impl``). The reference
is plain PyTorch written to be read beside the paper; kernels live in ``megatron_subq.kernels``.
"""

from .approx import (ApproxState, approx_attention, approx_decode_step, approx_empty_state,
                     approx_prefill)
from .asa import ASAState, asa_attention, asa_decode_step, asa_empty_state, asa_prefill
from .dispatch import IMPLS, choose_impl, repeat_kv
from .nonapprox import (NonapproxState, nonapprox_attention, nonapprox_decode_step,
                        nonapprox_empty_state, nonapprox_prefill)
from .ppa import ppa_attention, ppa_offsets, ppa_prefill
from .sas import SASBranchWeights, peaa, sas_attention, sas_simulated_attention
from .shared_map import shared_map_attention
from .standard import standard_attention, standard_prefill
from .superlinear import (superlinear_anchors, superlinear_attention, superlinear_decode_cost,
                          superlinear_decode_step, superlinear_prefill)

__all__ = ["ApproxState", "approx_attention", "approx_decode_step", "approx_empty_state",
           "approx_prefill", "NonapproxState", "nonapprox_attention", "nonapprox_decode_step",
           "nonapprox_empty_state", "nonapprox_prefill",
           "ASAState", "asa_attention", "asa_decode_step", "asa_empty_state", "asa_prefill",
           "IMPLS", "choose_impl", "repeat_kv", "ppa_attention", "ppa_offsets", "ppa_prefill",
           "SASBranchWeights", "peaa", "sas_attention",
           "sas_simulated_attention", "shared_map_attention", "standard_attention",
           "standard_prefill",
           "superlinear_anchors", "superlinear_attention", "superlinear_decode_cost",
           "superlinear_decode_step", "superlinear_prefill"]
