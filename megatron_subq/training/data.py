"""Data for the trainer: megatron-core's GPTDataset (via BlendedMegatronDatasetBuilder) and a
sampler that resumes exactly where a checkpoint left off.

Every rank builds the datasets (rank 0 first writes the index cache; the builder makes the others
wait and read it) and reads its own micro-batches: the samples of one global batch are handed out
in order, data-parallel rank r taking the r-th micro-batch of each group of DP micro-batches
(Megatron-LM's ``MegatronPretrainingSampler``). TP and PP ranks of one DP rank read the same
samples. The data-iterator state is therefore just ``consumed_train_samples``.

Validation uses a fixed set: the first ``eval_iters * global_batch_size`` samples of the valid
split, every time, so validation losses are comparable across iterations, runs and parallel
layouts.

``check_data`` (called by ``arguments.validate_args``, before anything is built) refuses data
that megatron-core would otherwise accept and then fail on late, silently or forever: a prefix
without its ``.bin``/``.idx``, an ``.idx`` that is not one, a ``.bin`` whose size is not the one
its ``.idx`` implies, and a split too small for what the run asks of it (see ``check_splits``).
With ``--subq-loss-mask-data`` it also checks the prefixes' loss-mask sidecars
(``loss_mask_data.check_loss_mask_sidecars``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

from .blend import parse_blend
from .loss_mask_data import FLAG as LOSS_MASK_FLAG
from .loss_mask_data import LossMaskGPTDataset, check_loss_mask_sidecars


class PretrainingSampler:
    """Micro-batches of sample indices for one DP rank, starting at ``consumed_samples``."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if consumed_samples > total_samples:
            raise ValueError(f"consumed_samples={consumed_samples} exceeds the dataset's "
                             f"{total_samples} samples")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = data_parallel_rank
        self.dp_size = data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // (self.micro_batch_size *
                                                               self.dp_size)

    def __iter__(self) -> Iterator[List[int]]:
        group = self.micro_batch_size * self.dp_size
        start = self.dp_rank * self.micro_batch_size
        for first in range(self.consumed_samples, self.total_samples - group + 1, group):
            yield list(range(first + start, first + start + self.micro_batch_size))


def _blend(parser, tokens, flag):
    return parse_blend(parser, tokens, flag) if tokens else None


def split_sizes(args: argparse.Namespace) -> List[int]:
    """Samples asked of the (train, valid, test) datasets: the run's training samples (at least 1)
    and ``eval_iters * global_batch_size`` for valid and test."""
    train_samples = (args.train_samples if args.train_samples is not None
                     else (args.train_iters or 0) * args.global_batch_size)
    eval_samples = args.eval_iters * args.global_batch_size
    return [max(train_samples, 1), eval_samples, eval_samples]


def build_datasets(args: argparse.Namespace, tokenizer):
    """(train, valid, test) GPTDatasets (valid/test may be None when their split is empty)."""
    parser = getattr(args, "_parser", None)
    sizes = split_sizes(args)
    blend = blend_per_split = split = None
    if args.data_path:
        blend, split = _blend(parser, args.data_path, "--data-path"), args.split
    elif args.train_data_path:
        blend_per_split = [_blend(parser, args.train_data_path, "--train-data-path"),
                           _blend(parser, args.valid_data_path, "--valid-data-path"),
                           _blend(parser, args.test_data_path, "--test-data-path")]
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=True,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,  # every variant is causal; none reads a mask
    )
    if args.mock_data:
        cls = MockGPTDataset
    elif getattr(args, "subq_loss_mask_data", False):
        cls = LossMaskGPTDataset  # GPTDataset's samples for a prefix without a sidecar
    else:
        cls = GPTDataset
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def make_loader(dataset, consumed_samples: int, total_samples: Optional[int], args,
                dp_rank: int, dp_size: int) -> Optional[torch.utils.data.DataLoader]:
    if dataset is None:
        return None
    total = len(dataset) if total_samples is None else min(total_samples, len(dataset))
    sampler = PretrainingSampler(total, consumed_samples, args.micro_batch_size, dp_rank, dp_size)
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, num_workers=args.num_workers,
        pin_memory=torch.cuda.is_available(), persistent_workers=False)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ------------------------------------------------------------------------------------------------
