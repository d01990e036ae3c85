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


def reinit_tensor_parallel(tp: int, seed: int = 1234) -> None:
    """Switch the current world to TP=``tp`` (the rest data-parallel) between two model builds."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: PLC0415

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)


def reshard_tp2_tp1_tp2(cfg_kwargs: dict, ckpt_dir: str) -> dict:
    """In a 2-rank world: save at TP=2, load at TP=1 (DP=2), save another model at TP=1, load it
    at TP=2. Returns the four logits; a test asserts ``loaded_tp1 == saved_tp2`` and
    ``loaded_tp2 == saved_tp1`` (and that the two saved models differ)."""
    reinit_tensor_parallel(2)
    out = {"saved_tp2": checkpoint_roundtrip(cfg_kwargs, os.path.join(ckpt_dir, "tp2"), "save")}
    reinit_tensor_parallel(1)
    out["loaded_tp1"] = checkpoint_roundtrip(cfg_kwargs, os.path.join(ckpt_dir, "tp2"), "load")
    torch.manual_seed(99)  # a different model to save at TP=1
    out["saved_tp1"] = checkpoint_roundtrip(cfg_kwargs, os.path.join(ckpt_dir, "tp1"), "save")
    reinit_tensor_parallel(2)
    out["loaded_tp2"] = checkpoint_roundtrip(cfg_kwargs, os.path.join(ckpt_dir, "tp1"), "load")
    return out


def assert_resharded(ranks: list) -> None:
    """The checks on ``reshard_tp2_tp1_tp2``'s per-rank results."""
    for r in ranks:
        torch.testing.assert_close(r["loaded_tp1"], r["saved_tp2"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["loaded_tp2"], r["saved_tp1"], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(r["saved_tp1"], r["saved_tp2"]), "the two saved models differ"
