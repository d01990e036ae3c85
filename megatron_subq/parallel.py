"""Tensor/sequence-parallel plumbing shared by every variant (kept here, not repeated per variant).

Megatron shards attention over heads: with TP=N each rank owns ``H/N`` query heads (and
``H_kv/N`` key/value heads) and the column/row-parallel projections around the core do the
communication. A variant that adds parameters follows two rules:

* Per-head parameters (ASA's P_Q/P_K, Superlinear's Q_s) are *head-sharded*: the full master tensor
  ``[H, ...]`` is initialised once (same CPU RNG stream on every rank, megatron's
  ``use_cpu_initialization`` convention) and each rank keeps its slice, so TP=N starts from the
  same weights as TP=1. ``head_sharded_parameter`` does this and marks the tensor so that
  ``sharded_state_dict`` saves it as TP-sharded along dim 0 (checkpoints reshard across TP sizes).
* A parameter kept whole on every rank but applied to head-sharded activations gets only a
  partial gradient on each rank. Pass it through ``tp_replicated`` in forward: identity forward,
  all-reduce of its gradient over TP in backward, so every rank holds the full gradient
  (``finalize_model_grads`` would only do this for SP-marked or qk-layernorm parameters).

Process groups are explicit, as in megatron's modules: a module takes the ``pg_collection`` that
megatron hands it (``process_groups``) and passes its ``.tp`` as ``tp_group`` to the helpers
below. ``None`` means megatron's global groups (``ProcessGroupCollection.use_mpu_process_groups``,
what megatron's own modules fall back to), resolved here only.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide, get_pg_rank, get_pg_size

ProcessGroup = torch.distributed.ProcessGroup


def process_groups(pg_collection: Optional[ProcessGroupCollection] = None
                   ) -> ProcessGroupCollection:
    """``pg_collection``, or megatron's global ``tp`` and ``cp`` groups when None (what megatron's
    ``Attention`` does): the one place a module without explicit groups gets its defaults."""
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    return pg_collection


def tp_group_or_global(tp_group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
    """``tp_group``, or the global TP group (None before megatron's parallel state exists, which
    counts as one rank)."""
    return process_groups().tp if tp_group is None else tp_group


def tp_world_size(tp_group: Optional[ProcessGroup] = None) -> int:
    """Ranks of ``tp_group`` (default: the global TP group; 1 without one)."""
    return get_pg_size(tp_group_or_global(tp_group))


def tp_rank(tp_group: Optional[ProcessGroup] = None) -> int:
    """This process's rank in ``tp_group`` (default: the global TP group; 0 without one)."""
    return get_pg_rank(tp_group_or_global(tp_group))


def local_heads(total_heads: int, what: str = "heads", *,
                tp_group: Optional[ProcessGroup] = None) -> int:
    """Heads owned by this rank of ``tp_group``; a clear error when ``total_heads`` does not
    split."""
    n = tp_world_size(tp_group)
    if total_heads % n:
        raise ValueError(f"{what}={total_heads} is not divisible by tensor_model_parallel_size={n}")
    return divide(total_heads, n)


def head_sharded_parameter(full_shape: Sequence[int], init_fn: Callable[[torch.Tensor], None],
                           dtype: torch.dtype, device=None, *,
                           tp_group: Optional[ProcessGroup] = None) -> torch.nn.Parameter:
    """A parameter whose dim 0 is heads, sharded over ``tp_group``; initialised as the full
    master tensor.

    ``init_fn`` fills a float32 master of ``full_shape`` in place (it runs identically on every
    rank, so every rank draws the same master from the CPU generator); rank r keeps heads
    ``[r*H/N, (r+1)*H/N)``.
    """
    full_shape = tuple(int(s) for s in full_shape)
    tp_group = tp_group_or_global(tp_group)
    h_local = local_heads(full_shape[0], "per-head parameter heads", tp_group=tp_group)
    master = torch.empty(full_shape, dtype=torch.float32)
    init_fn(master)
    start = tp_rank(tp_group) * h_local
    local = master[start:start + h_local].to(dtype=dtype).contiguous()
    if device is not None:
        local = local.to(device)
    param = torch.nn.Parameter(local)
    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
    return param


def tp_replicated(param: torch.Tensor, tp_group: Optional[ProcessGroup] = None) -> torch.Tensor:
    """Use a TP-replicated parameter on head-sharded activations: its gradient is summed over
    ``tp_group``."""
    tp_group = tp_group_or_global(tp_group)
    if get_pg_size(tp_group) == 1:
        return param
    return copy_to_tensor_model_parallel_region(param, group=tp_group)


def mark_sequence_parallel(params: Iterable[torch.nn.Parameter], enabled: bool) -> None:
    """Mark replicated parameters that see sequence-sharded activations (norm weights under SP):
    ``finalize_model_grads`` all-reduces their gradients over TP."""
    for p in params:
        setattr(p, "sequence_parallel", bool(enabled))


def sharded_state_dict_with_head_params(module: torch.nn.Module, prefix: str,
                                        sharded_offsets: Tuple = (), metadata: Dict = None):
    """``MegatronModule.sharded_state_dict`` for modules with head-sharded parameters of their own.

    Own parameters marked ``tensor_model_parallel`` are saved TP-sharded along their
    ``partition_dim``; submodules use their own ``sharded_state_dict``.
    """
    from megatron.core.transformer.utils import sharded_state_dict_default  # noqa: PLC0415

    own = {}
    module._save_to_state_dict(own, "", keep_vars=True)
    axis_map = {name: getattr(t, "partition_dim", 0) for name, t in own.items()
                if getattr(t, "tensor_model_parallel", False)}
    out = make_sharded_tensors_for_checkpoint(own, prefix, axis_map, sharded_offsets)
    for name, child in module.named_children():
        out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata))
    return out
