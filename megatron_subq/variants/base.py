"""What a variant is: one self-describing unit (its slot spec, knob checks, FLOPs, capabilities)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from megatron.core.transformer.spec_utils import ModuleSpec


def _no_checks(config) -> None:
    return None


def _no_params(values) -> dict:
    return {}


def knob_error(field_name: str, value, allowed: str) -> None:
    """Raise the project's ValueError for a bad knob: ``field=value is invalid: allowed ...``."""
    raise ValueError(f"{field_name}={value!r} is invalid: allowed {allowed}")


def causal_pairs(L: int) -> int:
    """(query, key) pairs of full causal attention: L(L+1)/2."""
    return L * (L + 1) // 2


CONTEXT_PARALLEL_MODES = ("none", "all_to_all", "state_passing")
HOSTS = ("gpt", "hybrid")
DECODE_CACHES = ("none", "kv", "state", "stateless")


@dataclass(frozen=True)
class Variant:
    """One attention variant: everything the rest of the code asks about it.

    ``attention_spec(config, layer_number, provider)`` returns the ``ModuleSpec`` that fills the
    transformer layer's ``self_attention`` slot, from the module classes of ``provider`` (a
    megatron-core ``BackendSpecProvider``: ``column_parallel_linear()``, ``row_parallel_linear()``,
    ``core_attention()``, ``layer_norm()``): usually megatron's ``SelfAttention`` with the
    variant's ``core_attention``, or a module of the variant's own where it needs its own
    projections. Its modules take their process groups from the ``pg_collection`` megatron hands
    them and do not depend on ``GPTModel``, so the spec fits any host's attention slot
    (``slots.attention_slot_spec``); the Q/K-source variants also need the GPT host's stream
    layers (``model.StreamTransformerLayer``).

    Configuration (``SubqTransformerConfig.__post_init__`` calls these; each raises
    ``ValueError`` naming the field and the allowed values):

    * ``knobs``: the config fields it owns, as name prefixes (``"asa_"``); a checkpoint compares
      them only when a layer uses the variant.
    * ``check_knobs(config)``: range/type checks of its own knobs, run for **every** registered
      variant before megatron's checks, so a bad value fails even where the variant is unused.
    * ``resolve(config)``: derived defaults (e.g. ``asa_rank``) and the checks that need them,
      run after the layers are resolved, for the variants in use only.
    * ``derived_knobs(values)``: {field: value in use} for knobs whose default depends on other
      arguments (``values``: a config or the trainer's arguments); a checkpoint compares these
      instead of the stored field ({} = compare the fields as given).
    * ``validate(config)``: cross-field checks against megatron's fields, after ``resolve``,
      for the variants in use only.

    ``core_flops(config, L)``: forward FLOPs of the core attention of one layer over a sequence
    of L tokens (projections and MLP are counted by training/flops.py); None = counted as
    standard attention, and the trainer says so once.

    Capabilities (asked instead of names):

    * ``packed_sequences``: its attention takes megatron's packed (THD) sequences and keeps the
      documents apart (``--reset-attention-mask``).
    * ``fixed_input``: Q/K come from a fixed input carried as one extra batch row through the
      layers below (model.py); its FLOPs add one pass of that row per micro-batch.
    * ``qk_from_embeddings``: Q/K come from the batch's token embeddings (model.py's stream).
    * ``context_parallel``: how it runs under CP: "none" (refused), "all_to_all" (heads
      exchanged for sequence), "state_passing" (a recurrent state handed between ranks).
    * ``state_passing``: it also takes the state-passing CP path when the config asks for it
      (``context_parallel_scheme="state_passing"``): its core implements ``chunk_state`` and
      ``attend_from_state`` (an additive state: ``SubqCoreAttention`` sums it across ranks).
    * ``hosts``: the models it can sit in, from ("gpt", "hybrid").
    * ``own_input_norm``: it brings its own input norm (the host must not add one).
    * ``hf_param_map(config)``: {megatron parameter name: Hugging Face name} of its own
      parameters, for checkpoint conversion ({} = none yet).
    * ``decode_cache``: what its layers keep between decoding steps (docs/inference.md):
      "kv" (a cache of keys/values growing by one entry per token), "state" (a recurrent state
      of constant size), "stateless" (nothing: no token mixing), "none" (decoding refused).
      Its core implements ``new_decode_cache`` and ``attend_cached`` (``SubqCoreAttention``).
    """

    name: str
    summary: str
    attention_spec: Callable[..., ModuleSpec]
    validate: Callable[..., None] = _no_checks
    packed_sequences: bool = False
    knobs: Tuple[str, ...] = ()
    check_knobs: Callable[..., None] = _no_checks
    resolve: Callable[..., None] = _no_checks
    derived_knobs: Callable[..., dict] = _no_params
    core_flops: Optional[Callable[..., float]] = None
    fixed_input: bool = False
    qk_from_embeddings: bool = False
    context_parallel: str = "none"
    state_passing: bool = False
    hosts: Tuple[str, ...] = HOSTS
    own_input_norm: bool = False
    hf_param_map: Callable[..., dict] = _no_params
    decode_cache: str = "none"

    def cp_mode(self, config) -> str:
        """The context-parallel path of this variant's layers under ``config``: its own
        (``context_parallel``), or state passing where the config asks for it
        (``context_parallel_scheme``) and the variant offers it."""
        if getattr(config, "context_parallel_scheme", None) == "state_passing" \
                and self.state_passing:
            return "state_passing"
        return self.context_parallel

    def __post_init__(self):
        if self.context_parallel not in CONTEXT_PARALLEL_MODES:
            raise ValueError(f"Variant {self.name!r}: context_parallel={self.context_parallel!r} "
                             f"is invalid: allowed one of {CONTEXT_PARALLEL_MODES}")
        if self.decode_cache not in DECODE_CACHES:
            raise ValueError(f"Variant {self.name!r}: decode_cache={self.decode_cache!r} is "
                             f"invalid: allowed one of {DECODE_CACHES}")
        if not self.hosts or any(h not in HOSTS for h in self.hosts):
            raise ValueError(f"Variant {self.name!r}: hosts={self.hosts!r} is invalid: allowed a "
                             f"non-empty tuple from {HOSTS}")
