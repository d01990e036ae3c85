"""Llama (1, 2, 3.x, incl. llama3 RoPE scaling) -> the GPT host."""
from .gpt import gpt_family

FAMILY = gpt_family("llama", ("LlamaForCausalLM",), "llama",
                    "Llama 1/2/3.x (GQA, llama3 RoPE scaling, tied or untied embeddings)",
                    max_positions_default=2048)