# checks of --data-path & co. before anything is built
# ------------------------------------------------------------------------------------------------
_SPLITS = ("train", "valid", "test")
_PATH_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


@dataclasses.dataclass
class IndexedDatasetInfo:
    """What the ``.idx`` of one prefix says: per-sequence token counts (GPTDataset splits a
    dataset by sequence, i.e. by document for tools/preprocess_data.py's output)."""
    prefix: str
    sequence_lengths: "numpy.ndarray"  # noqa: F821 - int32, one per sequence
    index: object = None  # megatron's _IndexReader: the lengths are a view of its mmap, which
    # it closes when collected, so it must live as long as they do

    @property
    def documents(self) -> int:
        return int(self.sequence_lengths.shape[0])

    def tokens(self, begin: int = 0, end: Optional[int] = None) -> int:
        return int(self.sequence_lengths[begin:end].sum(dtype="int64"))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_indexed_dataset(prefix: str, flag: str = "--data-path") -> IndexedDatasetInfo:
    """Open the ``PREFIX.idx`` of one dataset and check its ``PREFIX.bin`` against it.

    Raises ``ValueError`` naming ``flag`` and the file when the ``.bin`` or ``.idx`` is missing,
    the ``.idx`` is not a megatron index, the ``.bin`` does not hold exactly the bytes the
    ``.idx`` points to (a truncated or overlong copy: megatron would read past it or train on a
    prefix of it without a word), or the dataset holds no tokens (its empty ``.bin`` cannot be
    mmapped). The ``.bin`` is only stat'ed, never read.
    """
    import numpy  # noqa: PLC0415
    from megatron.core.datasets.indexed_dataset import (  # noqa: PLC0415
        IndexedDataset,
        get_bin_path,
        get_idx_path,
    )

    idx, bin_ = get_idx_path(prefix), get_bin_path(prefix)
    missing = [p for p in (bin_, idx) if not os.path.isfile(p)]
    if missing:
        what = f"{prefix}.bin/.idx" if len(missing) == 2 else missing[0]
        hint = ""
        for guess in (prefix[:-4] if prefix.endswith((".bin", ".idx")) else None,
                      prefix + "_text_document"):
            if guess and os.path.isfile(guess + ".idx"):
                hint = f" (did you mean {guess}?)"
                break
        raise ValueError(f"{flag} {prefix}: no {what}{hint}; give the prefix of a megatron "
                         "indexed dataset (tools/preprocess_data.py writes PREFIX.bin and "
                         "PREFIX.idx)")
    try:  # mmap=False: the .bin is not opened (an empty one cannot be mmapped)
        index = IndexedDataset(prefix, multimodal=False, mmap=False).index
        lengths, pointers = index.sequence_lengths, index.sequence_pointers
        itemsize = numpy.dtype(index.dtype).itemsize
    except Exception as e:  # noqa: BLE001 - megatron asserts / numpy raises on a bad index
        raise ValueError(f"{flag} {prefix}: {idx} is not a readable megatron index file "
                         f"({type(e).__name__}: {e}); re-run tools/preprocess_data.py") from None
    expected = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
    actual = os.path.getsize(bin_)
    if actual != expected:
        raise ValueError(f"{flag} {prefix}: {bin_} is {actual:,} bytes but {idx} implies "
                         f"{expected:,} ({len(lengths):,} sequences of "
                         f"{numpy.dtype(index.dtype).name} tokens); the .bin is "
                         f"{'truncated' if actual < expected else 'longer than indexed'} or "
                         "belongs to another .idx: re-run tools/preprocess_data.py")
    info = IndexedDatasetInfo(prefix, lengths, index)
    if info.tokens() == 0:
        raise ValueError(f"{flag} {prefix}: the dataset holds no tokens ({info.documents} "
                         "documents); it cannot be trained on (was its preprocessing input "
                         "empty?)")
    return info


