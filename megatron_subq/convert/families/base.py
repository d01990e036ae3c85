"""What a model family is to the converter: one Hugging Face architecture <-> one host model.

A family (one module per family in this folder, registered in ``families/__init__.py``) says
* which HF ``architectures`` it reads, and on which ``host`` it lands (``"gpt"``: the GPT host of
  ``specs.py``; a hybrid family lands on the hybrid host);
* ``trainer_flags(hf_config)``: the trainer's flags (``{dest: value}``) that build the same
  model, raising ``ValueError`` naming the config.json field of anything it cannot represent;
* ``tensor_maps(args)``: one ``TensorMap`` per megatron tensor of the host model built from
  those flags: its HF tensor(s) and the two directions of the layout change;
* ``hf_config(args, base)``: the config.json of an export.

The converter (``api.py``) does the rest (reading, checking, building, saving) the same way for
every family, so a family is a table plus its config translation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

Shape = Tuple[int, ...]


def refuse(field: str, value: Any, allowed: str, host: str) -> None:
    """The error for a config.json value the ``host`` ("GPT", "hybrid") cannot represent."""
    raise ValueError(f"config.json: {field}={value!r} cannot be represented by megatron_subq's "
                     f"{host} host: allowed {allowed}")


def dtype_flags(cfg: dict, host: str) -> dict:
    """--bf16 / --fp16 from config.json's ``dtype`` (transformers 5) or ``torch_dtype`` (4)."""
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        refuse("dtype", dtype, "float32, bfloat16 or float16", host)
    return dict(bf16=dtype == "bfloat16", fp16=dtype == "float16")


def _identity_in(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return ts[0]


def _identity_out(t: torch.Tensor) -> List[torch.Tensor]:
    return [t]


@dataclass(frozen=True)
class TensorMap:
    """One megatron tensor (its name in the host model at TP=1/PP=1) and the HF tensors it is
    made of. ``to_megatron(hf_tensors) -> tensor`` and ``to_hf(tensor) -> hf_tensors`` are exact
    inverses (pure reshapes, slices and concatenations: a round trip is bitwise);
    ``hf_shapes`` are the shapes config.json implies, checked before anything is written."""

    megatron: str
    hf: Tuple[str, ...]
    hf_shapes: Tuple[Shape, ...]
    to_megatron: Callable[[Sequence[torch.Tensor]], torch.Tensor] = _identity_in
    to_hf: Callable[[torch.Tensor], List[torch.Tensor]] = _identity_out
    layer: Optional[int] = None  # 0-based layer index, None for embeddings/final norm/head
    part: str = "other"  # "attention" (the attention slot's own tensors) or "other"


def copy(megatron: str, hf: str, shape: Shape, layer: Optional[int] = None,
         part: str = "other") -> TensorMap:
    return TensorMap(megatron, (hf,), (tuple(shape),), layer=layer, part=part)


def qkv(megatron: str, q: str, k: str, v: str, heads: int, groups: int, head_dim: int,
        rest: Shape, layer: int) -> TensorMap:
    """megatron's fused ``linear_qkv`` (weight ``rest=(hidden,)``, or bias ``rest=()``): rows
    grouped per query group as [the group's q heads; its k head; its v head]."""
    per = heads // groups

    def merge(ts):
        q_, k_, v_ = ts
        return torch.cat([q_.reshape(groups, per * head_dim, *rest),
                          k_.reshape(groups, head_dim, *rest),
                          v_.reshape(groups, head_dim, *rest)], dim=1).reshape(-1, *rest)

    def split(t):
        g = t.reshape(groups, (per + 2) * head_dim, *rest)
        q_, k_, v_ = torch.split(g, [per * head_dim, head_dim, head_dim], dim=1)
        return [x.reshape(-1, *rest).clone() for x in (q_, k_, v_)]

    return TensorMap(megatron, (q, k, v),
                     ((heads * head_dim, *rest), (groups * head_dim, *rest),
                      (groups * head_dim, *rest)), merge, split, layer=layer, part="attention")


def gated_fc1(megatron: str, gate: str, up: str, ffn: int, hidden: int, layer: int) -> TensorMap:
    """megatron's gated ``linear_fc1``: [gate; up] along rows (its sharded state dict splits the
    two halves so that each TP rank holds [gate_r; up_r])."""
    def merge(ts):
        return torch.cat([ts[0], ts[1]], dim=0)

    def split(t):
        g, u = torch.chunk(t, 2, dim=0)
        return [g.clone(), u.clone()]

    return TensorMap(megatron, (gate, up), ((ffn, hidden), (ffn, hidden)), merge, split,
                     layer=layer)


@dataclass(frozen=True)
class Family:
    """A Hugging Face architecture family (see the module docstring)."""

    name: str
    architectures: Tuple[str, ...]
    model_type: str
    host: str = "gpt"
    summary: str = ""
    trainer_flags: Callable[[dict], dict] = None
    tensor_maps: Callable[..., List[TensorMap]] = None
    hf_config: Callable[..., dict] = None
    # does a checkpoint's argument set describe this family (export without a stored config.json)
    matches_args: Callable[..., bool] = field(default=lambda args: False)
    # the HF name prefix of layer i's attention-slot tensors (variants' ``hf_param_map``)
    hf_layer_prefix: str = "model.layers.{i}."
    # the trainer script of this family's host (printed after an import)
    script: str = "examples/pretrain_gpt.py"
    # the attention variants an export can write (their own tensors: ``hf_param_map``); the
    # others are refused by name. NemotronH: standard and superlinear (shipped remote code)
    hf_variants: Tuple[str, ...] = ("standard",)
