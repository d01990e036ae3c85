"""Helpers for "TP=N (with or without SP) and PP=N equal TP=1" tests, shared by every variant.

``tiny_gpt_step(cfg_kwargs, data)`` builds a small GPT with ``build_gpt_model`` inside an already
initialised parallel state, runs one forward/backward on fixed data and returns what a TP=1 run
must reproduce: the full logits, the loss and every parameter's full gradient (TP shards
gathered, SP partial gradients summed — as ``finalize_model_grads`` would), keyed by name.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from ..config import SubqTransformerConfig
from ..specs import build_gpt_model

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=128, use_cpu_initialization=True, params_dtype=torch.float32)


def make_batch(vocab: int, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), pos.contiguous()


def gather_full_grads(model: torch.nn.Module, config) -> Dict[str, torch.Tensor]:
    """Every parameter's full gradient: TP shards concatenated, SP partial grads summed."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().clone()
        if config.sequence_parallel and getattr(p, "sequence_parallel", False) and tp > 1:
            dist.all_reduce(g, group=tp_group)
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=tp_group)
            # a strided shard (SwiGLU's fc1: [gate_r; up_r]) interleaves with the other ranks'
            stride, dim = getattr(p, "partition_stride", 1), p.partition_dim
            chunks = [part.chunk(stride, dim=dim) for part in parts]
            g = torch.cat([c[s] for s in range(stride) for c in chunks], dim=dim)
        out[name] = g
    return out


def tiny_gpt_step(cfg_kwargs: dict, vocab: int = 128, batch: int = 2, seq: int = 16,
                  data_seed: int = 0) -> dict:
    """One forward/backward of a tiny GPT under the current parallel state (call inside a rank)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    kwargs = {**TINY, **cfg_kwargs, "tensor_model_parallel_size": tp}
    config = SubqTransformerConfig(**kwargs)
    model = build_gpt_model(config, vocab_size=vocab, max_sequence_length=seq)
    tokens, labels, pos = make_batch(vocab, batch, seq, data_seed)
    loss = model(tokens, pos, None, labels=labels)  # [b, s]
    loss.mean().backward()
    with torch.no_grad():
        logits = model(tokens, pos, None)  # [b, s, v/tp]
        logits = gather_from_tensor_model_parallel_region(logits)
    return {"loss": loss.detach(), "logits": logits.detach(),
            "grads": gather_full_grads(model, config)}


def tiny_gpt_cp_step(cfg_kwargs: dict, vocab: int = 128, batch: int = 2, seq: int = 16,
                     data_seed: int = 0) -> dict:
    """``tiny_gpt_step`` under context parallelism (and any TP): each CP rank takes its zig-zag
    share of the batch (megatron's ``get_batch_on_this_cp_rank``), backpropagates its share of
    the global mean loss, and the CP ranks' gradients are summed (what the DP x CP reduction of
    megatron's DDP does). Returns the full per-token loss ``[b, s]`` in natural order and every
    parameter's full gradient, comparable with ``tiny_gpt_step``'s."""
    from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: PLC0415

    from ..attention import zigzag_chunks  # noqa: PLC0415

    tp = parallel_state.get_tensor_model_parallel_world_size()
    cp_group = parallel_state.get_context_parallel_group()
    cp = parallel_state.get_context_parallel_world_size()
    kwargs = {**TINY, **cfg_kwargs, "tensor_model_parallel_size": tp,
              "context_parallel_size": cp}
    config = SubqTransformerConfig(**kwargs)
    model = build_gpt_model(config, vocab_size=vocab, max_sequence_length=seq)
    tokens, labels, pos = make_batch(vocab, batch, seq, data_seed)
    local = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels,
                                       "position_ids": pos}, cp_group)
    loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
    (loss.sum() / (batch * seq)).backward()
    grads = gather_full_grads(model, config)
    for g in grads.values():
        dist.all_reduce(g, group=cp_group)
    parts = [torch.empty_like(loss) for _ in range(cp)]
    dist.all_gather(parts, loss.detach().contiguous(), group=cp_group)
    zigzag = torch.cat(parts, dim=1).view(batch, 2 * cp, seq // (2 * cp))
    order = zigzag_chunks(cp)
    full = zigzag[:, [order.index(c) for c in range(2 * cp)]].reshape(batch, seq)
    return {"loss": full, "grads": grads}


def global_param_names(model: torch.nn.Module) -> Dict[str, str]:
    """Local parameter name -> name in the unsplit model (pipeline stages renumber layers)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: PLC0415

    prefixes = {}
    for mname, m in model.named_modules():
        if isinstance(m, TransformerLayer):
            head, _, local = mname.rpartition(".")
            prefixes[mname + "."] = f"{head}.{m.layer_number - 1}."
    out = {}
    for pname, _ in model.named_parameters():
        gname = pname
        for local, glob in prefixes.items():
            if pname.startswith(local):
                gname = glob + pname[len(local):]
                break
        out[pname] = gname
    return out


def reinit_by_global_name(model: torch.nn.Module, std: float = 0.05) -> None:
    """Deterministic weights keyed by global name, so PP stages match the unsplit model (TP=1)."""
    import zlib  # noqa: PLC0415

    names = global_param_names(model)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(names[pname].encode()))
            noise = torch.randn(p.shape, generator=g) * std
            p.copy_(noise + (1.0 if "layernorm" in pname or "norm" in pname else 0.0))


