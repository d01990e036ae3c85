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
MAMBA_IMPLS = ("auto", "megatron", "pytorch")  # megatron_subq.ssm.MAMBA_MIXER_IMPLS
HYBRID_SYMBOLS = ("M", "*", "-", "E")  # megatron-core 0.16.1 ssm.mamba_hybrid_layer_allocation


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

    subq_fused_norm: bool = False
    """RMSNorm as one Triton kernel per direction (``norm.FusedLocalNorm``, kernels/fused/) in
    place of the local spec's torch norm, in every norm slot of the GPT and hybrid hosts (layer,
    final, q/k norms): the same parameters and math. RMSNorm only; not with the Transformer
    Engine spec (its norm is fused already)."""

    subq_fused_rope: bool = False
    """RoPE as one Triton kernel per direction (kernels/fused/rope.py): sets megatron's
    ``apply_rope_fusion`` and gives its fused-RoPE hook this package's kernel where Transformer
    Engine's is missing (``megatron_subq.rope``); the same math, computed in fp32. Not with
    ``rotary_interleaved`` or multi-latent attention."""

    skip_variant_layers: bool = False
    """Evaluation-time ablation (deconstructing-attention paper): non-standard layers pass their
    input through unchanged. Not a training mode."""

    context_parallel_scheme: Optional[str] = None
    """Under context parallelism, the path of the layers whose variant offers a choice
    (``Variant.state_passing``: asa): None or 'all_to_all' (heads exchanged for sequence, every
    variant's default), 'state_passing' (each rank's chunk states summed across the CP ranks;
    heads stay whole, so no head-count constraint and only states cross ranks)."""

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
    superlinear_decode_graph: bool = False
    """Generation: each superlinear layer's one-token decode step through a
    ``SuperlinearDecodePlan`` (fixed launches, the step's integers in a device buffer), captured
    in a CUDA graph per layer and capacity bucket and replayed (CUDA); on the CPU the plan runs
    uncaptured (``subq_impl='kernel'``: the Triton interpreter) or, with the reference, the eager
    step. Only the attention core's step is captured; the rest of the model stays eager. Off by
    default: every bucket crossed costs a capture (a device sync and a garbage collection), each
    layer keeps a plan's buffers, and the captured step has not yet been measured end to end
    (docs/inference.md). Not with ``subq_impl='reference'``."""

    # ---- deconstructed-attention variants ------------------------------------------------
    mlp_attention_width: Optional[int] = None
    """mlp: inner width f of the gated MLP in the attention slot; None = parameter-matched to
    standard attention, rounded to split over TP (``variants.mlp.matched_width``). Must split
    over TP."""
    fixed_qk_tokens_file: Optional[str] = None
    """fixed_seq_qk: a file of token ids (whitespace-separated, or .npy) of the fixed text."""
    fixed_qk_seed: int = 1234
    """rnd_emb_qk: seed of the fixed random input (drawn once, never trained)."""

    # ---- the hybrid host (megatron's MambaModel: Mamba-2, attention, MLP and MoE layers) ----
    hybrid_override_pattern: Optional[str] = None
    """One symbol per layer: 'M' Mamba-2, '*' attention, '-' MLP, 'E' MoE (megatron's
    ``Symbols``). None: a GPT (every layer attention + MLP). Set: a hybrid, whose '*' slots
    alone take ``attention_variant`` / ``layer_pattern`` (a list then names one variant per
    slot); ``build_hybrid_model`` builds it."""
    mamba_impl: Optional[str] = None
    """The Mamba-2 mixer: 'pytorch' (this package's ``SubqMambaMixer``), 'megatron' (megatron's
    ``MambaMixer`` on mamba_ssm's Triton kernels) or None/'auto' (megatron's where it can run:
    CUDA, mamba_ssm, and causal_conv1d unless ``use_mamba_mem_eff_path`` is False). Both have
    the same parameters and checkpoints (``megatron_subq.ssm.mamba_mixer_class``)."""

    # resolved in __post_init__
    layer_variants: List[Optional[str]] = field(default_factory=list, init=False)
    """The variant of every layer (length num_layers), resolved from the fields above; None at
    a hybrid's layers that are not attention slots."""

    def __post_init__(self):
        self._validate_variant_knobs()
        if self.subq_fused_rope:
            if self.rotary_interleaved or self.multi_latent_attention:
                _fail("subq_fused_rope", True, "False with rotary_interleaved or "
                      "multi_latent_attention (the fused RoPE is megatron's rotate-half form)")
            from .rope import install_fused_rope  # noqa: PLC0415

            install_fused_rope()
            self.apply_rope_fusion = True
        super().__post_init__()
        self._resolve_layers()
        self._validate_cross_field()

    # -------------------------------------------------------------------------------------
    @property
    def superlinear_window(self) -> int:
        """w = floor((sw_index+1)^(1/p)) - 1, computed exactly for p = 1/n."""
        return floor_power(self.superlinear_sw_index + 1, 1 / as_fraction(
            self.superlinear_search_power)) - 1

    @property
    def is_hybrid(self) -> bool:
        """A hybrid stack (``hybrid_override_pattern`` set) rather than a GPT."""
        return self.hybrid_override_pattern is not None

    @property
    def attention_layers(self) -> List[int]:
        """The 1-based numbers of the layers with an attention slot (all layers of a GPT)."""
        return [i + 1 for i, name in enumerate(self.layer_variants) if name is not None]

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
        if self.subq_fused_norm and self.normalization != "RMSNorm":
            _fail("subq_fused_norm", True, "False with normalization="
                  f"{self.normalization!r} (the fused norm is RMSNorm only)")
        if self.mamba_impl is not None and self.mamba_impl not in MAMBA_IMPLS:
            _fail("mamba_impl", self.mamba_impl, f"one of {MAMBA_IMPLS} or None")
        pattern = self.hybrid_override_pattern
        if pattern is not None:
            if not isinstance(pattern, str) or not pattern or set(pattern) - set(HYBRID_SYMBOLS):
                _fail("hybrid_override_pattern", pattern,
                      f"a string of the symbols {''.join(HYBRID_SYMBOLS)} (M Mamba-2, * attention, "
                      "- MLP, E MoE), one per layer")
            if len(pattern) != self.num_layers:
                _fail("hybrid_override_pattern", pattern,
                      f"exactly num_layers={self.num_layers} symbols (it has {len(pattern)})")
            if "E" in pattern and not self.num_moe_experts:
                _fail("num_moe_experts", self.num_moe_experts,
                      "a positive number of experts: hybrid_override_pattern has MoE layers (E)")
            if self.skip_variant_layers:
                _fail("skip_variant_layers", True, "False in a hybrid (a GPT-host ablation)")
            self.is_hybrid_model = True
        # every variant's own knob ranges, used or not: a bad value is wrong in any model
        for variant in VARIANTS.values():
            variant.check_knobs(self)

    def _resolve_layers(self) -> None:
        from .patterns import resolve_layer_variants  # noqa: PLC0415
        from .variants import VARIANTS  # noqa: PLC0415

        self.layer_variants = resolve_layer_variants(
            self.layer_pattern, self.attention_variant, self.num_layers,
            self.hybrid_override_pattern)
        for i, name in enumerate(self.layer_variants):
            if name is not None and name not in VARIANTS:
                _fail(f"layer_pattern[{i}]", name, f"variant names from {sorted(VARIANTS)}")
        host = "hybrid" if self.is_hybrid else "gpt"
        refused = sorted({n for n in self.layer_variants
                          if n is not None and host not in VARIANTS[n].hosts})
        if refused:
            allowed = sorted(n for n, v in VARIANTS.items() if host in v.hosts)
            _fail("attention_variant" if self.attention_variant in refused else "layer_pattern",
                  refused[0] if len(refused) == 1 else refused,
                  f"variants the {host} host takes: {allowed}")
        # megatron's dist_checkpointing stacks identical layers; mixed specs need per-layer keys.
        if len({n for n in self.layer_variants if n is not None}) > 1:
            self.hetereogenous_dist_checkpoint = True

    def _validate_cross_field(self) -> None:
        from .variants import VARIANTS  # noqa: PLC0415

        used = [variant for name, variant in VARIANTS.items() if name in self.layer_variants]
        for variant in used:  # derived defaults first: a validate may read another's
            variant.resolve(self)
        for variant in used:
            variant.validate(self)
        self._validate_context_parallel(used)

    def _validate_mamba_context_parallel(self, cp: int) -> None:
        """The hybrid host's Mamba-2 layers under CP (megatron's head all-to-all, also
        ``SubqMambaMixer``'s): each CP rank scans a share of the TP rank's Mamba heads, and the
        groups split over CP or are replicated."""
        from .hybrid.flops import mamba_dims  # noqa: PLC0415

        tp = self.tensor_model_parallel_size
        nheads, _, ngroups, _, _ = mamba_dims(self)
        heads, groups = nheads // tp, ngroups // tp
        if heads % cp:
            raise ValueError(
                f"context_parallel_size={cp} is invalid with the hybrid host: allowed a divisor of "
                f"the Mamba heads per tensor-parallel rank ({nheads} / tensor_model_parallel_size="
                f"{tp} = {heads}; each CP rank scans a share of them)")
        if groups and groups % cp and cp % groups:
            raise ValueError(
                f"context_parallel_size={cp} is invalid with the hybrid host: allowed a divisor or "
                f"a multiple of the Mamba groups per tensor-parallel rank (mamba_num_groups="
                f"{ngroups} / {tp} = {groups}; groups are split or replicated over CP)")

    def _validate_context_parallel(self, used) -> None:
        """Context parallelism (``context_parallel_size`` > 1) needs a CP path in every variant
        in use (``Variant.context_parallel``), and heads that split over TP x CP (the all-to-all
        path gives each CP rank a share of its TP rank's heads; on the hybrid host the Mamba-2
        heads too)."""
        cp = self.context_parallel_size
        scheme = self.context_parallel_scheme
        if scheme not in (None, "all_to_all", "state_passing"):
            _fail("context_parallel_scheme", scheme, "None, 'all_to_all' or 'state_passing'")
        if scheme == "state_passing" and not any(v.state_passing for v in used):
            from .variants import VARIANTS  # noqa: PLC0415

            _fail("context_parallel_scheme", scheme,
                  "None or 'all_to_all' here: no layer's variant takes state passing (those that "
                  f"do: {sorted(n for n, v in VARIANTS.items() if v.state_passing)})")
        if cp == 1:
            return
        if self.is_hybrid and "M" in (self.hybrid_override_pattern or ""):
            self._validate_mamba_context_parallel(cp)
        refused = sorted(v.name for v in used if v.context_parallel == "none")
        if refused:
            raise ValueError(
                f"context_parallel_size={cp} is invalid with {', '.join(refused)} layers: allowed "
                "1 (these variants have no context-parallel path: sas mixes heads, the Q/K-source "
                "variants carry fixed rows)")
        if any(v.cp_mode(self) == "all_to_all" for v in used):
            heads = self.num_attention_heads // self.tensor_model_parallel_size
            if heads % cp:
                raise ValueError(
                    f"context_parallel_size={cp} is invalid: allowed a divisor of the attention "
                    f"heads per tensor-parallel rank (num_attention_heads="
                    f"{self.num_attention_heads} / tensor_model_parallel_size="
                    f"{self.tensor_model_parallel_size} = {heads}; the all-to-all path splits "
                    "them over CP)")
            groups = (self.num_query_groups or self.num_attention_heads) \
                // self.tensor_model_parallel_size
            if groups % cp and cp % groups:
                raise ValueError(
                    f"context_parallel_size={cp} is invalid with num_query_groups="
                    f"{self.num_query_groups} per tensor-parallel rank {groups}: allowed a "
                    "divisor or a multiple of it (key/value heads are split or replicated over "
                    "CP)")
