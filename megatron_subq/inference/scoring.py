"""Whole-sequence scoring of a megatron_subq model: logits and per-token log-probabilities.

The one forward pass that evaluation (lm-evaluation-harness loglikelihoods, NIAH answers) and the
decoding tests compare against. It runs the host model exactly as training does (no inference
context, causal attention over the whole sequence) and gathers the vocabulary shards of TP ranks,
so every rank of a tensor-parallel group returns the same full-vocabulary logits.
"""

from __future__ import annotations

import torch


def _check_tokens(tokens: torch.Tensor, what: str) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(f"{what}: tokens must be a [batch, length] torch.long tensor, got "
                         f"{getattr(tokens, 'dtype', type(tokens).__name__)} "
                         f"{tuple(getattr(tokens, 'shape', ()))}")
    if tokens.numel() == 0:
        raise ValueError(f"{what}: tokens is empty (batch and length must be >= 1)")


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's parameters (where its inputs must live)."""
    return next(model.parameters()).device


@torch.no_grad()
def full_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits [batch, length, padded vocab] of ``tokens`` [batch, length] (torch.long) in one
    causal forward pass of the host model (GPTModel or the hybrid's MambaModel), the TP shards of
    the vocabulary gathered. The model is put in eval mode; it must hold the whole pipeline
    (PP = 1)."""
    _check_tokens(tokens, "full_logits")
    model.eval()
    tokens = tokens.to(model_device(model))
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    logits = model(tokens, positions, None, runtime_gather_output=True)
    return logits.float()


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) for t < length-1: [batch, length-1] fp32, from one
    forward pass (``full_logits``), normalised over the padded vocabulary as the training loss
    is."""
    _check_tokens(tokens, "token_logprobs")
    if tokens.shape[1] < 2:
        raise ValueError("token_logprobs: tokens needs length >= 2 (one context token and one "
                         "scored token)")
    logits = full_logits(model, tokens)[:, :-1]
    targets = tokens[:, 1:].to(logits.device)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
