"""Qwen2 / Qwen2.5 (biases on q/k/v: megatron's add_qkv_bias) -> the GPT host."""
from .gpt import gpt_family

FAMILY = gpt_family("qwen2", ("Qwen2ForCausalLM",), "qwen2",
                    "Qwen2/Qwen2.5 (q/k/v biases)", qkv_bias=True, max_positions_default=32768)
