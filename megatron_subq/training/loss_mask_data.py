"""Loss-mask sidecar datasets (``--subq-loss-mask-data``): per-token loss masks read from disk.

Contract: for a data prefix ``P`` (``P.bin``/``P.idx``) the sidecar is the megatron indexed
dataset ``P_lossmask.bin``/``P_lossmask.idx`` of dtype uint8, one sequence per document of ``P``
of that document's length (EOD included); its value at a token is 1 where that token, as a label
(the token being predicted), counts in the loss, 0 where it does not.

With the flag the trainer builds ``LossMaskGPTDataset`` for every prefix: a ``GPTDataset`` whose
samples' ``loss_mask`` is megatron's own (``--eod-mask-loss``, padding) times the sidecar's values
at the labels' positions. A prefix without a sidecar behaves exactly as ``GPTDataset``, so one
blend can mix masked samples (e.g. needle-in-a-haystack retrieval, where only the answer tokens
should carry gradient) and plain LM text (every token counts). Off (the default), sidecars are
ignored. ``check_loss_mask_sidecars`` refuses bad sidecars at start-up, before anything is built.

The mask sample is assembled by megatron's own ``GPTDataset._query_document_sample_shuffle_indices``
run against the sidecar instead of the tokens (the same document/sample/shuffle indices), so the
two can never fall out of step.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

import numpy
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset

FLAG = "--subq-loss-mask-data"
SUFFIX = "_lossmask"


def sidecar_prefix(prefix: str) -> str:
    """The loss-mask sidecar's prefix of the data prefix ``prefix``: ``PREFIX_lossmask``."""
    return prefix + SUFFIX


def sidecar_files(prefix: str):
    """The sidecar's (``.bin``, ``.idx``) paths of the data prefix ``prefix``."""
    side = sidecar_prefix(prefix)
    return side + ".bin", side + ".idx"


def has_sidecar(prefix: str) -> bool:
    """Whether ``prefix`` has a sidecar (either of its files: a half one is an error later)."""
    return any(os.path.isfile(p) for p in sidecar_files(prefix))


class _SidecarView:
    """The dataset seen through its sidecar: every attribute is the dataset's, except
    ``dataset`` (the IndexedDataset the sample assembly reads), which is the sidecar."""

    def __init__(self, owner: GPTDataset, sidecar):
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "dataset", sidecar)

    def __getattr__(self, name):
        return getattr(self._owner, name)


class LossMaskGPTDataset(GPTDataset):
    """``GPTDataset`` whose ``loss_mask`` is also multiplied by the prefix's loss-mask sidecar
    (``PREFIX_lossmask``, see the module docstring); without a sidecar it is ``GPTDataset``.

    Sample positions: megatron assembles ``seq_length + 1`` tokens ``s`` (with
    ``add_extra_token_to_sequence``, the default) and trains on tokens ``s[:-1]``, labels
    ``s[1:]``; the same assembly of the sidecar gives ``m``, and label ``i``'s mask is ``m[i+1]``.
    Without the extra token the labels are ``s`` rolled by one with a pad last: the mask is ``m``
    rolled the same way, 0 last."""

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split,
                 config) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split,
                         config)
        prefix = dataset_path if dataset_path is not None else indexed_dataset.path_prefix
        self.loss_mask_dataset = None
        if prefix is not None and has_sidecar(prefix):
            from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: PLC0415

            sidecar = IndexedDataset(sidecar_prefix(prefix), multimodal=False,
                                     mmap=config.mmap_bin_files)
            # check_loss_mask_sidecars has said so at start-up; a sidecar replaced since must not
            # mask the wrong tokens
            mismatch = _first_mismatch(indexed_dataset.sequence_lengths, sidecar.sequence_lengths)
            if mismatch is not None or numpy.dtype(sidecar.index.dtype) != numpy.uint8:
                raise ValueError(f"{FLAG}: the sidecar {sidecar_prefix(prefix)} does not match "
                                 f"{prefix} (restart: the start-up check names the difference)")
            self.loss_mask_dataset = sidecar

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        item = super().__getitem__(idx)
        if self.loss_mask_dataset is not None:
            item["loss_mask"] = item["loss_mask"] * self.sidecar_mask(0 if idx is None else idx)
        return item

    def sidecar_mask(self, idx: int) -> torch.Tensor:
        """The sidecar's mask (float 0/1, ``seq_length`` long) of sample ``idx``'s labels."""
        values, _ = GPTDataset._query_document_sample_shuffle_indices(
            _SidecarView(self, self.loss_mask_dataset), idx)
        mask = torch.from_numpy(values == 1).float()  # padding (the pad id) counts as 0
        if self.config.add_extra_token_to_sequence:
            return mask[1:].contiguous()
        mask = torch.roll(mask, shifts=-1, dims=0)
        mask[-1] = 0.0
        return mask


