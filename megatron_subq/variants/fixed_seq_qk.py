"""fixed_seq_qk (deconstructing-attention §3.4, "FixedSeqQK"): Q, K from a fixed text.

As rnd_emb_qk, but the fixed input is the embedding of a fixed token sequence (the paper: the
first 2048 tokens of FineWeb-10BT) read from ``fixed_qk_tokens_file``. Its embedding goes through
the model's own (trained) embedding table and then through the same layers; one attention map
for the whole batch.

Token file format (``load_fixed_tokens``):

* ``*.npy``: a 1-D integer NumPy array of token ids;
* anything else: UTF-8 text of token ids as decimal integers separated by whitespace (spaces,
  newlines), e.g. one line ``15496 11 995 ...``.

Ids must be >= 0 (checked with the config) and < vocab_size (checked when the model is built).
Length: the text must be at least ``max_sequence_length`` long (checked at build). A sequence of
length L < text length uses the first L tokens — exactly what running the whole text would give at
positions < L, since every layer is causal.
"""

from __future__ import annotations

import os

import torch

from .base import Variant
from .qk_source import SharedMapCoreAttention, qk_source_attention_spec, validate_qk_source_config
from .standard import standard_core_flops

_FIELD = "fixed_qk_tokens_file"


def load_fixed_tokens(path) -> torch.Tensor:
    """The token ids of ``path`` as a 1-D int64 tensor; ValueError naming the field otherwise."""
    if path is None:
        raise ValueError(f"{_FIELD}=None is invalid with fixed_seq_qk layers: allowed the path "
                         "of a token-id file (.npy 1-D integer array, or whitespace-separated "
                         "integers)")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{_FIELD}={path!r} is invalid: no such file; allowed an existing "
                         "token-id file")
    if path.endswith(".npy"):
        import numpy as np  # noqa: PLC0415

        try:
            array = np.load(path, allow_pickle=False)
        except Exception as err:  # noqa: BLE001 - any unreadable file is a config error
            raise ValueError(f"{_FIELD}={path!r} is not a readable .npy file ({err}); allowed a "
                             "1-D integer array") from None
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"{_FIELD}={path!r} holds an array of shape {array.shape} and dtype "
                             f"{array.dtype}; allowed a 1-D integer array")
        ids = [int(x) for x in array]
    else:
        with open(path, encoding="utf-8") as f:
            words = f.read().split()
        ids = []
        for i, word in enumerate(words):
            try:
                ids.append(int(word))
            except ValueError:
                raise ValueError(f"{_FIELD}={path!r}: entry {i} is {word!r}; allowed decimal token "
                                 "ids separated by whitespace") from None
    if not ids:
        raise ValueError(f"{_FIELD}={path!r} holds no tokens; allowed a non-empty token sequence")
    if min(ids) < 0:
        raise ValueError(f"{_FIELD}={path!r} holds a negative token id ({min(ids)}); allowed ids "
                         ">= 0")
    return torch.tensor(ids, dtype=torch.long)


def attention_spec(config, layer_number: int, provider):
    return qk_source_attention_spec(SharedMapCoreAttention, provider)


def validate(config) -> None:
    load_fixed_tokens(config.fixed_qk_tokens_file)
    validate_qk_source_config(config, "fixed_seq_qk")


VARIANT = Variant(
    name="fixed_seq_qk",
    summary="Q, K from a fixed text's embedding run through the same layers (one map for the "
            "batch); V from the input",
    attention_spec=attention_spec,
    validate=validate,
    knobs=("fixed_qk_tokens_file",),
    core_flops=standard_core_flops,  # + one pass of the fixed row (training/flops.py)
    fixed_input=True,
    hosts=("gpt",),  # the fixed row cannot pass through a hybrid host's Mamba mixers
)
