"""Decoding from a megatron_subq model with each variant's own cache (docs/inference.md).

``DecodeSession`` runs the host model (GPTModel or the hybrid's MambaModel) through megatron's
``StaticInferenceContext``: megatron advances RoPE and keeps the Mamba states; every attention
layer keeps what its variant declares (``Variant.decode_cache``: a KV cache, a constant-size
recurrent state, or nothing) through ``SubqSelfAttention`` and its core's ``attend_cached``.
``prefill`` feeds prompt tokens (in chunks), ``step`` one token per sequence; both return
full-vocabulary fp32 logits, the TP shards gathered, equal to ``full_logits`` on the whole
sequence. ``generate`` is the loop: greedy or sampled (temperature, top-k, top-p, seed), prompts of
different lengths, stopping at ``eos_id``.

Prompts of different lengths are decoded together without padding: the common prefix (the
shortest prompt) is prefilled as one batch, then every sequence advances one position per step,
fed its own next prompt token while it has one and its sampled token after, so each sequence's
cache holds exactly its own tokens.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from .scoring import model_device


# ------------------------------------------------------------------------------------------------
# what can decode
# ------------------------------------------------------------------------------------------------
def check_decodable(model: torch.nn.Module) -> None:
    """Raise a ValueError naming what prevents ``model`` from decoding: a variant without a
    decode cache, pipeline or context parallelism, sequence parallelism, flash_decode; before
    anything is allocated."""
    from ..variants import VARIANTS  # noqa: PLC0415

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "pre_process"):
        raise ValueError(f"model={type(model).__name__}: allowed a megatron GPTModel or "
                         "MambaModel built by megatron_subq (build_gpt_model, build_hybrid_model, "
                         "load_for_inference)")
    pp = getattr(config, "pipeline_model_parallel_size", 1) or 1
    if pp > 1 or not (model.pre_process and model.post_process):
        raise ValueError(f"pipeline_model_parallel_size={pp}: generation needs the whole model "
                         "on every rank; allowed 1 (load the checkpoint with PP = 1: "
                         "load_for_inference reshards it)")
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1:
        raise ValueError(f"context_parallel_size={cp}: decoding runs one token at a time, which "
                         "cannot be split over the sequence; allowed 1")
    if getattr(config, "sequence_parallel", False):
        raise ValueError("sequence_parallel=True: one decoded token cannot be split over the "
                         "tensor-parallel ranks; allowed False (load_for_inference(..., "
                         "sequence_parallel=False))")
    if getattr(config, "flash_decode", False):
        raise ValueError("flash_decode=True: megatron's flash decoding bypasses the variants' "
                         "caches; allowed False")
    for name in sorted({n for n in getattr(config, "layer_variants", []) if n is not None}):
        variant = VARIANTS[name]
        if variant.decode_cache != "none":
            continue
        if variant.fixed_input or variant.qk_from_embeddings:
            why = ("its queries/keys come from a fixed input row or the token embeddings, "
                   "carried as extra batch rows through every layer (StreamGPTModel); no decode "
                   "cache keeps those streams")
        else:
            why = "it declares no decode cache (Variant.decode_cache='none')"
        raise ValueError(f"attention variant {name!r} cannot generate: {why}. Allowed: "
                         "variants with a decode cache ("
                         + ", ".join(sorted(n for n, v in VARIANTS.items()
                                            if v.decode_cache != "none")) + ")")


def _tp_group(model):
    from ..parallel import process_groups  # noqa: PLC0415

    return process_groups(getattr(model, "pg_collection", None)).tp


# ------------------------------------------------------------------------------------------------
# the session: prefill and step
# ------------------------------------------------------------------------------------------------
class DecodeSession:
    """One batch of ``batch_size`` sequences of up to ``max_length`` tokens, decoded through
    ``model``'s caches (megatron's ``StaticInferenceContext`` holds them, per layer).

    ``prefill(tokens [b, C])`` and ``step(tokens [b])`` take token ids (torch.long, any device)
    and return fp32 logits over the padded vocabulary (TP shards gathered): of the last position
    ``[b, V]``, or of every position ``[b, C, V]`` with ``all_logits=True``. ``length`` is the
    number of positions consumed; ``reset()`` starts a new batch (the caches are rebuilt at
    position 0). Every TP rank must make the same calls with the same tokens.
    """

    def __init__(self, model: torch.nn.Module, batch_size: int, max_length: int):
        from megatron.core.inference.contexts import StaticInferenceContext  # noqa: PLC0415

        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeSession: {name}={value!r} is invalid: allowed an "
                                 "integer >= 1")
        check_decodable(model)
        self.model = model.eval()
        self.device = model_device(model)
        self.batch_size = batch_size
        self.max_length = max_length
        self.context = StaticInferenceContext(batch_size, max_length)
        # megatron's MambaMixer (mamba_impl 'megatron', or 'auto' on CUDA) takes a forward after
        # position 0 for a one-token decode step and asserts on more tokens: with it, a prompt
        # goes in as one prefill at position 0 (prefill refuses chunks and later prefills)
        from megatron.core.ssm.mamba_mixer import MambaMixer  # noqa: PLC0415

        self.one_prefill_only = any(isinstance(m, MambaMixer) for m in model.modules())

    @property
    def length(self) -> int:
        """Positions consumed so far (the next token's position)."""
        return self.context.sequence_len_offset

    def reset(self) -> None:
        """Forget the sequences: the next call starts at position 0 with fresh caches."""
        self.context.reset()

    def _tokens(self, tokens, what: str, dims: int) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.long \
                or tokens.dim() != dims or tokens.shape[0] != self.batch_size \
                or (dims == 2 and tokens.shape[1] < 1):
            shape = "[batch_size]" if dims == 1 else "[batch_size, C >= 1]"
            raise ValueError(f"DecodeSession.{what}: tokens must be a {shape} torch.long tensor "
                             f"with batch_size={self.batch_size}, got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} "
                             f"{tuple(getattr(tokens, 'shape', ()))}")
        return tokens.to(self.device)

    def _forward(self, tokens: torch.Tensor, all_logits: bool) -> torch.Tensor:
        ctx = self.context
        start, C = ctx.sequence_len_offset, tokens.shape[1]
        if start + C > self.max_length:
            raise ValueError(f"DecodeSession: positions up to {start + C} exceed max_length="
                             f"{self.max_length}")
        if C == 1 and start > 0:
            ctx.enable_decode_mode()
        else:
            ctx.enable_prefill_mode()
        ctx.materialize_only_last_token_logits = not all_logits
        positions = torch.arange(start, start + C, device=tokens.device).unsqueeze(0)
        logits = self.model(tokens, positions.expand_as(tokens), None, inference_context=ctx,
                            runtime_gather_output=True)
        ctx.sequence_len_offset = start + C
        return logits.float()

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, chunk: Optional[int] = None,
                all_logits: bool = False) -> torch.Tensor:
        """Feed ``tokens`` [batch_size, C] at the next C positions, ``chunk`` tokens per forward
        (default: all at once; a chunk bounds the activations of long prompts). Returns the last
        position's logits [b, V], or every position's [b, C, V] with ``all_logits``."""
        tokens = self._tokens(tokens, "prefill", 2)
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk < 1):
            raise ValueError(f"DecodeSession.prefill: chunk={chunk!r} is invalid: allowed None or "
                             "an integer >= 1")
        if self.length + tokens.shape[1] > self.max_length:
            raise ValueError(f"DecodeSession.prefill: {tokens.shape[1]} tokens after "
                             f"{self.length} exceed max_length={self.max_length}")
        size = tokens.shape[1] if chunk is None else chunk
        if self.one_prefill_only and (self.length > 0 or size < tokens.shape[1]):
            raise ValueError(
                f"DecodeSession.prefill: chunk={chunk!r} for {tokens.shape[1]} tokens after "
                f"{self.length} positions: the model's Mamba layers are megatron's MambaMixer, "
                "which continues from its states one token per forward only; allowed: the whole "
                "prompt as one prefill at position 0 (chunk=None or chunk >= its length; "
                "generate(prefill_chunk=None)), then step(), or a model built with "
                "mamba_impl='pytorch' (chunked prefill from the states)")
        outs = [self._forward(tokens[:, a:a + size], all_logits)
                for a in range(0, tokens.shape[1], size)]
        return torch.cat(outs, dim=1) if all_logits else outs[-1][:, -1]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per sequence (``tokens`` [batch_size]) at the next position; returns
        its logits [b, V]."""
        tokens = self._tokens(tokens, "step", 1)
        return self._forward(tokens[:, None], all_logits=False)[:, -1]


# ------------------------------------------------------------------------------------------------
# sampling
# ------------------------------------------------------------------------------------------------
def sample_tokens(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, generator: Optional[torch.Generator] = None
                  ) -> torch.Tensor:
    """Next tokens [b] from logits [b, V]: the argmax when ``temperature`` == 0, else a draw
    from softmax(logits / temperature) restricted to the ``top_k`` most likely tokens (0: all)
    and to the smallest set whose probability reaches ``top_p`` (1: all)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _check_generate_args(prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_id,
                         prefill_chunk, vocab_size) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(
            isinstance(p, (list, tuple)) and len(p) > 0 and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
            for p in prompts):
        raise ValueError("generate: prompts must be a non-empty list of non-empty lists of token "
                         "ids (integers >= 0)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r} is invalid: allowed an "
                         "integer >= 0")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"generate: temperature={temperature!r} is invalid: allowed a number "
                         ">= 0 (0: greedy)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"generate: top_k={top_k!r} is invalid: allowed an integer >= 0 (0: "
                         "no limit)")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p={top_p!r} is invalid: allowed a number in (0, 1]")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"generate: seed={seed!r} is invalid: allowed None or an integer")
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int)):
        raise ValueError(f"generate: eos_id={eos_id!r} is invalid: allowed None or a token id")
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool)
                                      or not isinstance(prefill_chunk, int) or prefill_chunk < 1):
        raise ValueError(f"generate: prefill_chunk={prefill_chunk!r} is invalid: allowed None "
                         "or an integer >= 1")
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"generate: vocab_size={vocab_size!r} is invalid: allowed None or "
                             "an integer >= 1")
        bad = max(max(p) for p in prompts)
        if bad >= vocab_size:
            raise ValueError(f"generate: prompt token {bad} is invalid: allowed ids < "
                             f"vocab_size={vocab_size}")


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: List[List[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: Optional[int] = None, eos_id: Optional[int] = None,
             prefill_chunk: Optional[int] = None,
             vocab_size: Optional[int] = None) -> List[List[int]]:
    """The new tokens of each prompt (lists of token ids), at most ``max_new_tokens`` each,
    a sequence stopping after ``eos_id`` (which is included).

    Greedy when ``temperature`` == 0, else sampled (``top_k``, ``top_p``) from a generator seeded
    with ``seed`` (None: torch's default generator; sampling is then not reproducible). Prompts
    are prefilled ``prefill_chunk`` tokens per forward (default: whole). ``vocab_size`` (e.g. the
    tokenizer's) keeps the padded vocabulary's extra rows from being chosen. Under tensor
    parallelism every rank passes the same arguments and gets the same tokens (TP rank 0's
    choice is broadcast)."""
    _check_generate_args(prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_id,
                         prefill_chunk, vocab_size)
    check_decodable(model)
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    lengths = [len(p) for p in prompts]
    shortest, batch = min(lengths), len(prompts)
    session = DecodeSession(model, batch, max(lengths) + max_new_tokens)
    device = session.device
    generator = None
    if temperature > 0 and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    tp_group = _tp_group(model)
    tp = dist.get_world_size(tp_group) if dist.is_initialized() and tp_group is not None else 1

    def choose(logits):
        if vocab_size is not None and vocab_size < logits.shape[-1]:
            logits = logits[:, :vocab_size]
        tokens = sample_tokens(logits, temperature, top_k, top_p, generator)
        if tp > 1:  # every rank continues with rank 0's tokens
            dist.broadcast(tokens, dist.get_global_rank(tp_group, 0), group=tp_group)
        return tokens

    prompt_rows = [torch.tensor(p, dtype=torch.long, device=device) for p in prompts]
    logits = session.prefill(torch.stack([p[:shortest] for p in prompt_rows]), prefill_chunk)
    out: List[List[int]] = [[] for _ in prompts]
    done = [False] * batch
    position = shortest
    while True:
        chosen = choose(logits).tolist()
        for b in range(batch):
            if position >= lengths[b] and not done[b]:  # a sampled token of sequence b
                out[b].append(chosen[b])
                done[b] = len(out[b]) >= max_new_tokens or (eos_id is not None
                                                            and chosen[b] == eos_id)
        if all(done):
            return out
        # next input: the prompt's own token while it lasts, else the token just chosen
        feed = [prompts[b][position] if position < lengths[b] else chosen[b]
                for b in range(batch)]
        logits = session.step(torch.tensor(feed, dtype=torch.long, device=device))
        position += 1
