"""A lean Megatron-LM-style pretraining loop on megatron-core's building blocks.

``pretrain(argv)`` = parse flags -> initialise torch.distributed and megatron's parallel state ->
build the GPT (``megatron_subq.build_gpt_model``), wrap it in megatron's ``Float16Module`` (bf16 /
fp16) and ``DistributedDataParallel`` -> ``get_megatron_optimizer`` (optionally the distributed
optimizer) and ``OptimizerParamScheduler`` -> ``--load`` -> GPTDataset iterators -> the loop of
``get_forward_backward_func()`` steps (pipeline schedules, microbatches from
``num_microbatches_calculator``), logging, validation and ``--save``. It can be called several
times in one process (tests do): it tears down what it set up.

Without CUDA it runs on the CPU with gloo (``install_cpu_fallbacks``): that is what CI runs.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import sys
import time
from functools import partial
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from . import arguments, processes
from .checkpointing import (
    load_checkpoint,
    prepare_load,
    save_checkpoint,
    unwrap,
    warn_if_save_holds_another_model,
)
from .data import build_datasets, make_loader, to_device
from .exits import ExitConditions
from .flops import flops_per_iteration, peak_tflops, unmodelled_variants
from .fused_adam import set_fused_adam
from .metrics import MetricsLogger
from .tokenizer import build_tokenizer


def print_rank_0(*msg) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*msg, flush=True)


# ------------------------------------------------------------------------------------------------
# start-up
# ------------------------------------------------------------------------------------------------
def initialize_distributed(args) -> bool:
    """torch.distributed (from torchrun's environment, or a 1-process group), the CPU fallbacks,
    megatron's parallel state, the microbatch calculator and the seeds. Returns True if this
    call created the process group (so ``teardown`` destroys it)."""
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.num_microbatches_calculator import (  # noqa: PLC0415
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: PLC0415

    from ..cpu import install_cpu_fallbacks  # noqa: PLC0415
    from ..distributed import free_port  # noqa: PLC0415

    created = False
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) %
                                  torch.cuda.device_count())
        timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
        if "RANK" not in os.environ:
            # plain `python pretrain_gpt.py` (or a tool, a test): a group of one on a port of its
            # own, set in nothing a child process inherits (a RANK/MASTER_PORT left in
            # os.environ would send a child trainer to this process's port)
            dist.init_process_group(args.distributed_backend,
                                    init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(args.distributed_backend, timeout=timeout)
        created = True
    if not torch.cuda.is_available():
        install_cpu_fallbacks()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size,
                                     args.micro_batch_size, args.data_parallel_size)
    # as Megatron-LM: a different stream per pipeline stage, the same on TP/DP ranks of a stage
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return created


def teardown(created_process_group: bool) -> None:
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.num_microbatches_calculator import (  # noqa: PLC0415
        destroy_num_microbatches_calculator,
    )

    destroy_num_microbatches_calculator()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if created_process_group and dist.is_initialized():
        dist.destroy_process_group()


def build_config(args):
    """SubqTransformerConfig from the flags; a config error names the flag that caused it."""
    import dataclasses  # noqa: PLC0415

    from ..config import SubqTransformerConfig  # noqa: PLC0415

    kwargs = config_kwargs(args)
    names = {f.name for f in dataclasses.fields(SubqTransformerConfig)}
    try:
        return SubqTransformerConfig(**{k: v for k, v in kwargs.items() if k in names})
    except (ValueError, AssertionError, TypeError) as e:
        message = str(e) or type(e).__name__
        flags = [arguments.flag_for_field(k) for k in sorted(kwargs, key=len, reverse=True)
                 if k in message and hasattr(args, k)]
        arguments.fail(args, f"{', '.join(flags[:2]) or 'model configuration'}: {message}")


def config_kwargs(args) -> dict:
    """The model config's fields from the flags (megatron's TransformerConfig fields, the hybrid
    and MoE ones, the variant knobs); ``build_config`` keeps the SubqTransformerConfig ones and
    tools/bench_train.py's megatron-core anchor the TransformerConfig ones."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    kwargs = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=args.bf16, fp16=args.fp16,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        use_cpu_initialization=args.use_cpu_initialization or not torch.cuda.is_available(),
        attention_variant=args.attention_variant, layer_pattern=_layer_pattern(args.layer_pattern),
        calculate_per_token_loss=False,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        # megatron-core's fusions (arguments.check_fusions refused those that cannot run here)
        bias_activation_fusion=args.bias_swiglu_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        apply_rope_fusion=args.apply_rope_fusion,
        persist_layer_norm=args.persist_layer_norm,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
    )
    kwargs.update(_hybrid_config_kwargs(args))
    if args.squared_relu:
        from megatron.core.activations import squared_relu  # noqa: PLC0415

        kwargs["activation_func"] = squared_relu
    elif getattr(args, "silu", False):  # non-gated SiLU (gated_linear_unit is off: --no-swiglu)
        import torch.nn.functional as F  # noqa: PLC0415

        kwargs["activation_func"] = F.silu
    elif not args.swiglu:
        import torch.nn.functional as F  # noqa: PLC0415

        kwargs["activation_func"] = F.gelu
    for f in arguments.variant_fields():
        if f.name not in kwargs and hasattr(args, f.name):
            kwargs[f.name] = getattr(args, f.name)
    return kwargs


