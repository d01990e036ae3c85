"""Helpers for "the hybrid host under TP / SP / PP / EP equals TP=1" tests.

``parallel_layouts_step(layouts, ...)`` runs inside a ``run_distributed`` world: for each layout
(a dict of ``tp``, ``pp``, ``ep``, ``sp``) it re-initialises megatron's parallel state, builds the
tiny hybrid of ``hybrid_test_config``, gives it the same weights as every other layout
(``init_by_global_name``: each full tensor drawn from its *global* name, then this rank's shard
taken), runs one training step exactly as the trainer does — megatron's DDP, its
forward-backward schedule, ``finalize_model_grads`` (DP/EP gradient reduction, SP norm sums,
the router's expert-bias update) — and returns the loss, every parameter's full gradient and
every router's expert bias, keyed by global name. The weights and the data are the same in every
layout, so all layouts must agree with the TP=1, PP=1, EP=1 one (whose data-parallel average
over the world equals one device on the whole batch).
"""

from __future__ import annotations

import os
import zlib
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from ..config import SubqTransformerConfig
from .cases import VARIANT_TEST_SETTINGS
from .distributed import reinit_parallel

HYBRID_TEST_PATTERN = "M*E*-M*E"
"""Every symbol; attention slots at layers 2, 4 and 7 (PP=2 puts two on the first stage)."""
HYBRID_TEST_SLOTS = ["standard", "superlinear", "asa"]


def hybrid_test_config(tp: int = 1, pp: int = 1, ep: int = 1, sp: bool = False,
                       **overrides) -> SubqTransformerConfig:
    """The tiny-hybrid preset with ``HYBRID_TEST_PATTERN`` and the three test variants in its
    slots (their ``VARIANT_TEST_SETTINGS``), float32, at these parallel sizes."""
    from ..hybrid import hybrid_preset  # noqa: PLC0415

    knobs = {}
    for name in HYBRID_TEST_SLOTS:
        knobs.update(VARIANT_TEST_SETTINGS[name])
    kwargs = dict(num_layers=len(HYBRID_TEST_PATTERN), hybrid_override_pattern=HYBRID_TEST_PATTERN,
                  layer_pattern=list(HYBRID_TEST_SLOTS), use_cpu_initialization=True,
                  tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                  expert_model_parallel_size=ep, sequence_parallel=sp,
                  pipeline_dtype=torch.float32, moe_router_bias_update_rate=1e-2, **knobs)
    kwargs.update(overrides)
    config, _ = hybrid_preset("tiny-hybrid", **kwargs)
    return config


# ---------------------------------------------------------------------------------------------
# global names and TP shards
# ---------------------------------------------------------------------------------------------
def global_names(model: torch.nn.Module) -> Dict[str, str]:
    """Local name -> name in the unsplit model: pipeline stages renumber layers
    (``decoder.layers.<i>`` -> the layer's global index) and expert parallelism renumbers
    experts (``local_experts.<j>`` -> the global expert index)."""
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    out: Dict[str, str] = {}
    layers = dict(model.named_modules())
    for pname, _ in list(model.named_parameters()) + list(model.named_buffers()):
        parts = pname.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            layer = layers[".".join(parts[:i + 2])]
            parts[i + 1] = str(layer.layer_number - 1)
        if "local_experts" in parts:
            j = parts.index("local_experts")
            experts = layers[".".join(pname.split(".")[:j])]
            parts[j + 1] = str(ep_rank * experts.num_local_experts + int(parts[j + 1]))
        out[pname] = ".".join(parts)
    return out


def _mamba_components(config, name: str) -> Optional[List[int]]:
    """The row blocks a Mamba ``in_proj`` / ``conv1d`` tensor is TP-split by (each block split
    over the ranks separately): [z, x, B, C, dt] and [x, B, C]."""
    from ..hybrid.flops import mamba_dims  # noqa: PLC0415

    n, _, g, N, d = mamba_dims(config)
    if name.endswith("mixer.in_proj.weight"):
        return [d, d, g * N, g * N, n]
    if name.endswith("mixer.conv1d.weight") or name.endswith("mixer.conv1d.bias"):
        return [d, g * N, g * N]
    return None


