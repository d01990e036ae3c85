"""Inference on megatron_subq models: loading a checkpoint (``loading.py``), whole-sequence
scoring (``scoring.py``) and decoding with each variant's own cache (``generate.py``)."""

from .generate import DecodeSession, check_decodable, generate, sample_tokens
from .loading import LoadedModel, load_for_inference, unload
from .scoring import full_logits, model_device, token_logprobs

__all__ = ["LoadedModel", "load_for_inference", "unload", "full_logits", "model_device",
           "token_logprobs", "DecodeSession", "check_decodable", "generate", "sample_tokens"]