def _hybrid_config_kwargs(args) -> dict:
    """Config fields of the hybrid host and of MoE layers, from Megatron-LM's flag names."""
    out = dict(hybrid_override_pattern=args.hybrid_override_pattern, mamba_impl=args.mamba_impl,
               mamba_num_heads=args.mamba_num_heads, mamba_head_dim=args.mamba_head_dim,
               mamba_state_dim=args.mamba_state_dim, mamba_num_groups=args.mamba_num_groups,
               use_mamba_mem_eff_path=not args.disable_mamba_mem_eff_path)
    if args.num_experts:
        out.update(
            num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_router_topk=args.moe_router_topk,
            moe_router_score_function=args.moe_router_score_function,
            moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=args.moe_router_bias_update_rate,
            moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
            moe_router_dtype=args.moe_router_dtype,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_grouped_gemm=args.moe_grouped_gemm)
    return out


def kernel_launch_overrides() -> Dict[str, str]:
    """The ``MEGATRON_SUBQ_<OP>_LAUNCH`` environment variables (JSON overrides of a kernel
    package's launch options, some of which change numerics): a run announces them at start-up
    and stores them with its checkpoint's arguments, so no run depends on a hidden setting."""
    return {name: value for name, value in os.environ.items()
            if name.startswith("MEGATRON_SUBQ_") and name.endswith("_LAUNCH")}


def _layer_pattern(value):
    if value is None or "," not in value:
        return value
    return [v.strip() for v in value.split(",") if v.strip()]