def _first_mismatch(lengths, side_lengths) -> Optional[int]:
    """The first document whose length differs (the shorter count if one is a prefix of the
    other), or None when both are equal."""
    n = min(len(lengths), len(side_lengths))
    diff = numpy.flatnonzero(numpy.asarray(lengths[:n]) != numpy.asarray(side_lengths[:n]))
    if len(diff):
        return int(diff[0])
    return None if len(lengths) == len(side_lengths) else n


def check_sidecar(prefix: str, lengths) -> None:
    """Check the sidecar of ``prefix`` (whose documents have the token counts ``lengths``):
    both files, a readable uint8 index, a ``.bin`` of the size the index implies, one sequence
    per document of the same length, values 0 or 1. Raises ``ValueError`` naming the flag and
    both paths."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: PLC0415

    side = sidecar_prefix(prefix)
    bin_, idx = sidecar_files(prefix)
    missing = [p for p in (bin_, idx) if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"{FLAG}: the loss-mask sidecar of {prefix} is incomplete: no "
                         f"{missing[0]} (a sidecar is the indexed dataset {side}.bin/.idx)")
    try:
        index = IndexedDataset(side, multimodal=False, mmap=False).index
        side_lengths, pointers = index.sequence_lengths, index.sequence_pointers
        dtype = numpy.dtype(index.dtype)
    except Exception as e:  # noqa: BLE001 - megatron asserts / numpy raises on a bad index
        raise ValueError(f"{FLAG}: {idx} (the loss-mask sidecar of {prefix}) is not a readable "
                         f"megatron index ({type(e).__name__}: {e})") from None
    if dtype != numpy.uint8:
        raise ValueError(f"{FLAG}: the loss-mask sidecar {side} of {prefix} has dtype "
                         f"{dtype.name}; sidecars are uint8 (IndexedDatasetBuilder(..., "
                         "dtype=numpy.uint8)), 1 where a label counts in the loss, 0 elsewhere")
    first = _first_mismatch(lengths, side_lengths)
    if first is not None:
        def length(ls):
            return f"{int(ls[first]):,} tokens" if first < len(ls) else "absent"
        raise ValueError(
            f"{FLAG}: the loss-mask sidecar {side} does not match its data prefix {prefix}: "
            f"{len(side_lengths):,} vs {len(lengths):,} documents; the first differing is "
            f"document {first} ({length(side_lengths)} in the sidecar, {length(lengths)} in the "
            "data). A sidecar holds one sequence per document, of the document's length")
    expected = int(pointers[-1]) + int(side_lengths[-1]) if len(side_lengths) else 0
    actual = os.path.getsize(bin_)
    if actual != expected:
        raise ValueError(f"{FLAG}: {bin_} is {actual:,} bytes but {idx} implies {expected:,} "
                         f"(the loss-mask sidecar of {prefix} is truncated or not its .idx's)")
    if expected:
        values = numpy.memmap(bin_, dtype=numpy.uint8, mode="r")
        top = int(values.max())
        del values
        if top > 1:
            raise ValueError(f"{FLAG}: the loss-mask sidecar {side} of {prefix} holds the value "
                             f"{top}; sidecar values are 0 (no loss) or 1 (loss)")


def check_loss_mask_sidecars(infos) -> None:
    """The start-up check of ``--subq-loss-mask-data`` over the run's prefixes (``infos``:
    prefix -> ``data.IndexedDatasetInfo``): at least one has a sidecar, and every sidecar passes
    ``check_sidecar``. Raises ``ValueError``."""
    found = [p for p in infos if has_sidecar(p)]
    if not found:
        looked = ", ".join(sidecar_prefix(p) + ".bin/.idx" for p in infos)
        raise ValueError(f"{FLAG} is set but no data prefix has a loss-mask sidecar; looked for "
                         f"{looked}. Write the sidecars (uint8 indexed datasets PREFIX_lossmask, "
                         f"one sequence per document) or drop {FLAG}")
    for prefix in found:
        check_sidecar(prefix, infos[prefix].sequence_lengths)
