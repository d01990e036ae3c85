"""Qwen3 dense (per-head q/k RMSNorms: megatron's qk_layernorm) -> the GPT host."""
from .gpt import gpt_family

FAMILY = gpt_family("qwen3", ("Qwen3ForCausalLM",), "qwen3",
                    "Qwen3 dense (q/k RMSNorm per head)", qk_norm=True,
                    max_positions_default=32768)