def bare_model(args, config, vocab_size: int) -> torch.nn.Module:
    """The bare model of these flags for this pipeline stage (no wrappers): megatron's
    ``GPTModel``, or its ``MambaModel`` for a hybrid (``config.hybrid_override_pattern``); what
    ``build_model`` wraps, and what checkpoint conversion fills."""
    from ..hybrid import build_hybrid_model  # noqa: PLC0415
    from ..specs import build_gpt_model  # noqa: PLC0415

    common = dict(max_sequence_length=args.max_position_embeddings,
                  position_embedding_type=args.position_embedding_type,
                  rotary_base=args.rotary_base,
                  share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    if config.is_hybrid:
        return build_hybrid_model(config, vocab_size=vocab_size, **common)
    return build_gpt_model(config, vocab_size=vocab_size, rope_scaling=args.use_rope_scaling,
                           rope_scaling_factor=args.rope_scaling_factor, **common)


def build_model(args, config, vocab_size: int) -> List[torch.nn.Module]:
    """[DDP(Float16Module?(GPTModel | MambaModel))] for this pipeline stage (one chunk: no
    virtual PP); the hybrid host when ``config.hybrid_override_pattern`` is set."""
    return wrap_model(args, config, bare_model(args, config, vocab_size))


def wrap_model(args, config, model: torch.nn.Module) -> List[torch.nn.Module]:
    """[DDP(Float16Module?(model))]: the trainer's wrapping of a bare model (moved to the GPU)."""
    from megatron.core.distributed import (  # noqa: PLC0415
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.transformer.module import Float16Module  # noqa: PLC0415

    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    if args.bf16 or args.fp16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        bucket_size=None)
    return [DistributedDataParallel(config, ddp_config, model)]


def count_parameters(model: List[torch.nn.Module]) -> int:
    """Parameters of the whole model (all TP, PP and EP ranks; TP-replicated ones counted once).

    Expert-parallel experts (megatron marks them ``allreduce=False``) differ across EP ranks and
    are summed over the expert group (expert TP x EP x PP); every other parameter over the model
    parallel group (TP x PP), where EP ranks hold copies."""
    from megatron.core import parallel_state  # noqa: PLC0415

    ranks = (parallel_state.get_tensor_model_parallel_rank(),
             parallel_state.get_expert_tensor_parallel_rank())
    counts = [0, 0]  # dense, expert-parallel
    for chunk in model:
        for p in unwrap(chunk).parameters():
            expert = int(not getattr(p, "allreduce", True))
            if getattr(p, "tensor_model_parallel", False) or ranks[expert] == 0:
                counts[expert] += p.numel()
    groups = (parallel_state.get_model_parallel_group(),
              parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    total = 0
    for n, group in zip(counts, groups):
        t = torch.tensor([n], dtype=torch.float64, device=_device())
        dist.all_reduce(t, group=group)
        total += int(t.item())
    return total


def build_optimizer(args, model):
    from megatron.core.optimizer import (  # noqa: PLC0415
        OptimizerConfig,
        get_megatron_optimizer,
        get_standard_config_overrides,
    )
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: PLC0415

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        params_dtype=dtype, loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather)
    optimizer = get_megatron_optimizer(config, model,
                                       config_overrides=get_standard_config_overrides(config))
    if args.subq_fused_adam:
        try:
            note = set_fused_adam(optimizer, True)
        except ValueError as e:
            arguments.fail(args, str(e))
        print_rank_0(f"> --subq-fused-adam: {note or 'no parameters on this rank'}")

    # as Megatron-LM's get_optimizer_param_scheduler: steps are counted in samples
    gbs = args.global_batch_size
    if args.train_samples is None:
        decay = (args.lr_decay_iters or args.train_iters or 1) * gbs
        warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                  else args.lr_warmup_iters * gbs)
        wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters else None
        wd_steps = (args.train_iters or 1) * gbs
    else:
        decay = args.lr_decay_samples or args.train_samples
        warmup = (args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None
                  else args.lr_warmup_samples)
        wsd = args.lr_wsd_decay_samples
        wd_steps = args.train_samples
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay, end_wd=args.end_weight_decay, wd_incr_steps=wd_steps,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler, wsd_decay_steps=wsd,
        lr_wsd_decay_style=args.lr_wsd_decay_style)
    return optimizer, scheduler


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


# ------------------------------------------------------------------------------------------------
# steps
# ------------------------------------------------------------------------------------------------
def set_step_hooks(args, config, model, optimizer) -> None:
    """What megatron's schedules call around a step: gradient finalisation, loss scaling and the
    DDP overlap hooks."""
    from megatron.core.distributed import finalize_model_grads  # noqa: PLC0415

    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss if optimizer is not None else None
    if args.overlap_grad_reduce:
        config.no_sync_func = model[0].no_sync
    if args.overlap_param_gather:
        config.param_sync_func = model[0].start_param_sync


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's: (sum of masked token losses, token count, report [sum, count]).

    Under context parallelism each rank holds a share of the micro-batch's tokens: the count
    is summed over the CP group and the loss multiplied by the CP size, so that the schedule's
    ``loss / count`` summed over CP ranks by the DP x CP gradient average (megatron's DDP divides
    by DP·CP) is the micro-batch's mean over all its tokens, as at CP=1. The report stays this
    rank's [sum, count] (``_reduce_losses`` sums it over DP x CP)."""
    from megatron.core import parallel_state  # noqa: PLC0415

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])}
    cp = parallel_state.get_context_parallel_world_size()
    if cp > 1:
        num_tokens = num_tokens.clone()
        dist.all_reduce(num_tokens, group=parallel_state.get_context_parallel_group())
        loss = loss * cp
    return loss, num_tokens, report


