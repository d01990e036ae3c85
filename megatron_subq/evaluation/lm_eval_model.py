"""The lm-evaluation-harness model ``megatron_subq``: a megatron_subq checkpoint's
loglikelihoods, rolling (perplexity) loglikelihoods and generations for ``lm_eval`` tasks.

    python -m megatron_subq.evaluation.lm_eval --model megatron_subq \
        --model_args load=runs/asa,max_length=2048 --tasks piqa,arc_easy --batch_size 8

Importing this module registers the class with lm-eval's model registry (``@register_model``);
lm-eval 0.4.13 finds no models outside its own tree, so its command line is run through
``megatron_subq.evaluation.lm_eval``, which imports this module first. Needs the ``eval`` extra
(``pip install -e ".[eval]"``). Scoring is the whole-sequence forward pass of
``megatron_subq.inference.full_logits``; generation is ``megatron_subq.inference.generate``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

log = logging.getLogger(__name__)

# generation keyword arguments of lm-eval tasks (a task's generation_kwargs, --gen_kwargs) that
# this model reads; any other key is reported once and ignored
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def _positive_int(name: str, value: Any, allow_none: bool = False) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "an integer >= 1" + (" or None" if allow_none else "")
        raise ValueError(f"{name}={value!r} is invalid: allowed {allowed}")
    return value


def _trainer_argument_names() -> set:
    from ..training.arguments import build_parser  # noqa: PLC0415

    return {a.dest for a in build_parser()._actions if a.dest != "help"}


@register_model("megatron_subq")
class MegatronSubqLM(TemplateLM):
    """A megatron_subq checkpoint as an lm-eval model (``--model megatron_subq``).

    ``--model_args``: ``load`` (checkpoint root, required), ``ckpt_step`` (default: the latest),
    ``batch_size`` (requests per forward pass, default 1; a ``--model_args`` value wins over
    lm-eval's ``--batch_size``), ``max_length`` (tokens per forward pass, default the
    checkpoint's ``seq_length``; longer inputs lose their oldest tokens), ``max_gen_toks``
    (default 256, a task's own value wins), ``tensor_model_parallel_size`` (default 1; run under
    torchrun, the world size a multiple of it, the other factor being data parallel),
    ``prefill_chunk`` and ``seed`` (passed to ``generate``); any other key is a trainer argument
    of the rebuilt model (e.g. ``bf16=True``, ``subq_impl=reference``). lm-eval's ``device`` is
    not used: the model is on this rank's GPU when there is one, else on the CPU.
    """

    backend = "causal"

    def __init__(self, load: Optional[str] = None, ckpt_step: Optional[int] = None,
                 batch_size: Any = 1, max_length: Optional[int] = None, max_gen_toks: int = 256,
                 tensor_model_parallel_size: int = 1, prefill_chunk: Optional[int] = None,
                 seed: Optional[int] = None, max_batch_size: Optional[int] = None,
                 device: Optional[str] = None, **overrides):
        super().__init__()
        from ..inference import load_for_inference  # noqa: PLC0415

        if not isinstance(load, str) or not load:
            raise ValueError(f"load={load!r}: --model_args needs load=DIR, a checkpoint root "
                             "(the folder holding latest_checkpointed_iteration.txt)")
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            raise ValueError(f"batch_size={batch_size!r} is invalid: allowed an integer >= 1 "
                             "(no automatic batch size)")
        self._batch_size = _positive_int("batch_size", batch_size)
        ckpt_step = _positive_int("ckpt_step", ckpt_step, allow_none=True)
        max_length = _positive_int("max_length", max_length, allow_none=True)
        self._max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        tensor_model_parallel_size = _positive_int("tensor_model_parallel_size",
                                                   tensor_model_parallel_size)
        self._prefill_chunk = _positive_int("prefill_chunk", prefill_chunk, allow_none=True)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed={seed!r} is invalid: allowed an integer or None")
        self._seed = seed
        runs_on = "cuda" if torch.cuda.is_available() else "cpu"
        if device is not None and str(device).split(":")[0] != runs_on:  # lm-eval's CLI: cuda:0
            log.info("megatron_subq: device=%s ignored; the model runs on %s", device, runs_on)
        unknown = sorted(set(overrides) - _trainer_argument_names())
        if unknown:
            raise ValueError(f"--model_args {', '.join(unknown)}: not arguments of this model "
                             "(allowed load, ckpt_step, batch_size, max_length, max_gen_toks, "
                             "tensor_model_parallel_size, prefill_chunk, seed, or a trainer "
                             "argument such as bf16 or subq_impl)")

        self._loaded = load_for_inference(load, ckpt_step, tensor_model_parallel_size,
                                          **overrides)
        self.model = self._loaded.model
        self._tokenizer = self._loaded.tokenizer
        args = self._loaded.args
        self._max_length = max_length or int(args.seq_length)
        limit = int(getattr(args, "max_position_embeddings", 0) or 0)
        if (getattr(args, "position_embedding_type", None) == "learned_absolute"
                and limit and self._max_length > limit):
            self.close()
            raise ValueError(f"max_length={self._max_length} exceeds the checkpoint's learned "
                             f"position embeddings (max_position_embeddings={limit})")
        self._device = next(self.model.parameters()).device
        self._dp_group = None
        if torch.distributed.is_initialized() and (torch.distributed.get_world_size()
                                                   > tensor_model_parallel_size):
            from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: PLC0415

            self._dp_group = ProcessGroupCollection.use_mpu_process_groups(
                required_pgs=["dp"]).dp
            self._rank = torch.distributed.get_rank(self._dp_group)
            self._world_size = torch.distributed.get_world_size(self._dp_group)
        self._warned_gen_kwargs: set = set()

    # ------------------------------------------------------------------ lm-eval's interface
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None):
        """``--model_args`` (key=value,...) over lm-eval's own batch_size/device defaults: a key
        given in both is taken from ``arg_string``."""
        from lm_eval.utils import simple_parse_args_string  # noqa: PLC0415

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: Dict[str, Any],
                            additional_config: Optional[dict] = None):
        """As ``create_from_arg_string``, from a dict."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    @property
    def eot_token_id(self) -> int:
        """The tokenizer's end-of-document id: documents were separated by it in training, so it
        is also the prefix of an empty context and of rolling windows."""
        return int(self._tokenizer.eod)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self._loaded.args, "tokenizer_model", None) or
                   getattr(self._loaded.args, "tokenizer_type", "")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   **kwargs) -> List[int]:
        """The checkpoint tokenizer's ids of ``string`` (it adds no BOS/EOS)."""
        return [int(t) for t in self._tokenizer.tokenize(string)] if string else []

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self._tokenizer.detokenize([int(t) for t in tokens])

    def close(self) -> None:
        """Free the parallel state (and the process group if loading created it)."""
        from ..inference import unload  # noqa: PLC0415

        if getattr(self, "_loaded", None) is not None:
            unload(self._loaded)
            self._loaded = None

    # data-parallel collectives for lm-eval's evaluator (rank/world_size are the DP ones)
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._dp_group is None:
            return tensor
        flat = tensor.reshape(1) if tensor.dim() == 0 else tensor
        parts = [torch.empty_like(flat) for _ in range(self._world_size)]
        torch.distributed.all_gather(parts, flat.contiguous(), group=self._dp_group)
        return torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self._dp_group is None:
            return [obj]
        out = [None] * self._world_size if self._rank == dst else None
        torch.distributed.gather_object(obj, out, dst=torch.distributed.get_global_rank(
            self._dp_group, dst), group=self._dp_group)
        return out

    def barrier(self) -> None:
        if self._dp_group is not None:
            torch.distributed.barrier(group=self._dp_group)

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> List[Tuple[float, bool]]:
        """(sum of log p(continuation | context), is_greedy) per (key, context ids,
        continuation ids) request. Longest first, ``batch_size`` rows per forward pass (right
        padded: causal, so padding changes no scored logit), results in request order. The
        input is context + continuation less its last token, cut from the left at
        ``max_length``."""
        from ..inference import full_logits  # noqa: PLC0415

        results: List[Optional[Tuple[float, bool]]] = [None] * len(requests)
        order = sorted(range(len(requests)),
                       key=lambda i: (-(len(requests[i][1]) + len(requests[i][2])),
                                      tuple(requests[i][1]) + tuple(requests[i][2])))
        for start in tqdm(range(0, len(order), self._batch_size), disable=disable_tqdm or
                          self.rank != 0, desc="megatron_subq loglikelihood"):
            rows = []
            for i in order[start:start + self._batch_size]:
                key, context, continuation = requests[i]
                if len(continuation) > self._max_length:
                    raise ValueError(f"a continuation of {len(continuation)} tokens is longer "
                                     f"than max_length={self._max_length} (request {key!r})")
                if not continuation:
                    results[i] = (0.0, True)
                    continue
                context = list(context) or [self.prefix_token_id]
                rows.append((i, key, (context + list(continuation))[-(self._max_length + 1):-1],
                             list(continuation)))
            if not rows:
                continue
            width = max(len(r[2]) for r in rows)
            tokens = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
            for r, (_, _, inp, _) in enumerate(rows):
                tokens[r, :len(inp)] = torch.tensor(inp, dtype=torch.long)
            logits = full_logits(self.model, tokens)
            for r, (i, key, inp, continuation) in enumerate(rows):
                scored = logits[r, len(inp) - len(continuation):len(inp)]
                target = torch.tensor(continuation, dtype=torch.long, device=scored.device)
                logp = torch.log_softmax(scored, dim=-1).gather(-1, target[:, None]).sum()
                answer = (float(logp), bool((scored.argmax(dim=-1) == target).all()))
                results[i] = answer
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, answer)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """log p(document) per request, every token scored once: disjoint windows of
        ``max_length`` predictions (lm-eval's ``get_rolling_token_windows`` with one token of
        context), the first conditioned on ``eot_token_id``."""
        windows, owner = [], []
        for n, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length, context_len=1)):
                windows.append((None, context, continuation))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[n] += logp
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def _generation_settings(self, gen_kwargs: Dict[str, Any]) -> Dict[str, Any]:
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"generate_until: gen_kwargs must be a dict, got {gen_kwargs!r}")
        until = gen_kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        if not isinstance(until, (list, tuple)) or not all(isinstance(u, str) for u in until):
            raise ValueError(f"until={until!r} is invalid: allowed a string or a list of strings")
        max_gen = _positive_int("max_gen_toks", gen_kwargs.get("max_gen_toks",
                                                               self._max_gen_toks))
        if max_gen >= self._max_length:
            raise ValueError(f"max_gen_toks={max_gen} leaves no room for the prompt in "
                             f"max_length={self._max_length}")
        temperature = float(gen_kwargs.get("temperature", 0.0) or 0.0)
        do_sample = gen_kwargs.get("do_sample")
        sample = bool(do_sample) if do_sample is not None else temperature > 0
        for key in sorted(set(gen_kwargs) - set(GEN_KWARGS) - self._warned_gen_kwargs):
            log.warning("megatron_subq: generation argument %s=%r is ignored (read: %s)", key,
                        gen_kwargs[key], ", ".join(GEN_KWARGS))
            self._warned_gen_kwargs.add(key)
        return dict(until=[u for u in until if u], max_new_tokens=max_gen,
                    temperature=(temperature or 1.0) if sample else 0.0,
                    top_k=int(gen_kwargs.get("top_k", 0) or 0) if sample else 0,
                    top_p=float(gen_kwargs.get("top_p", 1.0) or 1.0) if sample else 1.0)

    def _new_text(self, prompt: List[int], new: List[int]) -> str:
        """The text ``new`` adds after ``prompt`` (decoded together: a SentencePiece word's
        leading space survives)."""
        head = self.tok_decode(prompt)
        whole = self.tok_decode(prompt + new)
        return whole[len(head):] if whole.startswith(head) else self.tok_decode(new)

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """The continuation of each (context, gen_kwargs) request: ``generate`` (greedy unless
        ``do_sample``/``temperature`` > 0) for at most ``max_gen_toks`` tokens, stopped at EOD,
        cut before the first of the ``until`` strings. Prompts are cut from the left to
        ``max_length - max_gen_toks`` tokens; requests with equal settings are batched, longest
        first."""
        from megatron_subq.inference import generate  # noqa: PLC0415

        results: List[Optional[str]] = [None] * len(requests)
        groups: Dict[str, List[Tuple[int, List[int], Dict[str, Any]]]] = {}
        for i, request in enumerate(requests):
            context, gen_kwargs = request.args
            settings = self._generation_settings(gen_kwargs)
            prompt = self.tok_encode(context)
            prompt = prompt[-(self._max_length - settings["max_new_tokens"]):] or [
                self.prefix_token_id]
            groups.setdefault(json.dumps(settings, sort_keys=True), []).append(
                (i, prompt, settings))
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="megatron_subq generate_until")
        eod = self.eot_token_id
        for members in groups.values():
            members.sort(key=lambda m: (-len(m[1]), tuple(m[1])))
            settings = members[0][2]
            for start in range(0, len(members), self._batch_size):
                batch = members[start:start + self._batch_size]
                outputs = generate(self.model, [m[1] for m in batch], settings["max_new_tokens"],
                                   temperature=settings["temperature"], top_k=settings["top_k"],
                                   top_p=settings["top_p"], seed=self._seed, eos_id=eod,
                                   prefill_chunk=self._prefill_chunk,
                                   vocab_size=self._tokenizer.vocab_size)
                for (i, prompt, _), new in zip(batch, outputs):
                    new = [int(t) for t in new]
                    if eod in new:
                        new = new[:new.index(eod)]
                    text = self._new_text(prompt, new)
                    for stop in settings["until"]:
                        text = text.split(stop)[0]
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return results  # type: ignore[return-value]


__all__ = ["MegatronSubqLM", "GEN_KWARGS"]