def _split_matrix(split: str):
    """megatron's own parse of ``--split``: [(begin, end) fraction or None] per split."""
    from megatron.core.datasets.blended_megatron_dataset_config import (  # noqa: PLC0415
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    try:  # megatron picks the numbers out of any text and normalises 0,0,0 to NaNs
        ok = re.fullmatch(r"\s*[0-9.]+(\s*[,/ ]\s*[0-9.]+){0,2}\s*", split) and \
            sum(float(v) for v in re.findall(r"[.0-9]+", split)) > 0
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split)) \
            if ok else None
    except Exception:  # noqa: BLE001 - '1.2.3' and the like
        matrix = None
    if matrix is None:
        raise ValueError(f"--split {split} is invalid: give up to three non-negative weights "
                         "train,valid,test, not all 0 (e.g. 969,30,1)")
    return matrix


def _document_range(documents: int, bookends) -> Tuple[int, int]:
    """The documents megatron's builder gives one split (its own rounding)."""
    return (int(round(bookends[0] * float(documents))),
            int(round(bookends[1] * float(documents))))


def check_splits(args: argparse.Namespace, parser=None,
                 infos: Optional[Dict[str, IndexedDatasetInfo]] = None) -> None:
    """Refuse a split that megatron-core's dataset builder cannot build, before it tries.

    ``GPTDataset`` asked for ``n`` samples of a split holding ``T`` tokens repeats the split
    ("epochs") until it has ``n * seq_length + 1`` tokens, counting epochs in a Python loop: with
    ``T = 0`` (a split of 0 documents, e.g. the default ``--split 969,30,1`` on a small corpus,
    or documents of no tokens) that loop never ends, even for ``n = 0``; with ``0 < T <
    seq_length + 1`` every sample is the split repeated within itself (and the loop runs up to
    ``n * seq_length`` times). So every split that is built must hold at least one sample
    (``seq_length + 1`` tokens; ``n = 0`` only needs a token), for each dataset of a blend as
    megatron apportions it. An unweighted blend of several prefixes is not repeated: it provides
    ``sum (T - 1) // seq_length`` samples, which must cover what the run reads of its train and
    valid splits. Raises ``ValueError`` naming the flag, the prefix, the split and the numbers.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: PLC0415
        _get_size_per_split_per_dataset,
    )
    from megatron.core.datasets.utils import normalize  # noqa: PLC0415

    if args.mock_data or _object_storage(args):
        return
    infos = dict(infos or {})
    seq = args.seq_length
    sizes = split_sizes(args)
    surplus = GPTDatasetConfig.__dataclass_fields__["mid_level_dataset_surplus"].default
    if args.data_path:
        flag = "--data-path"
        prefixes, weights = _blend(parser, args.data_path, flag)
        matrix = _split_matrix(args.split)
        per_split = [(flag, prefixes, weights, matrix[i], sizes[i]) for i in range(3)]
    else:
        per_split = []
        for i, name in enumerate(_PATH_FLAGS[1:]):
            tokens = getattr(args, name, None)
            prefixes, weights = _blend(parser, tokens, _flag(name)) if tokens else (None, None)
            per_split.append((_flag(name), prefixes, weights,
                              (0.0, 1.0) if prefixes else None, sizes[i]))
    for prefix in {p for _, ps, _, _, _ in per_split if ps for p in ps}:
        if prefix not in infos:
            flag = next(f for f, ps, _, _, _ in per_split if ps and prefix in ps)
            infos[prefix] = check_indexed_dataset(prefix, flag)

    def table(flag, prefix):
        info = infos[prefix]
        parts = []
        for j, (f, ps, _, bookends, _) in enumerate(per_split):
            if f == flag and bookends is not None and ps and prefix in ps:
                b, e = _document_range(info.documents, bookends)
                parts.append(f"{_SPLITS[j]} {e - b:,} documents / {info.tokens(b, e):,} tokens")
        return "; ".join(parts)

    for i, (flag, prefixes, weights, bookends, needed) in enumerate(per_split):
        if bookends is None or not prefixes:
            continue  # megatron builds no such split
        where = (f"--split {args.split}: the {_SPLITS[i]} split of {flag}"
                 if flag == "--data-path" else f"{flag}")
        if weights is not None:
            weights = normalize(weights)
        # samples megatron asks of each dataset of the blend (None: one pass, no repeats)
        if len(prefixes) == 1 and (weights is None or flag != "--data-path"):
            asked = [needed]
        elif weights is not None:
            target = [0, 0, 0]
            target[i] = needed
            asked = [row[i] for row in _get_size_per_split_per_dataset(weights, target, surplus)]
        else:
            asked = [None] * len(prefixes)
        provided = 0
        for prefix, n in zip(prefixes, asked):
            info = infos[prefix]
            b, e = _document_range(info.documents, bookends)
            tokens = info.tokens(b, e)
            samples = max(tokens - 1, 0) // seq  # megatron's count: seq + 1 tokens per sample
            provided += samples
            if n is None:
                continue
            if tokens == 0 or (n > 0 and samples == 0):
                why = ("megatron-core's GPTDataset would loop forever building it"
                       if tokens == 0 else
                       "megatron-core would repeat it inside every sample")
                raise ValueError(
                    f"{where} {prefix} holds {e - b:,} documents / {tokens:,} tokens, less than "
                    f"one sample of --seq-length {seq} ({seq + 1} tokens): {why}. The run asks "
                    f"{n:,} samples of it ({_need(i)}). Per split: {table(flag, prefix)}. "
                    f"Give it more data{_split_hint(flag, i)}")
        if asked[0] is None and (provided == 0 or (i < 2 and provided < needed and
                                                   (i == 0 or args.eval_iters > 0))):
            raise ValueError(
                f"{where} (an unweighted blend of {len(prefixes)} datasets, read once without "
                f"repeats) provides {provided:,} samples of --seq-length {seq}; the run needs "
                f"{needed:,} ({_need(i)}). Give blend weights ('0.5 A 0.5 B': megatron then "
                f"repeats the data), more data, or a shorter run{_split_hint(flag, i)}")


def _object_storage(args) -> bool:
    from megatron.core.datasets.object_storage_utils import is_object_storage_path  # noqa: PLC0415

    return any(is_object_storage_path(t) for name in _PATH_FLAGS
               for t in (getattr(args, name, None) or []))


def _need(i: int) -> str:
    return ("--train-iters/--train-samples x --global-batch-size" if i == 0 else
            "--eval-iters x --global-batch-size")


def _split_hint(flag: str, i: int) -> str:
    if flag != "--data-path":
        return ""
    return (" or a larger share of --split" if i < 2 else
            " or a larger share of --split (the trainer never reads the test split: --split "
            "with a test weight of 0, e.g. 90,10,0, builds none)")


def check_data(parser, args: argparse.Namespace) -> None:
    """The start-up check of the data flags (``validate_args`` calls it; mock data passes): every
    prefix of ``--data-path`` / ``--train/valid/test-data-path`` (blends' weights skipped) is a
    complete indexed dataset (``check_indexed_dataset``), every split can be built
    (``check_splits``) and, with ``--subq-loss-mask-data``, the sidecars are sound
    (``check_loss_mask_sidecars``). A failure is ``parser.error`` (usage, the message, exit
    status 2)."""
    loss_mask = getattr(args, "subq_loss_mask_data", False)
    if loss_mask and _object_storage(args):
        parser.error(f"{LOSS_MASK_FLAG} reads the sidecars PREFIX_lossmask.bin/.idx beside local "
                     "prefixes; object-storage prefixes (s3://, msc://) are not supported with it")
    if args.mock_data or _object_storage(args):
        return  # s3:// / msc:// prefixes: megatron reads them through its own cache
    try:
        infos: Dict[str, IndexedDatasetInfo] = {}
        for name in _PATH_FLAGS:
            tokens: Sequence[str] = getattr(args, name, None) or []
            if tokens:
                for prefix in _blend(parser, tokens, _flag(name))[0]:
                    if prefix not in infos:
                        infos[prefix] = check_indexed_dataset(prefix, _flag(name))
        check_splits(args, parser, infos)
        if loss_mask:
            check_loss_mask_sidecars(infos)
    except ValueError as e:
        parser.error(str(e))