def pack_documents(batch: dict, eod: int):
    """--reset-attention-mask: the [b, s] micro-batch as one THD row [1, b*s] of documents, each
    ending after its EOD token or at its sample's end, and megatron's ``PackedSeqParams`` for it.
    Attention (and RoPE, which restarts per document in THD) then never crosses a document."""
    from megatron.core.packed_seq_params import PackedSeqParams  # noqa: PLC0415

    tokens = batch["tokens"]
    b, s = tokens.shape
    row = {key: value.reshape(1, b * s) for key, value in batch.items()
           if key in ("tokens", "labels", "loss_mask", "position_ids")}
    ends = torch.cat([torch.zeros(1, dtype=torch.long, device=tokens.device),
                      (tokens.reshape(-1) == eod).nonzero().flatten() + 1,
                      torch.arange(1, b + 1, device=tokens.device) * s])
    cu = torch.unique(ends).to(torch.int32)  # sorted; an EOD closing a sample counts once
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=s, max_seqlen_kv=s)  # bounds, no host sync
    return row, params


def forward_step(data_iterator, model, eod: Optional[int] = None):
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: PLC0415

    batch = to_device(next(data_iterator), _device())
    if parallel_state.get_context_parallel_world_size() > 1:  # this rank's zig-zag halves
        batch = get_batch_on_this_cp_rank(
            {key: batch[key] for key in ("tokens", "labels", "loss_mask", "position_ids")},
            parallel_state.get_context_parallel_group())
    packed = None
    if eod is not None:
        batch, packed = pack_documents(batch, eod)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=packed)
    return output, partial(loss_func, batch["loss_mask"])


def schedule_kwargs(args) -> dict:
    """What megatron's pipeline schedules need of a micro-batch: the step function and the shape
    of the activations passed between stages ([b*s, 1, h] when documents are packed)."""
    if args.reset_attention_mask:
        return dict(forward_step_func=partial(forward_step, eod=args.eod_token),
                    seq_length=args.seq_length * args.micro_batch_size, micro_batch_size=1)
    return dict(forward_step_func=forward_step, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size)


def _reduce_losses(losses_reduced) -> Optional[torch.Tensor]:
    """[loss sum, token count] over microbatches and DP x CP ranks (last pipeline stage only)."""
    from megatron.core import parallel_state  # noqa: PLC0415

    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    total = torch.stack([d["lm loss"].view(-1) for d in losses_reduced]).sum(0)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(
        with_context_parallel=True))
    return total


def train_step(args, model, optimizer, scheduler, data_iterator):
    from megatron.core.num_microbatches_calculator import get_num_microbatches  # noqa: PLC0415
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        data_iterator=data_iterator, model=model, num_microbatches=get_num_microbatches(),
        forward_only=False, **schedule_kwargs(args))
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful:
        scheduler.step(increment=args.global_batch_size)
    return _reduce_losses(losses), (not update_successful), grad_norm