def tiny_gpt_pipeline_losses(cfg_kwargs: dict, vocab: int = 128, micro_batch: int = 2,
                             seq: int = 16, num_microbatches: int = 2) -> list:
    """Per-microbatch losses of one forward/backward through megatron's pipeline schedule.

    Works for any PP size (PP=1 uses the no-pipelining schedule); the last stage returns the
    losses, other stages an empty list.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    kwargs = {**TINY, "num_layers": 4, **cfg_kwargs, "tensor_model_parallel_size": tp,
              "pipeline_model_parallel_size": pp, "pipeline_dtype": torch.float32}
    config = SubqTransformerConfig(**kwargs)
    model = build_gpt_model(config, vocab_size=vocab, max_sequence_length=seq)
    reinit_by_global_name(model)
    batches = [make_batch(vocab, micro_batch, seq, seed) for seed in range(num_microbatches)]

    def forward_step(data_iterator, model):
        tokens, labels, pos = next(data_iterator)
        output = model(tokens, pos, None, labels=labels)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=num_microbatches, seq_length=seq, micro_batch_size=micro_batch,
        forward_only=False)
    return [d["loss"] for d in losses] if losses else []


def repeating_batch(vocab: int = 64, batch: int = 4, seq: int = 32, period: int = 8, seed: int = 0):
    """(tokens, labels, position_ids) of random ``period``-token prefixes repeated along the
    sequence: after the first period only token mixing (attention) can predict the next token."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (batch, period), generator=g)
    full = prefix.repeat(1, seq // period + 1)[:, :seq + 1]
    pos = torch.arange(seq).expand(batch, seq).contiguous()
    return full[:, :-1].contiguous(), full[:, 1:].contiguous(), pos


def fit_repeating_batch(model: torch.nn.Module, steps: int, lr: float = 3e-3, **batch_kwargs) -> list:
    """Train ``model`` with Adam on one ``repeating_batch`` for ``steps`` steps; the losses.

    The training smoke test of every variant: a working variant drives the loss far down."""
    tokens, labels, pos = repeating_batch(**batch_kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(tokens, pos, None, labels=labels).float().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# layout name -> (TP, PP, sequence parallel); "tp1"/"pp1" are the references (a world of one)
LAYOUTS = {"tp1": (1, 1, False), "pp1": (1, 1, False), "tp2": (2, 1, False),
           "tp2-sp": (2, 1, True), "pp2": (1, 2, False)}
# context-parallel layouts: name -> (TP, CP, sequence parallel), run by ``tiny_gpt_cp_step``
CP_LAYOUTS = {"cp2": (1, 2, False), "cp2-tp2": (2, 2, False), "cp2-tp2-sp": (2, 2, True)}


def every_case_every_layout(cases: list, layouts: list, seed: int = 1234) -> dict:
    """{case name: {layout: result}} for ``cases`` ([(name, config kwargs)]) at each of
    ``layouts`` (keys of ``LAYOUTS`` or ``CP_LAYOUTS``), all in this one world (re-initialised between them, as a
    fresh ``run_distributed`` rank would be): ``tiny_gpt_step`` for the TP layouts,
    ``tiny_gpt_pipeline_losses`` for the PP ones. A failure is kept as ("error", traceback) for
    that case and layout alone, so one test per case reports its own. One process launch
    instead of one per case and layout (launches dominate the CPU suite's time)."""
    import traceback  # noqa: PLC0415

    from .distributed import reinit_parallel  # noqa: PLC0415

    out = {}
    for name, kwargs in cases:
        out[name] = {}
        for layout in layouts:
            try:
                if layout in CP_LAYOUTS:
                    tp, cp, sp = CP_LAYOUTS[layout]
                    reinit_parallel(tp, 1, seed, context_parallel_size=cp)
                    out[name][layout] = tiny_gpt_cp_step({**kwargs, "sequence_parallel": sp})
                    continue
                tp, pp, sp = LAYOUTS[layout]
                reinit_parallel(tp, pp, seed)
                if layout.startswith("pp"):
                    out[name][layout] = tiny_gpt_pipeline_losses(kwargs)
                else:
                    out[name][layout] = tiny_gpt_step({**kwargs, "sequence_parallel": sp})
            except Exception:  # noqa: BLE001 - reported by that case's test
                out[name][layout] = ("error", traceback.format_exc())
    return out
