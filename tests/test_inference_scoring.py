"""Loading a trained checkpoint for inference and scoring it: the log-probabilities equal the
trainer's own loss on the same tokens."""

import os

import pytest
import torch

from megatron_subq.inference import full_logits, load_for_inference, token_logprobs, unload
from megatron_subq.training import pretrain

VOCAB = 96


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("scoring") / "ckpt")
    pretrain(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--attention-variant", "asa", "--seq-length", "16", "--max-position-embeddings",
              "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2",
              "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
              str(VOCAB - 1), "--eval-iters", "0", "--num-workers", "0", "--save", save,
              "--save-interval", "2"])
    return save


def test_logprobs_equal_model_loss(tiny_checkpoint):
    loaded = load_for_inference(tiny_checkpoint)
    try:
        assert loaded.iteration == 2 and loaded.tokenizer.vocab_size == VOCAB
        tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
        lp = token_logprobs(loaded.model, tokens)
        pos = torch.arange(11).unsqueeze(0).expand(2, 11)
        with torch.no_grad():
            loss = loaded.model(tokens[:, :-1], pos, None, labels=tokens[:, 1:])
        torch.testing.assert_close(-lp, loss.float(), atol=1e-5, rtol=1e-5)
        assert full_logits(loaded.model, tokens).shape[:2] == (2, 12)
    finally:
        unload(loaded)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="load="):
        load_for_inference(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="tensor_model_parallel_size"):
        load_for_inference(str(tmp_path), tensor_model_parallel_size=0)
    with pytest.raises(ValueError, match="torch.long"):
        token_logprobs(torch.nn.Linear(2, 2), torch.zeros(2, 3))