def evaluate(args, model, loader) -> Optional[float]:
    """Mean validation loss over the fixed validation set (on the last pipeline stage)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches  # noqa: PLC0415
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415

    for chunk in model:
        chunk.eval()
    total = None
    iterator = iter(loader)
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses = get_forward_backward_func()(
                data_iterator=iterator, model=model, num_microbatches=get_num_microbatches(),
                forward_only=True, **schedule_kwargs(args))
            reduced = _reduce_losses(losses)
            if reduced is not None:
                total = reduced if total is None else total + reduced
    for chunk in model:
        chunk.train()
    return None if total is None else (total[0] / total[1].clamp(min=1)).item()


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
def pretrain(argv=None) -> Dict:
    """Run the trainer with Megatron-LM-style flags. Returns a summary (losses on the last rank)."""
    started = time.monotonic()  # --exit-duration-in-mins counts from here, as Megatron-LM's
    world = dist.get_world_size() if dist.is_initialized() else None
    args = arguments.parse_args(argv, world_size=world)
    processes.install_process_lifetimes(log=print_rank_0)
    created = initialize_distributed(args)
    lock = None
    try:
        try:  # before anything is written (collective: every rank fails together)
            lock = processes.lock_save_folder(args, log=print_rank_0)
        except processes.SaveFolderLocked as e:
            arguments.fail(args, str(e))
        return _run(args, started)
    finally:
        if lock is not None:
            lock.release()
        processes.uninstall_child_reaping()
        teardown(created)


def _run(args, started: Optional[float] = None) -> Dict:
    from megatron.core import parallel_state  # noqa: PLC0415

    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    except ValueError as e:
        arguments.fail(args, str(e))
    if args.vocab_size is not None and args.tokenizer_type != "NullTokenizer" and \
            tokenizer.vocab_size != args.vocab_size:
        arguments.fail(args, f"--vocab-size {args.vocab_size}: the tokenizer "
                             f"--tokenizer-model {args.tokenizer_model} has {tokenizer.vocab_size} "
                             "tokens (a recipe's --vocab-size states the tokenizer it expects; "
                             "allowed: that tokenizer, or drop --vocab-size)")
    if getattr(args, "_checkpoint_args_note", None):
        print_rank_0(f"> {args._checkpoint_args_note}")
    try:  # the checkpoint's padded vocabulary, and its model = this model, before building
        vocab = prepare_load(args, tokenizer.vocab_size, log=print_rank_0)
    except ValueError as e:
        arguments.fail(args, str(e))
    if dist.get_rank() == 0:
        warn_if_save_holds_another_model(args, log=print_rank_0)
    arguments.apply_sdpa_backend(args.subq_sdpa_backend)
    config = build_config(args)
    args.eod_token = tokenizer.eod  # document ends under --reset-attention-mask
    model = build_model(args, config, vocab)
    optimizer = scheduler = None
    if not args.skip_train:  # evaluation only needs the weights
        optimizer, scheduler = build_optimizer(args, model)

    set_step_hooks(args, config, model, optimizer)

    overrides = kernel_launch_overrides()
    args.kernel_launch_overrides = json.dumps(overrides, sort_keys=True)  # saved with the args
    for name, value in sorted(overrides.items()):
        print_rank_0(f"> kernel launch override in force: {name}={value}")

    n_params = count_parameters(model)
    flops_iter = flops_per_iteration(config, args.seq_length, vocab, args.global_batch_size,
                                     args.micro_batch_size)
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = args.peak_tflops_per_gpu or (peak_tflops(device_name) if torch.cuda.is_available()
                                        else None)
    ep = args.expert_model_parallel_size
    ep_text = f", EP {ep}" if ep > 1 else ""
    print_rank_0(
        f"> megatron_subq pretrain_{'hybrid' if config.is_hybrid else 'gpt'}: variant "
        f"{args.attention_variant} "
        f"(layers: {_layers_text(config)}), {n_params:,} parameters, vocab {vocab} "
        f"(tokenizer {tokenizer.vocab_size}), world {args.world_size} = TP "
        f"{args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size} x "
        f"{'CP %d x ' % args.context_parallel_size if args.context_parallel_size > 1 else ''}"
        f"DP {args.data_parallel_size}{' + SP' if args.sequence_parallel else ''}"
        f"{ep_text}, "
        f"{'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}, {device_name}, "
        f"{flops_iter / 1e12:.3f} TFLOP per iteration")
    if args.reset_attention_mask:
        print_rank_0("> note: with --reset-attention-mask, TFLOP/s and MFU still count attention "
                     "over whole sequences; documents are shorter (see docs/training.md)")
    for name in unmodelled_variants(config):
        print_rank_0(f"> note: FLOPs of variant {name!r} are not modelled; counted as standard "
                     "attention (see docs/training.md)")

    iteration, consumed, flops_so_far = 0, 0, 0.0
    if args.load:
        try:
            iteration, consumed, flops_so_far = load_checkpoint(args, model, optimizer, scheduler,
                                                                log=print_rank_0)
        except (FileNotFoundError, ValueError) as e:
            arguments.fail(args, str(e))
    loaded_iteration = iteration

    train_ds, valid_ds, _ = build_datasets(args, tokenizer)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    valid_loader = None
    if valid_ds is not None and args.eval_iters > 0:
        valid_loader = make_loader(valid_ds, 0, args.eval_iters * args.global_batch_size, args,
                                   dp_rank, dp_size)
    logger = MetricsLogger(args, flops_iter, peak)
    summary: Dict = {"iterations": {}, "valid": {}, "parameters": n_params,
                     "loaded_iteration": loaded_iteration}

    def run_eval(at: int) -> None:
        if valid_loader is None:
            return
        loss = evaluate(args, model, valid_loader)
        logger.log_validation(at, loss)
        if loss is not None:
            summary["valid"][at] = loss

    if args.skip_train:
        run_eval(iteration)
        logger.close()
        summary["iteration"] = iteration
        return summary

    if args.train_iters is None or iteration >= args.train_iters:
        print_rank_0(f"> nothing to train: the run is at iteration {iteration} and --train-iters "
                     f"is {args.train_iters}; to continue it, raise --train-iters above "
                     f"{iteration} (or --train-samples above {iteration * args.global_batch_size})"
                     " and add --use-checkpoint-opt-param-scheduler (keep the finished schedule: "
                     "the LR stays at --min-lr) or --override-opt-param-scheduler (the flags' "
                     "schedule over the longer run); see docs/training.md")
    train_loader = make_loader(train_ds, consumed, None, args, dp_rank, dp_size)
    train_iter = iter(train_loader)
    for chunk in model:
        chunk.train()
    last_saved = loaded_iteration if args.load else None
    last_eval = None
    exits = ExitConditions(args.exit_signal_handler, args.exit_duration_in_mins, _device(),
                           start=started)
    exits.install()
    stopped = ""
    while iteration < (args.train_iters or 0):
        _sync()
        start = time.perf_counter()
        loss_sum, skipped, grad_norm = train_step(args, model, optimizer, scheduler, train_iter)
        _sync()
        elapsed = time.perf_counter() - start
        iteration += 1
        consumed += args.global_batch_size
        flops_so_far += flops_iter
        loss = None if loss_sum is None else (loss_sum[0] / loss_sum[1].clamp(min=1)).item()
        lr = optimizer.param_groups[0]["lr"]
        logger.log_iteration(iteration, consumed, elapsed, lr, loss, grad_norm, skipped,
                             getattr(optimizer, "get_loss_scale", lambda: torch.tensor(1.0))(),
                             extra=moe_losses(config))
        if loss is not None:
            summary["iterations"][iteration] = loss
        if iteration % args.eval_interval == 0:
            run_eval(iteration)
            last_eval = iteration
        if args.save and iteration % args.save_interval == 0:
            save_checkpoint(args, iteration, model, optimizer, scheduler, consumed, flops_so_far,
                            log=print_rank_0)
            last_saved = iteration
        if args.exit_interval and iteration % args.exit_interval == 0:
            print_rank_0(f"> exiting at iteration {iteration} (--exit-interval)")
            break
        stopped = exits.reason()
        if stopped:
            print_rank_0(f"> exiting at iteration {iteration}: {stopped}")
            break
    exits.restore()
    if last_eval != iteration and iteration > loaded_iteration and not stopped:
        run_eval(iteration)
    if args.save and last_saved != iteration and iteration > 0:
        save_checkpoint(args, iteration, model, optimizer, scheduler, consumed, flops_so_far,
                        log=print_rank_0)
    logger.close()
    summary["iteration"] = iteration
    summary["stopped"] = stopped
    return summary


MOE_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}
"""--moe-router-load-balancing-type -> the name megatron's router logs its loss under."""


