"""Mistral (without a sliding window shorter than the context) -> the GPT host."""
from .gpt import gpt_family

FAMILY = gpt_family("mistral", ("MistralForCausalLM",), "mistral",
                    "Mistral (sliding_window null or >= max_position_embeddings)",
                    max_positions_default=131072)
