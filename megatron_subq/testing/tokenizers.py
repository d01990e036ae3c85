"""Tiny tokenizers for the NIAH tests (tests/test_niah.py, tests/test_nano_superlinear_recipe.py)."""

from __future__ import annotations

import json
import lzma
import os


def train_niah_bpe(corpus: str, folder: str, documents: int, vocab_size: int,
                   template_repeats: int = 1) -> str:
    """A byte-level BPE ``tokenizer.json`` in ``folder``, trained on the sentences of the first
    ``documents`` of ``corpus`` (jsonl.xz) and the NIAH template (prefix, needle, question,
    ``template_repeats`` times), with ``<unk>`` and ``</s>``. Returns the file's path. Small
    vocabularies make words of several tokens, so exact NIAH lengths exercise the fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    from ..evaluation import niah  # noqa: PLC0415

    with lzma.open(corpus, "rt", encoding="utf-8") as f:
        texts = [json.loads(next(f))["text"] for _ in range(documents)]
    sentences = [s for t in texts for s in niah.split_sentences(t)]
    hf = Tokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(
        sentences + [niah.PREFIX, niah.NEEDLE, niah.QUESTION] * template_repeats,
        trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "</s>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = os.path.join(folder, "tokenizer.json")
    hf.save(path)
    return path
