"""``SubqTransformerConfig``: megatron-core's ``TransformerConfig`` plus the variant knobs.

One config object flows everywhere (specs, modules, ops, the trainer's flags). Every knob is
validated in ``__post_init__`` so that a wrong value fails with a ``ValueError`` naming the field
and the allowed values, before any parameter is allocated. The exact meaning of every knob is in
``../shared/variants.md``; docs/variants.md says how the code follows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Union

import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig

from .kernels.powers import as_fraction, floor_power

ASA_NORMALIZE_MODES = ("linear", "none", "mean")
SUBQ_IMPLS = ("reference", "kernel")


def _fail(field_name: str, value, allowed: str) -> None:
    raise ValueError(f"{field_name}={value!r} is invalid: allowed {allowed}")


@dataclass
class SubqTransformerConfig(TransformerConfig):
    """A ``TransformerConfig`` that also says which attention variant each layer uses."""

    # ---- Transformer++ defaults (the papers' baseline), overriding megatron's GPT-2 defaults ----
    normalization: str = "RMSNorm"
    gated_linear_unit: bool = True
    activation_func: Callable = F.silu
    add_bias_linear: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    # ---- which variant where ------------------------------------------------------------
    attention_variant: str = "standard"
    """Variant of every layer unless ``layer_pattern`` says otherwise (a name in VARIANTS)."""

    layer_pattern: Optional[Union[str, List[str]]] = None
    """None/'uniform': every layer is ``attention_variant``. A named pattern (see
    ``megatron_subq.patterns.NAMED_PATTERNS``) places ``attention_variant`` on some layers and
    ``standard`` on the rest; a list gives each layer's variant name explicitly."""

    subq_impl: Optional[str] = None
    """Force the ops' implementation: 'reference' (PyTorch), 'kernel' (Triton) or None (kernel
    on CUDA where one exists, else reference)."""

    skip_variant_layers: bool = False
    """Evaluation-time ablation (deconstructing-attention paper): non-standard layers pass their
    input through unchanged. Not a training mode."""

    # ---- asa ----------------------------------------------------------------------------
    asa_rank: Optional[int] = None
    """m: the feature dimension of ASA's per-head projections P_Q, P_K (d_h x m), m < d_h
    (default min(64, kv_channels // 2): the benchmarks' m = 64 at d_h = 128, and valid for small
    heads too)."""
    asa_normalize: str = "linear"
    """'linear' (weights over j sum to 1), 'none' (the paper's literal product), 'mean' (/(i+1))."""

    # ---- ppa ----------------------------------------------------------------------------
    ppa_power: float = 0.5
    """p in [0, 1]: offsets j with floor(j^p) - floor((j-1)^p) = 1 are attended."""
    ppa_window: int = 64
    """w >= 0: the dense local window (offsets 0..w are always attended)."""

    # ---- sas ----------------------------------------------------------------------------
    sas_heads: Optional[int] = None
    """H-hat, the simulated head count, a multiple of num_attention_heads (default 3*H)."""
    sas_head_dim: Optional[int] = None
    """D-hat, the simulated q/k feature size (default 1.5*kv_channels, rounded up to even)."""
    sas_kernel: int = 1
    """Odd Conv1d kernel size of the head convolutions (1 = an MLP over heads)."""

    # ---- superlinear --------------------------------------------------------------------
    superlinear_search_power: float = 0.5
    """p: anchors sit at i - floor((s+1)^(1/p)) + 1."""
    superlinear_span_power: float = 0.5
    """p_sp: span length scale l(i) = ceil(i^p_sp)."""
    superlinear_topk: int = 2
    """Anchors kept per query."""
    superlinear_backward_factor: float = 2.0
    """b: a span reaches ceil(b*l(i)) keys back from its anchor."""
    superlinear_forward_factor: float = 0.0
    """f: a span reaches ceil(f*l(i)) keys forward from its anchor (clipped at i)."""
    superlinear_sw_index: int = 32
    """Window index: window length w = floor((sw_index+1)^(1/p)) - 1 (32 -> 1088 at p=1/2)."""
    superlinear_allow_no_random_access: bool = False
    """Opt out of the random-context-access check (p + p_sp >= 1 and b >= 1/p)."""

    # ---- deconstructed-attention variants ------------------------------------------------
    mlp_attention_width: Optional[int] = None
    """mlp: inner width f of the gated MLP in the attention slot; None = parameter-matched to
    standard attention (see ``variants.mlp.matched_width``). Must split over TP."""
    fixed_qk_tokens_file: Optional[str] = None
    """fixed_seq_qk: a file of token ids (whitespace-separated, or .npy) of the fixed text."""
    fixed_qk_seed: int = 1234
    """rnd_emb_qk: seed of the fixed random input (drawn once, never trained)."""

    # resolved in __post_init__
    layer_variants: List[str] = field(default_factory=list, init=False)
    """The variant of every layer (length num_layers), resolved from the two fields above."""

    def __post_init__(self):
        self._validate_variant_knobs()
        super().__post_init__()
        self._resolve_layers()
        self._validate_cross_field()

    # -------------------------------------------------------------------------------------
    @property
    def superlinear_window(self) -> int:
        """w = floor((sw_index+1)^(1/p)) - 1, computed exactly for p = 1/n."""
        return floor_power(self.superlinear_sw_index + 1, 1 / as_fraction(
            self.superlinear_search_power)) - 1

    def _validate_variant_knobs(self) -> None:
        from .variants import VARIANTS  # noqa: PLC0415 (the registry imports modules using us)

        names = sorted(VARIANTS)
        if self.attention_variant not in VARIANTS:
            _fail("attention_variant", self.attention_variant, f"one of {names}")
        if self.subq_impl is not None and self.subq_impl not in SUBQ_IMPLS:
            _fail("subq_impl", self.subq_impl, f"one of {SUBQ_IMPLS} or None")
        if self.asa_rank is not None and (not isinstance(self.asa_rank, int) or self.asa_rank < 1):
            _fail("asa_rank", self.asa_rank, "a positive integer m < kv_channels")
        w = self.mlp_attention_width
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            _fail("mlp_attention_width", w, "None or a positive integer")
        if self.asa_normalize not in ASA_NORMALIZE_MODES:
            _fail("asa_normalize", self.asa_normalize, f"one of {ASA_NORMALIZE_MODES}")
        if not (isinstance(self.ppa_power, (int, float)) and 0.0 <= self.ppa_power <= 1.0):
            _fail("ppa_power", self.ppa_power, "a number in [0, 1]")
        if not isinstance(self.ppa_window, int) or self.ppa_window < 0:
            _fail("ppa_window", self.ppa_window, "an integer >= 0")
        if not isinstance(self.sas_kernel, int) or self.sas_kernel < 1 or self.sas_kernel % 2 == 0:
            _fail("sas_kernel", self.sas_kernel, "an odd positive integer (1, 3, 5, ...)")
        sp, ssp = self.superlinear_search_power, self.superlinear_span_power
        if not (isinstance(sp, (int, float)) and 0.0 < sp <= 1.0):
            _fail("superlinear_search_power", sp, "a number in (0, 1]")
        if not (isinstance(ssp, (int, float)) and 0.0 <= ssp <= 1.0):
            _fail("superlinear_span_power", ssp, "a number in [0, 1]")
        if not isinstance(self.superlinear_topk, int) or self.superlinear_topk < 1:
            _fail("superlinear_topk", self.superlinear_topk, "an integer >= 1")
        if self.superlinear_backward_factor < 0:
            _fail("superlinear_backward_factor", self.superlinear_backward_factor, "a number >= 0")
        if self.superlinear_forward_factor < 0:
            _fail("superlinear_forward_factor", self.superlinear_forward_factor, "a number >= 0")
        if not isinstance(self.superlinear_sw_index, int) or self.superlinear_sw_index < 0:
            _fail("superlinear_sw_index", self.superlinear_sw_index, "an integer >= 0")
        if not self.superlinear_allow_no_random_access:
            if sp + ssp < 1.0 - 1e-12:
                raise ValueError(
                    f"superlinear_search_power={sp} + superlinear_span_power={ssp} < 1 breaks random "
                    "context access (some keys fall in no span); allowed: search_power + span_power "
                    ">= 1, or set superlinear_allow_no_random_access=True")
            if self.superlinear_backward_factor < 1.0 / sp - 1e-12:
                raise ValueError(
                    f"superlinear_backward_factor={self.superlinear_backward_factor} < "
                    f"1/superlinear_search_power={1.0 / sp:g} breaks random context access; allowed: "
                    "backward_factor >= 1/search_power, or set superlinear_allow_no_random_access=True")

    def _resolve_layers(self) -> None:
        from .patterns import resolve_layer_pattern  # noqa: PLC0415
        from .variants import VARIANTS  # noqa: PLC0415

        self.layer_variants = resolve_layer_pattern(
            self.layer_pattern, self.attention_variant, self.num_layers)
        for i, name in enumerate(self.layer_variants):
            if name not in VARIANTS:
                _fail(f"layer_pattern[{i}]", name, f"variant names from {sorted(VARIANTS)}")
        # megatron's dist_checkpointing stacks identical layers; mixed specs need per-layer keys.
        if len(set(self.layer_variants)) > 1:
            self.hetereogenous_dist_checkpoint = True

    def _validate_cross_field(self) -> None:
        from .variants import VARIANTS  # noqa: PLC0415

        H, D, tp = self.num_attention_heads, self.kv_channels, self.tensor_model_parallel_size
        used = set(self.layer_variants)
        if "asa" in used and self.asa_rank is None:
            self.asa_rank = max(1, min(64, D // 2))
        if "asa" in used and not self.asa_rank < D:
            _fail("asa_rank", self.asa_rank, f"an integer in [1, kv_channels={D})")
        if "sas" in used:
            if self.sas_heads is None:
                self.sas_heads = 3 * H
            if self.sas_head_dim is None:
                self.sas_head_dim = 2 * math.ceil(0.75 * D)
            if not isinstance(self.sas_heads, int) or self.sas_heads < H or self.sas_heads % H:
                _fail("sas_heads", self.sas_heads,
                      f"a positive multiple of num_attention_heads={H}")
            if not isinstance(self.sas_head_dim, int) or self.sas_head_dim < 1:
                _fail("sas_head_dim", self.sas_head_dim, "a positive integer")
            if self.sas_heads % tp:
                _fail("sas_heads", self.sas_heads,
                      f"a multiple of tensor_model_parallel_size={tp}")
        for name in used:
            VARIANTS[name].validate(self)
