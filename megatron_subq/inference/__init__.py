"""Inference on megatron_subq models: whole-sequence scoring (``scoring.py``)."""

from .scoring import full_logits, model_device, token_logprobs

__all__ = ["full_logits", "model_device", "token_logprobs"]
