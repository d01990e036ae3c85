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
"""

from __future__ import annotations

import argparse
from typing import Iterator, List, Optional

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

from .arguments import parse_blend


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


def build_datasets(args: argparse.Namespace, tokenizer):
    """(train, valid, test) GPTDatasets (valid/test may be None when their split is empty)."""
    parser = getattr(args, "_parser", None)
    train_samples = (args.train_samples if args.train_samples is not None
                     else (args.train_iters or 0) * args.global_batch_size)
    eval_samples = args.eval_iters * args.global_batch_size
    sizes = [max(train_samples, 1), eval_samples, eval_samples]
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
    cls = MockGPTDataset if args.mock_data else GPTDataset
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
