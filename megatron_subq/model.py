"""GPT with extra hidden-state streams for the QK-source variants (deconstructing attention §3.4f).

``rnd_emb_qk`` / ``fixed_seq_qk`` need, at each of their layers, the hidden state of a *fixed
input* (random ε / the embedding of a fixed text) that has run through all layers below;
``static_emb_qk`` needs the token embeddings of the batch (the embedding output before layer 1).
Both are carried as **extra rows along the batch dimension of the hidden states** between layers:

    hidden entering layer n:  [ real rows (b) | fixed rows (one per fixed-input variant) |
                                embedding-layer output of all those rows, only if a
                                static_emb_qk layer is >= n ]

``stream_layout(config, n)`` says which streams enter layer n: a stream is carried while some
layer >= n consumes it and dropped after its last consumer. Why this layout:

* The fixed rows *are* inputs that run through the same layers, so every layer (norms, MLP,
  standard attention, any other variant) processes them as ordinary batch rows: the fixed input
  costs one extra row per micro-batch, not one per sample, and its activations and gradients come
  from autograd like any row's (see docs/variants.md for why gradients do flow through it).
* The embedding rows must not be transformed; ``StreamTransformerLayer`` splits them off before
  the layer and puts them back after it (one copy per layer), so the layer never sees them. There
  is one per main row: a fixed input is an input too, and at a static_emb_qk layer its Q, K come
  from its own embedding-layer output (ε / the embedded text), like a sample's.
* Everything that moves hidden states between layers moves the streams too, with no change to
  megatron: the block's layer loop, full activation recompute (the packed tensor is the
  checkpoint input, so a recomputed layer sees its streams again), and pipeline p2p (one tensor;
  its shape is ``[s, b + extra, h]``, so the QK-source variants turn on megatron's
  ``variable_seq_lengths`` under PP, which sends the shape first — a few bytes per message).
* Under SP every row is sequence-sharded alike, so the streams need no SP handling of their own.

``StreamGPTModel`` attaches the streams after the embedding (first pipeline stage) and otherwise
is megatron's ``GPTModel``; ``build_gpt_model`` uses it only when a QK-source layer is present.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Tuple

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import get_pg_size

from .variants import VARIANTS, embedding_qk_variants, fixed_input_variants
from .variants.fixed_seq_qk import load_fixed_tokens
from .variants.qk_source import QKSource, QKSourceAttention


@dataclass(frozen=True)
class StreamLayout:
    """The extra streams packed after the real rows of a hidden-state tensor."""

    fixed_rows: Tuple[str, ...] = ()
    embeddings: bool = False

    @property
    def empty(self) -> bool:
        return not self.fixed_rows and not self.embeddings

    def real_batch(self, packed_batch: int) -> int:
        """b, from the packed batch size ``(b + len(fixed_rows)) · (2 if embeddings else 1)``."""
        main = packed_batch // 2 if self.embeddings else packed_batch
        b = main - len(self.fixed_rows)
        if b < 1 or (self.embeddings and packed_batch % 2):
            raise ValueError(f"a hidden-state batch of {packed_batch} rows does not fit the stream "
                             f"layout {self}")
        return b


def stream_layout(config, layer_number: int) -> StreamLayout:
    """Streams carried into global layer ``layer_number`` (1-based; ``num_layers + 1`` is the
    output of the last layer, which carries none)."""
    if getattr(config, "skip_variant_layers", False):
        return StreamLayout()  # the ablation removes every consumer
    later = set(config.layer_variants[layer_number - 1:])
    # the registry's Variant.fixed_input / qk_from_embeddings, fixed rows in registry order
    return StreamLayout(fixed_rows=tuple(v for v in fixed_input_variants() if v in later),
                        embeddings=any(v in later for v in embedding_qk_variants()))


def uses_qk_streams(config) -> bool:
    return not stream_layout(config, 1).empty


class StreamTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` whose hidden states carry the streams of ``stream_layout``.

    It runs the layer on the real and fixed rows, hands its attention the Q/K source when the
    layer is a QK-source variant, drops the streams no later layer needs and puts the embedding
    rows back unchanged.
    """

    def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        # self.layer_number is global (pipeline offset included)
        self.layout_in = stream_layout(config, self.layer_number)
        self.layout_out = stream_layout(config, self.layer_number + 1)
        self.variant = config.layer_variants[self.layer_number - 1]
        variant = VARIANTS[self.variant]
        self.fixed_input, self.embedding_qk = variant.fixed_input, variant.qk_from_embeddings
        if (self.fixed_input or self.embedding_qk) and not self.layout_in.empty:
            if not isinstance(self.self_attention, QKSourceAttention):
                raise TypeError(f"layer {self.layer_number} ({self.variant}) needs a "
                                f"QKSourceAttention, got {type(self.self_attention).__name__}")

    def forward(self, hidden_states, *args, **kwargs):
        layout_in, layout_out = self.layout_in, self.layout_out
        if layout_in.empty:
            return super().forward(hidden_states, *args, **kwargs)
        b = layout_in.real_batch(hidden_states.shape[1])
        n_main = b + len(layout_in.fixed_rows)
        if layout_in.embeddings:
            # copies, so that nothing saved for backward pins the whole packed tensor
            main = hidden_states[:, :n_main].contiguous()
            embeddings = hidden_states[:, n_main:].contiguous()
        else:
            main, embeddings = hidden_states, None

        source = None
        if self.fixed_input:
            source = QKSource(row=b + layout_in.fixed_rows.index(self.variant))
        elif self.embedding_qk:
            # the embeddings go through this layer's own input norm, as its input does
            source = QKSource(hidden=self.input_layernorm(embeddings))
        if source is None:
            output, context = super().forward(main, *args, **kwargs)
        else:
            with self.self_attention.use_qk_source(source):
                output, context = super().forward(main, *args, **kwargs)

        if layout_out.fixed_rows == layout_in.fixed_rows and not layout_out.embeddings:
            return output, context
        kept_rows = [b + layout_in.fixed_rows.index(name) for name in layout_out.fixed_rows]
        streams = [output] + ([embeddings] if layout_out.embeddings else [])
        parts = []
        for stream in streams:  # the embedding rows follow the main rows one to one
            parts.append(stream[:, :b])
            parts.extend(stream[:, row:row + 1] for row in kept_rows)
        # a fresh (viewless) tensor: pipeline schedules free a stage's output storage after sending
        return torch.cat(parts, dim=1), context


