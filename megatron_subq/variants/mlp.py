"""mlp: the attention block becomes a gated SiLU MLP, ``FC_dn(SiLU(FC_gt(h)) * FC_up(h))``.

No token mixing at all (deconstructing-attention Eq. 4-5): every position is transformed on its
own. The module is megatron's ``MLP`` (so TP and SP are megatron's: ``linear_fc1`` = [FC_gt; FC_up]
column-parallel, fused so that SP all-gathers the input once, stride 2 so that checkpoints reshard
across TP sizes; ``linear_fc2`` = FC_dn row-parallel) with

* a width of its own, ``f`` = ``config.mlp_attention_width`` or, by default, the width whose
  parameter count matches the standard attention layer (``matched_width``), and
* gated SiLU forced, whatever the config says about the layer's FFN (``gated_linear_unit``,
  ``activation_func``, GLU offset/clamp).

It sits in the layer's ``self_attention`` slot, so it takes the attention call signature
``(hidden_states, attention_mask, **kwargs)`` and returns ``(output, bias)``; masks, RoPE and the
inference context are irrelevant to it and ignored.

Parameter matching. Standard attention (no biases) holds ``d (H d_h + 2 g d_h) + H d_h d``
weights (fused QKV + output; g = query groups), the gated MLP ``3 d f``. ``matched_width`` takes
``f* = P_attn / (3 d)`` (bias terms included when ``add_bias_linear``) and rounds it to the nearest
multiple of 8 when that stays within 0.5% of the attention count and splits over the TP size (so
the same width serves TP = 1, 2, 4, 8), else to the nearest multiple of the TP size (at least the
TP size; at TP = 1 the nearest integer). The default can then depend on the TP size, so a
checkpoint compares the resolved width (``derived_knobs``). E.g. the paper's 500M model
(d = 896, 14 heads, MHA): attention 3,211,264, f = 1192, MLP 3,204,096 (-0.22%).
"""

from __future__ import annotations

import copy

import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from ..parallel import process_groups
from .base import Variant, knob_error

MATCH_TOLERANCE = 0.005
WIDTH_MULTIPLE = 8


def standard_attention_param_count(config) -> int:
    """Parameters of the standard variant's attention block (fused QKV + output projection)."""
    d, H, d_h = config.hidden_size, config.num_attention_heads, config.kv_channels
    g = config.num_query_groups or H
    qkv_out = (H + 2 * g) * d_h
    count = d * qkv_out + H * d_h * d
    if config.add_bias_linear:
        count += qkv_out + d
    return count


def gated_mlp_param_count(config, width: int) -> int:
    """Parameters of the mlp variant's block at inner width ``width`` (fc1 = 2 x width, fc2)."""
    d = config.hidden_size
    count = 3 * d * width
    if config.add_bias_linear:
        count += 2 * width + d
    return count


def matched_width(config) -> int:
    """The inner width whose parameter count matches standard attention, split over
    ``config.tensor_model_parallel_size`` (see the module doc)."""
    d, bias = config.hidden_size, int(bool(config.add_bias_linear))
    tp = config.tensor_model_parallel_size
    target = standard_attention_param_count(config)
    exact = (target - bias * d) / (3 * d + 2 * bias)
    coarse = max(WIDTH_MULTIPLE, WIDTH_MULTIPLE * round(exact / WIDTH_MULTIPLE))
    if coarse % tp == 0 and \
            abs(gated_mlp_param_count(config, coarse) - target) <= MATCH_TOLERANCE * target:
        return coarse
    return max(tp, tp * round(exact / tp))


def mlp_width(config) -> int:
    """The width in use: ``config.mlp_attention_width`` or the parameter-matched one."""
    if config.mlp_attention_width is not None:
        return config.mlp_attention_width
    return matched_width(config)


class GatedMLPAttention(MLP):
    """``FC_dn(SiLU(FC_gt(h)) * FC_up(h))`` in the attention slot.

    [s, b, d] -> ([s, b, d], bias); ``linear_fc1`` = [FC_gt; FC_up], ``linear_fc2`` = FC_dn."""

    def __init__(self, config, submodules: MLPSubmodules, layer_number: int = 1,
                 pg_collection=None, **_attention_kwargs):
        width = mlp_width(config)
        # megatron's MLP reads its width and activation from the config (fc2's input size is
        # config.ffn_hidden_size): give it a shallow copy that describes this block.
        block_config = copy.copy(config)
        block_config.ffn_hidden_size = width
        block_config.gated_linear_unit = True
        block_config.activation_func = F.silu
        block_config.use_te_activation_func = False
        block_config.glu_linear_offset = 0.0
        block_config.activation_func_clamp_value = None
        super().__init__(block_config, submodules, ffn_hidden_size=width,
                         tp_group=process_groups(pg_collection).tp)
        self.layer_number = layer_number
        self.width = width

    def forward(self, hidden_states, attention_mask=None, **_attention_kwargs):
        return super().forward(hidden_states)


def attention_spec(config, layer_number: int, provider) -> ModuleSpec:
    return ModuleSpec(module=GatedMLPAttention, submodules=MLPSubmodules(
        linear_fc1=provider.column_parallel_linear(), linear_fc2=provider.row_parallel_linear()))


def check_knobs(config) -> None:
    """Type of mlp_attention_width (whether or not a layer uses mlp)."""
    w = config.mlp_attention_width
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
        knob_error("mlp_attention_width", w, "None or a positive integer")


def validate(config) -> None:
    width, tp = mlp_width(config), config.tensor_model_parallel_size
    if width % tp:
        field = "mlp_attention_width" if config.mlp_attention_width is not None else (
            "mlp_attention_width (default: parameter-matched)")
        raise ValueError(f"{field}={width} is invalid: allowed a multiple of "
                         f"tensor_model_parallel_size={tp}; set mlp_attention_width explicitly")


def derived_knobs(values) -> dict:
    """The width in use, for the checkpoint's model identity: the parameter-matched default
    depends on the TP size, so a checkpoint is compared by the width it holds."""
    return {"mlp_attention_width": mlp_width(values)}


def core_flops(config, L: int) -> float:
    return 0.0  # a gated MLP in the attention slot, parameter-matched: its FLOPs are "dense"


VARIANT = Variant(
    name="mlp",
    summary="gated SiLU MLP in the attention slot, parameter-matched, no token mixing",
    attention_spec=attention_spec,
    validate=validate,
    packed_sequences=True,  # no token mixing: documents cannot meet
    knobs=("mlp_attention_",),
    check_knobs=check_knobs,
    derived_knobs=derived_knobs,
    core_flops=core_flops,
    context_parallel="all_to_all",
    decode_cache="stateless",
)
