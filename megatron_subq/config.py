"""``SubqTransformerConfig``: megatron-core's ``TransformerConfig`` plus the variant knobs.

One config object flows everywhere (specs, modules, ops, the trainer's flags). Every knob is
validated in ``__post_init__`` so that a wrong value fails with a ``ValueError`` naming the field
and the allowed values, before any parameter is allocated. The knobs are fields here (megatron
builds from one config object), but each variant owns their checks and derived defaults
(``Variant.check_knobs`` / ``resolve`` / ``validate`` in variants/<name>.py); this module checks
what belongs to no variant (``attention_variant``, ``layer_pattern``, ``subq_impl``). The exact
meaning of every knob is in ``../shared/variants.md``; docs/variants.md says how the code
follows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Union

import torch.nn.functional as F

from megatron.core.transformer.transformer_config import TransformerConfig

from .kernels.powers import as_fraction, floor_power
from .ops.asa import ASA_NORMALIZE_MODES  # noqa: F401 (re-exported: the asa_normalize values)

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
    standard attention, rounded to split over TP (``variants.mlp.matched_width``). Must split
    over TP."""
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

    def layer_variant(self, layer_number: int):
        """The registry's ``Variant`` of global layer ``layer_number`` (1-based): how modules
        ask a layer's capabilities without importing the registry."""
        from .variants import VARIANTS  # noqa: PLC0415 (the registry imports modules using us)

        return VARIANTS[self.layer_variants[layer_number - 1]]

    def _validate_variant_knobs(self) -> None:
        from .variants import VARIANTS  # noqa: PLC0415 (the registry imports modules using us)

        names = sorted(VARIANTS)
        if self.attention_variant not in VARIANTS:
            _fail("attention_variant", self.attention_variant, f"one of {names}")
        if self.subq_impl is not None and self.subq_impl not in SUBQ_IMPLS:
            _fail("subq_impl", self.subq_impl, f"one of {SUBQ_IMPLS} or None")
        # every variant's own knob ranges, used or not: a bad value is wrong in any model
        for variant in VARIANTS.values():
            variant.check_knobs(self)

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

        used = [variant for name, variant in VARIANTS.items() if name in self.layer_variants]
        for variant in used:  # derived defaults first: a validate may read another's
            variant.resolve(self)
        for variant in used:
            variant.validate(self)
