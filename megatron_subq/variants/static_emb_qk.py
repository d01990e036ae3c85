"""static_emb_qk (deconstructing-attention §3.5, "StaticEmbQK"): Q, K from the token embeddings.

At a static_emb_qk layer, Q and K come from the sample's input token embeddings ``e`` (the
embedding output before layer 1, through this layer's own input norm and Q/K projection), V from
the layer's input. The map is input dependent but not contextualised. ``e`` reaches every such
layer as extra batch rows of the hidden states (``megatron_subq.model``), so it also crosses
pipeline stages and is sequence-sharded under SP like the hidden states. The core is the
spec provider's causal softmax attention (SDPA / TE).
"""

from __future__ import annotations

from .base import Variant
from .qk_source import qk_source_attention_spec, validate_qk_source_config
from .standard import standard_core_flops


def attention_spec(config, layer_number: int, provider):
    return qk_source_attention_spec(provider.core_attention(), provider)


def validate(config) -> None:
    validate_qk_source_config(config, "static_emb_qk")


VARIANT = Variant(
    name="static_emb_qk",
    summary="Q, K from the input token embeddings (before layer 1); V from the layer's input",
    attention_spec=attention_spec,
    validate=validate,
    core_flops=standard_core_flops,  # Q, K from the token embeddings: same shapes and work
    qk_from_embeddings=True,
    hosts=("gpt",),  # the embedding rows ride the batch dimension like the fixed rows
)
