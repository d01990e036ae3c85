"""Inference on megatron_subq models: loading a checkpoint (``loading.py``) and whole-sequence
scoring (``scoring.py``)."""

from .loading import LoadedModel, load_for_inference, unload
from .scoring import full_logits, model_device, token_logprobs

__all__ = ["LoadedModel", "load_for_inference", "unload", "full_logits", "model_device", "token_logprobs"]