def moe_losses(config) -> Dict[str, float]:
    """This iteration's MoE load-balancing (and z-) losses, averaged over MoE layers,
    micro-batches and data-parallel ranks, by megatron's own tracker (``track_moe_metrics``,
    which also clears it); {} without MoE layers or without a loss coefficient. Every rank
    calls it (it reduces over the pipeline and DP groups)."""
    if not config.num_moe_experts:
        return {}
    from megatron.core.num_microbatches_calculator import get_num_microbatches  # noqa: PLC0415
    from megatron.core.transformer.moe.moe_utils import track_moe_metrics  # noqa: PLC0415

    kinds = config.moe_router_load_balancing_type
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    names = [MOE_LOSS_NAMES[k] for k in kinds if k in MOE_LOSS_NAMES and config.moe_aux_loss_coeff]
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    if not names:
        return {}
    pattern = config.hybrid_override_pattern
    layers = [int(s == "E") for s in pattern] if pattern else config.moe_layer_freq
    totals: Dict[str, torch.Tensor] = {}
    track_moe_metrics(loss_scale=1.0 / get_num_microbatches(), iteration=0,
                      total_loss_dict=totals, force_initialize=True, track_names=names,
                      num_layers=config.num_layers, moe_layer_freq=layers)
    return {name: float(value) for name, value in totals.items()}


def _layers_text(config) -> str:
    """'asa,standard' for a GPT; the pattern with each slot's variant for a hybrid
    ('M,E,*asa,...')."""
    if not config.is_hybrid:
        return ",".join(config.layer_variants)
    return ",".join(s + (v if s == "*" else "") for s, v in
                    zip(config.hybrid_override_pattern, config.layer_variants))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> int:
    pretrain(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
