"""dist_checkpointing round trips for tests: save a tiny GPT at one TP/PP size, load at another.

``checkpoint_roundtrip(cfg_kwargs, ckpt_dir, "save")`` builds the tiny GPT of
``testing.equivalence`` under the current parallel state, saves it with megatron's
``dist_checkpointing`` (torch_dist) and returns its full logits on a fixed batch;
``"load"`` builds the same architecture with *different* weights, loads the checkpoint into it and
returns its logits. Equal logits across TP sizes prove that every parameter is declared with the
right sharding in ``sharded_state_dict``.
"""

from __future__ import annotations

import os

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from ..config import SubqTransformerConfig
from ..specs import build_gpt_model
from .equivalence import TINY, make_batch


def checkpoint_roundtrip(cfg_kwargs: dict, ckpt_dir: str, action: str, vocab: int = 128,
                         seq: int = 16) -> torch.Tensor:
    if action not in ("save", "load"):
        raise ValueError(f"action={action!r}; allowed 'save' or 'load'")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = SubqTransformerConfig(**{**TINY, **cfg_kwargs, "tensor_model_parallel_size": tp})
    model = build_gpt_model(config, vocab_size=vocab, max_sequence_length=seq)
    if action == "save":
        os.makedirs(ckpt_dir, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        with torch.no_grad():  # make sure loading really replaces every weight
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint mismatch: missing={missing} unexpected={unexpected}")
    tokens, _, pos = make_batch(vocab, 2, seq, seed=0)
    with torch.no_grad():
        logits = model(tokens, pos, None)
        return gather_from_tensor_model_parallel_region(logits)