def with_stream_layers(spec):
    """The block spec with every ``TransformerLayer`` replaced by ``StreamTransformerLayer``."""
    def swap(layer_spec):
        if layer_spec.module is not TransformerLayer:
            raise TypeError(f"the QK-source variants need TransformerLayer layer specs, got "
                            f"{layer_spec.module}")
        return dataclasses.replace(layer_spec, module=StreamTransformerLayer)

    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[swap(s) for s in spec.layer_specs])
    return swap(spec)


def draw_fixed_noise(config, rows: int) -> torch.Tensor:
    """ε for rnd_emb_qk: ``[rows, hidden]`` ~ N(0, init_method_std²) from ``fixed_qk_seed``.

    Drawn row-major on the CPU generator, so the first L rows are the same for every ``rows``
    >= L (a shorter sequence sees a prefix of the same ε) and on every rank.
    """
    g = torch.Generator().manual_seed(config.fixed_qk_seed)
    return torch.randn(rows, config.hidden_size, generator=g) * config.init_method_std


class StreamGPTModel(GPTModel):
    """megatron's ``GPTModel`` whose decoder carries the QK-source streams (module docstring).

    Fixed inputs, never trained and not saved in checkpoints (they are rebuilt from the config):
    ``fixed_qk_noise`` (ε, ``[max_sequence_length, hidden]``) and ``fixed_qk_tokens`` (the fixed
    text's token ids), on the first pipeline stage only.
    """

    def __init__(self, config, transformer_layer_spec, *args, **kwargs):
        super().__init__(config, with_stream_layers(transformer_layer_spec), *args, **kwargs)
        self.entry_layout = stream_layout(config, 1)
        if not self.pre_process:
            return
        device = None
        if torch.cuda.is_available() and not config.use_cpu_initialization:
            device = torch.cuda.current_device()
        if "rnd_emb_qk" in self.entry_layout.fixed_rows:
            noise = draw_fixed_noise(config, self.max_sequence_length).to(config.params_dtype)
            self.register_buffer("fixed_qk_noise", noise.to(device), persistent=False)
        if "fixed_seq_qk" in self.entry_layout.fixed_rows:
            tokens = load_fixed_tokens(config.fixed_qk_tokens_file)
            if tokens.numel() < self.max_sequence_length:
                raise ValueError(
                    f"fixed_qk_tokens_file={config.fixed_qk_tokens_file!r} holds {tokens.numel()} "
                    f"tokens, fewer than max_sequence_length={self.max_sequence_length}; allowed: "
                    "a text at least as long as the longest sequence (a shorter sequence uses its "
                    "prefix)")
            if int(tokens.max()) >= self.vocab_size:
                raise ValueError(
                    f"fixed_qk_tokens_file={config.fixed_qk_tokens_file!r} holds token id "
                    f"{int(tokens.max())}; allowed: ids < vocab_size={self.vocab_size}")
            self.register_buffer("fixed_qk_tokens", tokens.to(device), persistent=False)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        if inference_context is not None:
            raise NotImplementedError("KV-cache inference is not implemented for the QK-source "
                                      "variants (rnd_emb_qk, fixed_seq_qk, static_emb_qk)")
        if packed_seq_params is not None or padding_mask is not None:
            raise NotImplementedError("packed sequences / padding masks are not supported with the "
                                      "QK-source variants")
        out = super()._preprocess(input_ids=input_ids, position_ids=position_ids,
                                  decoder_input=decoder_input, inference_context=inference_context,
                                  packed_seq_params=packed_seq_params, padding_mask=padding_mask)
        if not self.pre_process:
            return out  # later pipeline stages receive the streams packed from the previous one
        return (self.attach_streams(out[0]),) + tuple(out[1:])

    def attach_streams(self, embedded: torch.Tensor) -> torch.Tensor:
        """``[s_local, b, h]`` embedding output -> the packed hidden states entering layer 1."""
        tp = get_pg_size(self.pg_collection.tp)
        seq = embedded.shape[0] * (tp if self.config.sequence_parallel else 1)
        parts = [embedded]
        for name in self.entry_layout.fixed_rows:
            parts.append(self.fixed_input(name, seq).to(embedded.dtype))
        main = torch.cat(parts, dim=1)
        # the embedding-layer output of every main row, for static_emb_qk's Q/K
        return torch.cat([main, main], dim=1) if self.entry_layout.embeddings else main

    def fixed_input(self, name: str, seq: int) -> torch.Tensor:
        """The embedded fixed input of variant ``name`` for a sequence of length ``seq``:
        ``[seq, 1, h]``, sequence-sharded under SP like the embedding output."""
        if name == "rnd_emb_qk":
            if seq > self.fixed_qk_noise.shape[0]:
                raise ValueError(f"sequence length {seq} is longer than max_sequence_length="
                                 f"{self.fixed_qk_noise.shape[0]} (the length ε was drawn for)")
            noise = self.fixed_qk_noise[:seq].unsqueeze(1)
            if self.config.sequence_parallel:
                noise = scatter_to_sequence_parallel_region(noise, group=self.pg_collection.tp)
            return noise
        if name == "fixed_seq_qk":
            if seq > self.fixed_qk_tokens.numel():
                raise ValueError(f"sequence length {seq} is longer than the fixed text "
                                 f"({self.fixed_qk_tokens.numel()} tokens of fixed_qk_tokens_file)")
            ids = self.fixed_qk_tokens[:seq].unsqueeze(0)
            positions = torch.arange(seq, device=ids.device).unsqueeze(0)
            return self.embedding(input_ids=ids, position_ids=positions)
        raise ValueError(f"name={name!r} is invalid: allowed {fixed_input_variants()}")


def model_class(config) -> type:
    """``StreamGPTModel`` when a QK-source layer is present, else megatron's ``GPTModel``."""
    return StreamGPTModel if uses_qk_streams(config) else GPTModel


__all__ = ["StreamGPTModel", "StreamLayout", "StreamTransformerLayer", "draw_fixed_noise",
           "model_class", "stream_layout", "uses_qk_streams", "with_stream_layers"]

