"""Hugging Face folders: ``config.json`` and safetensors shards, read lazily, written sharded.

``HFReader(folder)`` resolves every tensor name to its shard (``model.safetensors.index.json``
when present, else the single ``model.safetensors``), checks that every shard the index names
exists, and reads one tensor at a time through ``safetensors.safe_open`` (memory-mapped), so the
folder is never loaded whole. ``write_safetensors(plan, folder)`` writes shards of at most
``max_shard_bytes`` (a tensor larger than that gets a shard of its own), producing each tensor
only when its shard is written, plus the index that ``transformers`` reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# files of an HF folder that are neither weights nor config.json and travel with a conversion
# (tokenizer, generation defaults), copied verbatim
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json", "generation_config.json", "vocab.json", "merges.txt",
              "chat_template.jinja", "chat_template.json", "added_tokens.json")


def read_config(folder: str) -> dict:
    """``folder/config.json`` as a dict; a FileNotFoundError/ValueError names the file."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--hf {folder}: no config.json (a Hugging Face model folder "
                                "holds config.json and safetensors weights)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a JSON object")
    return data


def _safe_open():
    try:
        from safetensors import safe_open  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - the [convert] extra installs it
        raise ImportError("checkpoint conversion needs safetensors: pip install "
                          "'megatron_subq[convert]'") from e
    return safe_open


class HFReader:
    """The tensors of a Hugging Face folder, by name, read one at a time.

    Raises FileNotFoundError naming the folder or the missing shard (before any tensor is
    read); ``pytorch_model.bin`` folders are refused (convert them to safetensors first)."""

    def __init__(self, folder: str):
        self.folder = folder
        index_path = os.path.join(folder, INDEX)
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{index_path}: expected a JSON object with a "
                                     f"'weight_map' of tensor name -> shard file ({e})") from e
            self.weight_map: Dict[str, str] = dict(weight_map)
        elif os.path.isfile(os.path.join(folder, SINGLE)):
            with _safe_open()(os.path.join(folder, SINGLE), "pt") as f:
                self.weight_map = {k: SINGLE for k in f.keys()}
        else:
            other = [n for n in sorted(os.listdir(folder)) if n.endswith((".bin", ".pt", ".pth"))]
            raise FileNotFoundError(
                f"--hf {folder}: neither {INDEX} nor {SINGLE}"
                + (f" (found {', '.join(other)}: only safetensors weights are read; save the "
                   "model with safe_serialization)" if other else ""))
        missing = sorted({s for s in self.weight_map.values()
                          if not os.path.isfile(os.path.join(folder, s))})
        if missing:
            raise FileNotFoundError(
                f"--hf {folder}: shard file(s) named by {INDEX} are missing: "
                + ", ".join(os.path.join(folder, s) for s in missing))
        self._handles: Dict[str, object] = {}

    def _handle(self, shard: str):
        if shard not in self._handles:
            self._handles[shard] = _safe_open()(os.path.join(self.folder, shard), "pt")
        return self._handles[shard]

    def keys(self) -> List[str]:
        return sorted(self.weight_map)

    def file_of(self, name: str) -> str:
        return os.path.join(self.folder, self.weight_map[name])

    def shape(self, name: str) -> Tuple[int, ...]:
        """The stored shape, from the shard's header (no data read)."""
        handle = self._handle(self.weight_map[name])
        try:
            return tuple(handle.get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 - an index naming a tensor its shard lacks
            raise ValueError(f"{self.file_of(name)}: has no tensor {name!r} although {INDEX} "
                             f"places it there ({e})") from e

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.weight_map[name]).get_tensor(name)

    def nbytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.folder, s))
                   for s in set(self.weight_map.values()))

    def close(self) -> None:
        for h in self._handles.values():
            close = getattr(h, "__exit__", None)
            if close is not None:
                close(None, None, None)
        self._handles.clear()


@dataclass
class PlannedTensor:
    """One tensor to write: its name, shape and dtype (for the shard plan), and ``make()``, which
    produces it when its shard is written."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.tensor([], dtype=self.dtype).element_size()


def parse_size(size) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or an int (bytes) -> bytes; ValueError names the value."""
    if isinstance(size, int) and size > 0:
        return size
    text = str(size).strip().upper()
    units = {"KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "KB": 10 ** 3, "MB": 10 ** 6,
             "GB": 10 ** 9, "B": 1}
    for unit, factor in units.items():
        if text.endswith(unit):
            try:
                value = float(text[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return int(value * factor)
    raise ValueError(f"--max-shard-size={size!r} is invalid: allowed a positive size such as "
                     "'5GB', '500MB', '2GiB' or a number of bytes")


def plan_shards(tensors: Sequence[PlannedTensor],
                max_shard_bytes: int) -> List[List[PlannedTensor]]:
    """Consecutive groups of at most ``max_shard_bytes`` (a larger tensor stands alone)."""
    shards: List[List[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return [s for s in shards if s]


def write_safetensors(tensors: Sequence[PlannedTensor], folder: str, max_shard_bytes: int,
                      progress: Optional[Callable[[Iterable], Iterable]] = None) -> List[str]:
    """Write ``tensors`` into ``folder`` as transformers does: one ``model.safetensors``, or
    ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``. Only one shard's
    tensors are held at a time. Returns the files written."""
    from safetensors.torch import save_file  # noqa: PLC0415

    shards = plan_shards(tensors, max_shard_bytes)
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    bar = progress(sum(len(s) for s in shards)) if progress else None
    for shard, file_name in zip(shards, names):
        data = {}
        for t in shard:
            value = t.make()
            if tuple(value.shape) != tuple(t.shape) or value.dtype != t.dtype:
                raise RuntimeError(f"{t.name}: produced {tuple(value.shape)} {value.dtype}, "
                                   f"planned {t.shape} {t.dtype}")
            data[t.name] = value.detach().contiguous().clone()
            weight_map[t.name] = file_name
            total += t.nbytes
            if bar is not None:
                bar.update(1)
        save_file(data, os.path.join(folder, file_name), metadata={"format": "pt"})
        del data
    if bar is not None:
        bar.close()
    if len(shards) > 1:
        with open(os.path.join(folder, INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                      sort_keys=True)
            f.write("\n")
        names.append(INDEX)
    return names
