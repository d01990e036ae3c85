"""Tokenizers for the trainer and tools: SentencePiece, HuggingFace ``tokenizers``, Null.

    tok = build_tokenizer("GPTSentencePieceTokenizer", "mistral")
    ids = tok.tokenize("text")          # list of ints (no BOS/EOS added)
    tok.eod, tok.vocab_size

* SentencePiece and Null use megatron-core's own tokenizer classes
  (``megatron.core.tokenizers.MegatronTokenizer``), which GPTDataset accepts as they are.
* ``--tokenizer-model mistral`` is the Mistral 7B SentencePiece model (32,000 pieces; the ASA
  paper's tokenizer) that the ``mistral-common`` package ships as
  ``mistral_common/data/tokenizer.model.v1``. The package is located without being imported (its
  own dependencies are not needed) and nothing is downloaded.
* HuggingFace: a ``tokenizer.json`` (or a folder holding one) read with the ``tokenizers``
  package; EOD is its end-of-text token.
"""

from __future__ import annotations

import importlib.util
import os
from typing import List, Optional

MISTRAL_ALIASES = ("mistral", "mistral-7b", "mistral-v1")
MISTRAL_FILE = os.path.join("data", "tokenizer.model.v1")

# end-of-document candidates of common HuggingFace tokenizers, in order of preference
_HF_EOD_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


def resolve_tokenizer_model(name_or_path: str) -> str:
    """A path to the tokenizer model; 'mistral' -> mistral-common's tokenizer.model.v1."""
    if name_or_path.lower() in MISTRAL_ALIASES:
        spec = importlib.util.find_spec("mistral_common")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"--tokenizer-model {name_or_path} needs the mistral-common package, which ships "
                "the Mistral SentencePiece model (pip install mistral-common; its data file is "
                "all that is used, so `pip install --no-deps mistral-common` is enough)")
        path = os.path.join(list(spec.submodule_search_locations)[0], MISTRAL_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"--tokenizer-model {name_or_path}: {path} is missing from the "
                             "installed mistral-common")
        return path
    if not os.path.exists(name_or_path):
        raise ValueError(f"--tokenizer-model {name_or_path}: no such file or folder")
    return name_or_path


class HuggingFaceTokenizersTokenizer:
    """A ``tokenizers.Tokenizer`` (tokenizer.json) with the interface GPTDataset reads."""

    def __init__(self, path: str, eod_token: Optional[str] = None):
        try:
            from tokenizers import Tokenizer  # noqa: PLC0415
        except ImportError as e:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs the `tokenizers` "
                             "package (pip install tokenizers)") from e
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"--tokenizer-model {path}: no tokenizer.json there")
        self.path = path
        self._tok = Tokenizer.from_file(path)
        candidates = (eod_token,) if eod_token else _HF_EOD_TOKENS
        ids = [self._tok.token_to_id(t) for t in candidates]
        found = [i for i in ids if i is not None]
        if not found:
            raise ValueError(f"--tokenizer-model {path}: none of the end-of-text tokens "
                             f"{candidates} is in the vocabulary")
        self.eod = found[0]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.unique_identifiers = {"class": type(self).__name__, "tokenizer_path": path}

    @property
    def eos(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode(list(ids))


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None,
                    vocab_size: Optional[int] = None):
    """The tokenizer named by Megatron-LM's ``--tokenizer-type`` / ``--tokenizer-model``."""
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        from megatron.core.tokenizers import MegatronTokenizer  # noqa: PLC0415

        return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"},
                                                 vocab_size=vocab_size)
    if tokenizer_model is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model")
    path = resolve_tokenizer_model(tokenizer_model)
    if tokenizer_type in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer"):
        if os.path.isdir(path):
            raise ValueError(f"--tokenizer-model {path}: a SentencePiece .model file is needed")
        from megatron.core.tokenizers import MegatronTokenizer  # noqa: PLC0415

        return MegatronTokenizer.from_pretrained(path, metadata_path={"library": "sentencepiece"})
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizersTokenizer(path)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is invalid: allowed "
                     "GPTSentencePieceTokenizer, SentencePieceTokenizer, HuggingFaceTokenizer, "
                     "NullTokenizer")


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's vocabulary padding: a multiple of divisible_by * TP (the output layer and
    the embedding split over TP)."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def padded_vocab_size_for_load(vocab_size: int, divisible_by: int, tp: int,
                               saved: Optional[dict] = None):
    """The padded vocabulary of a run that loads a checkpoint whose stored arguments are
    ``saved`` (None or {}: no checkpoint). Returns (padded size, note or None).

    The padding rows are real output rows that take part in the softmax, so a loaded model keeps
    the checkpoint's padded size whenever the new TP divides it (e.g. a TP=4 Mistral checkpoint
    keeps 32,256 rows at TP=1, where a fresh run would have 32,000). The checkpoint's size is its
    stored ``padded_vocab_size``, or, for checkpoints saved before it was stored, derived from
    its ``tokenizer_vocab_size`` (else this tokenizer's ``vocab_size``), its
    ``make_vocab_size_divisible_by`` and its TP. Raises ValueError when the new TP does not
    divide it (padding further would add rows and change the model). One rule for the trainer,
    tools/evaluate.py and checkpoint conversion.
    """
    own = padded_vocab_size(vocab_size, divisible_by, tp)
    if not saved:
        return own, None
    ckpt = saved.get("padded_vocab_size")
    how = "stored"
    if ckpt is None:
        ckpt = padded_vocab_size(saved.get("tokenizer_vocab_size") or vocab_size,
                                 saved.get("make_vocab_size_divisible_by", divisible_by),
                                 saved.get("tensor_model_parallel_size", 1))
        how = (f"{saved.get('tokenizer_vocab_size') or vocab_size} tokens padded by the "
               f"checkpoint's --make-vocab-size-divisible-by "
               f"{saved.get('make_vocab_size_divisible_by', divisible_by)} x TP "
               f"{saved.get('tensor_model_parallel_size', 1)}")
    ckpt = int(ckpt)
    if ckpt < vocab_size:
        raise ValueError(f"the checkpoint's vocabulary has {ckpt} rows, fewer than this "
                         f"tokenizer's {vocab_size} tokens: --tokenizer-type/--tokenizer-model "
                         "differ from the checkpoint's")
    if ckpt % tp:
        raise ValueError(
            f"--tensor-model-parallel-size {tp} is invalid for this checkpoint: its padded "
            f"vocabulary of {ckpt} rows ({how}) does not split over {tp} ranks, and padding it "
            f"to a multiple of --make-vocab-size-divisible-by {divisible_by} x TP {tp} would add "
            f"output rows that change the softmax; allowed: a TP size that divides {ckpt}")
    if ckpt == own:
        return ckpt, None
    return ckpt, (f"vocabulary: keeping the checkpoint's padded size {ckpt} (tokenizer "
                  f"{vocab_size}); --make-vocab-size-divisible-by {divisible_by} x TP {tp} would "
                  f"pad to {own}, and the extra or missing rows would change the softmax")