def _tp_group(pname: str):
    if ".mlp.experts." in pname:
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def _split(full: torch.Tensor, param, config, name: str, rank: int, size: int) -> torch.Tensor:
    """This TP rank's shard of ``full`` (the layout the module holds)."""
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    blocks = _mamba_components(config, name)
    if blocks is not None:
        return torch.cat([b.chunk(size, 0)[rank] for b in full.split(blocks, 0)], 0)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    return torch.cat([part.chunk(size, dim)[rank] for part in full.chunk(stride, dim)], dim)


def _join(parts: List[torch.Tensor], param, config, name: str) -> torch.Tensor:
    """The full tensor from every TP rank's shard (inverse of ``_split``)."""
    size = len(parts)
    blocks = _mamba_components(config, name)
    if blocks is not None:
        local = [b // size for b in blocks]
        per_rank = [p.split(local, 0) for p in parts]
        return torch.cat([torch.cat([r[k] for r in per_rank], 0) for k in range(len(blocks))], 0)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = [p.chunk(stride, dim) for p in parts]
    return torch.cat([c[s] for s in range(stride) for c in chunks], dim)


def full_shape(param, config, name: str, size: int) -> torch.Size:
    shape = list(param.shape)
    if size > 1 and getattr(param, "tensor_model_parallel", False):
        shape[0 if _mamba_components(config, name) else param.partition_dim] *= size
    return torch.Size(shape)


def init_by_global_name(model: torch.nn.Module, config, std: float = 0.05) -> None:
    """The same weights at any TP / PP / EP layout: every full tensor is drawn from a generator
    seeded by its global name, then this rank's TP shard is kept. Norm weights are 1 + noise;
    ``A_log`` is kept in a sane range (log of 1..16)."""
    names = global_names(model)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            group = _tp_group(pname)
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            gname = names[pname]
            gen = torch.Generator().manual_seed(zlib.crc32(gname.encode()))
            full = torch.randn(full_shape(p, config, gname, size), generator=gen) * std
            if "norm" in gname.rsplit(".", 2)[-2] or gname.endswith(".D"):
                full += 1.0
            elif gname.endswith("A_log"):
                full = torch.log(1.0 + 15.0 * torch.rand(full.shape, generator=gen))
            p.copy_(_split(full, p, config, gname, rank, size).to(p.dtype))


# ---------------------------------------------------------------------------------------------
# one training step, as the trainer runs it
# ---------------------------------------------------------------------------------------------
def make_batches(vocab: int, count: int, micro_batch: int, seq: int, seed: int = 0) -> list:
    from .equivalence import make_batch  # noqa: PLC0415

    return [make_batch(vocab, micro_batch, seq, seed + i) for i in range(count)]


def _gather_dicts(local: dict) -> dict:
    """The union of every rank's dict (each global name from any rank that has it)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.cpu() for k, v in local.items()})
    out = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def hybrid_train_step(config, batches: list, vocab: int = 256, seq: int = 32) -> dict:
    """One step of the tiny hybrid under the current parallel state: this DP rank takes its
    share of ``batches`` (micro-batches), megatron's DDP + schedule + ``finalize_model_grads``.
    Returns {"loss": mean LM loss over all micro-batches, "grads": {global name: full grad},
    "expert_bias": {global name: updated bias}} (the same on every rank)."""
    from megatron.core.distributed import (  # noqa: PLC0415
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker  # noqa: PLC0415

    from ..hybrid import build_hybrid_model  # noqa: PLC0415

    model = build_hybrid_model(config, vocab_size=vocab, max_sequence_length=seq)
    init_by_global_name(model, config)
    names = global_names(model)
    config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    dp, dp_rank = (parallel_state.get_data_parallel_world_size(),
                   parallel_state.get_data_parallel_rank())
    mine = batches[dp_rank::dp]

    recorded = []  # this rank's micro-batch losses as computed (the schedule may rescale its own)

    def forward_step(data_iterator, model):
        tokens, labels, pos = next(data_iterator)
        output = model(tokens, pos, None, labels=labels)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            recorded.append(loss.detach().clone())
            return loss, {"loss": loss.detach()}

        return output, loss_func

    ddp.zero_grad_buffer()
    clear_aux_losses_tracker()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(mine), model=[ddp],
        num_microbatches=len(mine), seq_length=seq, micro_batch_size=mine[0][0].shape[0],
        forward_only=False)
    local_loss = torch.stack(recorded).sum() if recorded else torch.zeros(())
    grads, bias = {}, {}
    for pname, p in model.named_parameters():
        g = p.main_grad.detach().clone()
        group = _tp_group(pname)
        size = dist.get_world_size(group)
        if size > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(size)]
            dist.all_gather(parts, g.contiguous(), group=group)
            g = _join(parts, p, config, names[pname])
        grads[names[pname]] = g
    for bname, b in model.named_buffers():
        if bname.endswith("expert_bias"):
            bias[names[bname]] = b.detach().clone()
    total = local_loss.reshape(1).clone()
    dist.all_reduce(total)  # every last-stage rank of every DP replica (one TP rank counted ...)
    count = torch.tensor([float(len(recorded))])
    dist.all_reduce(count)  # ... as many times as its losses)
    from ..training.trainer import count_parameters  # noqa: PLC0415

    return {"loss": (total / count).item(), "grads": _gather_dicts(grads),
            "expert_bias": _gather_dicts(bias), "parameters": count_parameters([model])}


def parallel_layouts_step(layouts: List[dict], num_microbatches: int = 4, micro_batch: int = 2,
                          seq: int = 32, seed: int = 1234,
                          config_overrides: Optional[dict] = None) -> List[dict]:
    """``hybrid_train_step`` at each layout (``dict(tp=, pp=, ep=, sp=)``, plus any config field
    for that layout alone) in turn, re-initialising megatron's parallel state between them (call
    inside a ``run_distributed`` rank)."""
    batches = make_batches(256, num_microbatches, micro_batch, seq)
    out = []
    for layout in layouts:
        layout = dict(layout)
        tp, pp, ep = layout.pop("tp", 1), layout.pop("pp", 1), layout.pop("ep", 1)
        sp = layout.pop("sp", False)
        reinit_parallel(tp, pp, seed, expert_model_parallel_size=ep)
        config = hybrid_test_config(tp=tp, pp=pp, ep=ep, sp=sp,
                                    **{**(config_overrides or {}), **layout})
        out.append(hybrid_train_step(config, batches, seq=seq))
    return out


# ---------------------------------------------------------------------------------------------
# torch_dist checkpoints across layouts
# ---------------------------------------------------------------------------------------------
def _hybrid_logits_and_bias(action: str, ckpt_dir: str, tp: int, ep: int, seed: int) -> dict:
    """Build the tiny hybrid at (tp, ep) with weights and expert biases of ``seed``; save it to
    ``ckpt_dir`` or load ``ckpt_dir`` into it; return its full logits and expert biases."""
    from megatron.core import dist_checkpointing  # noqa: PLC0415
    from megatron.core.tensor_parallel.mappings import (  # noqa: PLC0415
        gather_from_tensor_model_parallel_region,
    )

    from ..hybrid import build_hybrid_model  # noqa: PLC0415
    from .equivalence import make_batch  # noqa: PLC0415

    reinit_parallel(tp, expert_model_parallel_size=ep)
    config = hybrid_test_config(tp=tp, ep=ep, sp=tp > 1)
    model = build_hybrid_model(config, vocab_size=256, max_sequence_length=32)
    init_by_global_name(model, config, std=0.05 + 0.01 * seed)
    names = global_names(model)
    with torch.no_grad():
        for bname, b in model.named_buffers():
            if bname.endswith("expert_bias"):
                g = torch.Generator().manual_seed(zlib.crc32(names[bname].encode()) + seed)
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    if action == "save":
        os.makedirs(ckpt_dir, exist_ok=True)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint mismatch: missing={missing} unexpected={unexpected}")
    tokens, _, pos = make_batch(256, 2, 32, seed=0)
    model.eval()
    with torch.no_grad():
        logits = gather_from_tensor_model_parallel_region(model(tokens, pos, None))
    bias = {names[n]: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    return {"logits": logits, "expert_bias": _gather_dicts(bias)}


def hybrid_reshard(ckpt_dir: str) -> dict:
    """In a 2-rank world: save at TP=2 + SP, load at TP=1; save at EP=2, load at EP=1 (each
    load into a model of other weights). A test asserts loaded == saved, biases included."""
    out = {}
    for name, (save, load) in {"tp": ((2, 1), (1, 1)), "ep": ((1, 2), (1, 1))}.items():
        path = os.path.join(ckpt_dir, name)
        out[f"{name}_saved"] = _hybrid_logits_and_bias("save", path, *save, seed=1)
        out[f"{name}_loaded"] = _hybrid_logits_and_bias("load", path, *load, seed=2)
    return out


def hybrid_suite(layouts: List[dict], ckpt_dir: str) -> dict:
    """``parallel_layouts_step(layouts)`` and ``hybrid_reshard(ckpt_dir)`` in one 2-rank world
    (one process launch for both)."""
    return {"layouts": parallel_layouts_step(layouts), "reshard": hybrid_reshard(ckpt_dir)}


def hybrid_trainer_resume(work: str, flags: List[str]) -> dict:
    """The trainer on ``flags`` (mock data, 4 iterations, saves at 2 and 4) twice: A straight
    through, B resumed from A's iteration 2. Returns both runs' per-iteration metrics and the
    plain tensors of both iteration-4 checkpoints (model, expert biases, optimizer state)."""
    import json  # noqa: PLC0415

    from megatron.core import dist_checkpointing  # noqa: PLC0415

    from ..training import pretrain  # noqa: PLC0415

    common = flags + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
                      "--train-iters", "4", "--save-interval", "2", "--log-interval", "1",
                      "--eval-iters", "0"]
    runs = {"a": [], "b": ["--load", os.path.join(work, "a"), "--ckpt-step", "2"]}
    out = {}
    for name, extra in runs.items():
        save = os.path.join(work, name)
        pretrain(common + extra + ["--save", save, "--metrics-file",
                                   os.path.join(work, f"{name}.jsonl")])
        with open(os.path.join(work, f"{name}.jsonl")) as f:
            out[f"{name}_metrics"] = {r["iteration"]: r for r in map(json.loads, f)}
        plain = dist_checkpointing.load_plain_tensors(os.path.join(save, "iter_0000004"))
        out[f"{name}_tensors"] = {k: v for k, v in plain.items() if isinstance(v, torch.Tensor)}
    return out


def nano_parameter_counts() -> dict:
    """{variant: (parameters, active per token)} of the Nano preset with standard and with
    superlinear slots, built on the meta device (nothing allocated), and the devices seen."""
    from ..hybrid import build_hybrid_model, hybrid_preset  # noqa: PLC0415
    from ..hybrid.flops import active_parameters  # noqa: PLC0415

    out, devices = {}, set()
    for variant in ("standard", "superlinear"):
        config, kwargs = hybrid_preset("nemotron-3-nano-30b-a3b", attention_variant=variant,
                                       use_cpu_initialization=True, perform_initialization=False)
        with torch.device("meta"):
            model = build_hybrid_model(config, **kwargs)
        devices |= {p.device.type for p in model.parameters()}
        out[variant] = (sum(p.numel() for p in model.parameters()),
                        active_parameters(model, config))
    out["devices"] = sorted(devices)
    return out


# ---------------------------------------------------------------------------------------------
# context parallelism
# ---------------------------------------------------------------------------------------------
def hybrid_cp_step(pattern: str, slots: List[str], batch: int = 2, seq: int = 32,
                   vocab: int = 256, data_seed: int = 0, sp: bool = False, **overrides) -> dict:
    """One forward/backward of the tiny hybrid (``pattern``, ``slots`` in its attention slots,
    their ``VARIANT_TEST_SETTINGS``) under the current parallel state's CP and TP sizes (PP = EP
    = 1; ``sp``: sequence parallelism): each CP rank takes its zig-zag share of the batch
    (megatron's ``get_batch_on_this_cp_rank``), backpropagates its share of the global mean
    loss, and the CP ranks' gradients are summed (what megatron's DP x CP gradient reduction
    does; SP partial gradients summed over TP, TP shards joined). Returns the per-token loss
    [b, s] in natural order, every parameter's full gradient (the same at any CP/TP size) and
    ``cp_mixers``: how many ``SubqMambaMixer`` took the context-parallel path."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler  # noqa: PLC0415
    from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: PLC0415

    from ..attention import zigzag_chunks  # noqa: PLC0415
    from ..hybrid import build_hybrid_model, hybrid_preset  # noqa: PLC0415
    from .equivalence import make_batch  # noqa: PLC0415

    cp_group = parallel_state.get_context_parallel_group()
    cp = parallel_state.get_context_parallel_world_size()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    knobs = {}
    for name in slots:
        knobs.update(VARIANT_TEST_SETTINGS[name])
    config, _ = hybrid_preset("tiny-hybrid", num_layers=len(pattern),
                              hybrid_override_pattern=pattern, layer_pattern=list(slots),
                              use_cpu_initialization=True, context_parallel_size=cp,
                              tensor_model_parallel_size=tp, sequence_parallel=sp,
                              **{**knobs, **overrides})
    model = build_hybrid_model(config, vocab_size=vocab, max_sequence_length=seq)
    init_by_global_name(model, config)
    tokens, labels, pos = make_batch(vocab, batch, seq, data_seed)
    local = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels,
                                       "position_ids": pos}, cp_group)
    # the MoE aux loss's backward scale is class state that megatron's schedules also set: 1 here
    # (as at any CP size outside a schedule), the caller's value restored afterwards
    kept = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    try:
        loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"])
        (loss.sum() / (batch * seq)).backward()
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = kept
    grads = {}
    for pname, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().clone()
            dist.all_reduce(g, group=cp_group)
            if tp > 1 and sp and getattr(p, "sequence_parallel", False):
                dist.all_reduce(g, group=tp_group)
            if tp > 1 and getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(g) for _ in range(tp)]
                dist.all_gather(parts, g.contiguous(), group=tp_group)
                g = _join(parts, p, config, pname)
            grads[pname] = g
    parts = [torch.empty_like(loss) for _ in range(cp)]
    dist.all_gather(parts, loss.detach().contiguous(), group=cp_group)
    zigzag = torch.cat(parts, dim=1).view(batch, 2 * cp, seq // (2 * cp))
    order = zigzag_chunks(cp)
    full = zigzag[:, [order.index(c) for c in range(2 * cp)]].reshape(batch, seq)
    mixers = [m for m in model.modules() if getattr(m, "cp", None) is not None
              and hasattr(m, "_mix_cp")]
    return {"loss": full, "grads": grads, "cp_mixers": len(mixers)}


def hybrid_cp_suite(cases: List[tuple], layouts=((1, 1, False), (2, 1, False)),
                    seed: int = 1234) -> dict:
    """{case name: {(cp, tp, sp): result or ("error", traceback)}} of ``hybrid_cp_step`` for
    each case (name, pattern, slots, config overrides) at each layout (CP, TP, SP), in one world
    (re-initialised between them)."""
    import traceback  # noqa: PLC0415

    out: dict = {}
    for name, pattern, slots, overrides in cases:
        out[name] = {}
        for cp, tp, sp in layouts:
            try:
                reinit_parallel(tp, 1, seed, context_parallel_size=cp)
                out[name][(cp, tp, sp)] = hybrid_cp_step(pattern, slots, sp=sp, **overrides)
            except Exception:  # noqa: BLE001 - reported by that case's test
                out[name][(cp, tp, sp)] = ("error", traceback.format_exc())
    return out
