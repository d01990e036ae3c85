"""Checkpoints: megatron-core ``dist_checkpointing`` (torch_dist) with everything a run needs to
resume exactly, laid out as Megatron-LM does::

    SAVE/latest_checkpointed_iteration.txt     the tracker: the last *complete* checkpoint
    SAVE/iter_0000020/                         one dist_checkpointing folder per save

What is saved: the model's sharded state dict, the optimizer's (main params and moments; the
distributed optimizer per parameter by default, so it reshards), the LR/WD scheduler, the
iteration, ``consumed_train_samples`` (the data iterator's whole state, see ``data.py``), the
FLOP count so far, the arguments, and every RNG (Python, NumPy, torch CPU/CUDA and megatron's
model-parallel tracker) per (PP, TP) rank.

A save is committed in three steps, so that an interrupted save never hides the previous
checkpoint: (1) all ranks write into ``iter_N.partial`` (a leftover from an earlier interrupted
save is removed first), (2) once every rank has finished, rank 0 renames it to ``iter_N``,
(3) rank 0 replaces the tracker atomically (write a temporary file, fsync, ``os.replace``).
Loading reads the tracker, so a crash at any point resumes from the last complete save.

Loading at another TP/PP size reshards the model and optimizer (dist_checkpointing matches
tensors by global shape and offset); the RNG states, which belong to (PP, TP) ranks, are then
not restored.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import random
import re
import shutil
import time
import zipfile
from typing import List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.validation import StrictHandling

from .fused_adam import set_fused_adam

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


def optimizer_metadata(args) -> dict:
    """How the distributed optimizer lays out its state: 'fully_reshardable' (gathered per
    parameter on DP rank 0; loads at any TP/PP/DP) or 'dp_reshardable' (each rank its own
    buffers, faster at scale; loads at another DP size only)."""
    kind = "fully_reshardable" if args.dist_ckpt_optim_fully_reshardable else "dp_reshardable"
    return {"distrib_optim_sharding_type": kind}


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """The iteration of the last complete checkpoint under ``root``, or None."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError as e:
        raise ValueError(f"{path}: expected an iteration number, found {text!r}") from e


def write_tracker(root: str, iteration: int) -> None:
    """Atomically point the tracker at ``iteration`` (readers see the old or the new value)."""
    path = os.path.join(root, TRACKER)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # make the rename itself durable
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP and Float16Module wrappers."""
    from megatron.core.distributed import DistributedDataParallel  # noqa: PLC0415
    from megatron.core.transformer.module import Float16Module  # noqa: PLC0415

    while isinstance(module, (DistributedDataParallel, Float16Module)):
        module = module.module
    return module


def _rng_state() -> ShardedObject:
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    pp, tp = (parallel_state.get_pipeline_model_parallel_world_size(),
              parallel_state.get_tensor_model_parallel_world_size())
    return ShardedObject("rng_state", [state], (pp, tp),
                         (parallel_state.get_pipeline_model_parallel_rank(),
                          parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=parallel_state.get_data_parallel_rank(
                             with_context_parallel=True))


def _restore_rng(state: dict) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _saved_args(args) -> dict:
    """The arguments as plain values (for --load checks and tools/evaluate.py)."""
    out = {}
    for k, v in vars(args).items():
        if k.startswith("_"):
            continue
        if isinstance(v, (str, int, float, bool, type(None))) or (
                isinstance(v, (list, tuple)) and all(isinstance(x, (str, int, float)) for x in v)):
            out[k] = v
    return out


# The arguments that define the model a checkpoint holds (besides the attention variant of every
# layer and the variant knobs): a checkpoint loads only into a model built with the same values.
MODEL_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_query_groups", "kv_channels", "normalization", "norm_epsilon", "swiglu",
                    "add_bias_linear", "position_embedding_type", "rotary_base",
                    "max_position_embeddings", "untie_embeddings_and_output_weights",
                    # the hybrid host's Mamba-2 and MoE layers
                    "mamba_num_heads", "mamba_head_dim", "mamba_state_dim", "mamba_num_groups",
                    "num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                    "moe_router_topk", "moe_router_score_function",
                    "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
                    "squared_relu", "silu",
                    "tokenizer_vocab_size", "qk_layernorm", "add_qkv_bias", "use_rope_scaling",
                    "rope_scaling_factor")
# what --use-checkpoint-args takes from the checkpoint besides the model-defining arguments
TOKENIZER_ARGS = ("tokenizer_type", "tokenizer_model", "vocab_size", "make_vocab_size_divisible_by")
# variant knobs that choose an implementation, a parallel layout or an evaluation ablation, not
# the model
NON_MODEL_KNOBS = ("subq_impl", "subq_fused_norm", "subq_fused_rope", "skip_variant_layers",
                   "superlinear_allow_no_random_access", "superlinear_decode_graph", "mamba_impl",
                   "context_parallel_scheme")


def _knob_owner(field_name: str) -> Optional[str]:
    """The variant whose layers read a knob (its ``Variant.knobs`` prefixes); None: a knob of
    no variant, always compared."""
    from ..variants import VARIANTS  # noqa: PLC0415

    return next((name for name, variant in VARIANTS.items()
                 if any(field_name.startswith(prefix) for prefix in variant.knobs)), None)


def _derived_knobs(values, layers) -> dict:
    """{field: value in use} of the knobs whose default depends on other arguments
    (``Variant.derived_knobs``), for the variants of ``layers``; {} where ``values`` lacks what
    they need (a checkpoint saved before those arguments existed)."""
    from ..variants import VARIANTS  # noqa: PLC0415

    ns = argparse.Namespace(**values) if isinstance(values, dict) else values
    out = {}
    for name in sorted(set(layers or ()) - {None}):
        if name in VARIANTS:
            try:
                out.update(VARIANTS[name].derived_knobs(ns))
            except (AttributeError, TypeError, ValueError, ZeroDivisionError):
                continue
    return out


def layer_variants(values) -> Optional[list]:
    """Every layer's variant from --attention-variant / --layer-pattern / --num-layers in
    ``values`` (a dict or a namespace); None when they do not resolve."""
    from ..patterns import resolve_layer_variants  # noqa: PLC0415

    get = values.get if isinstance(values, dict) else (lambda k, d=None: getattr(values, k, d))
    pattern = get("layer_pattern")
    if isinstance(pattern, str) and "," in pattern:
        pattern = [v.strip() for v in pattern.split(",") if v.strip()]
    try:
        return resolve_layer_variants(pattern, get("attention_variant", "standard"),
                                      get("num_layers"), get("hybrid_override_pattern"))
    except (ValueError, TypeError):
        return None


def model_args(layers) -> list:
    """The argument names that define a model whose layers are ``layers`` (variant names): the
    shape (``MODEL_SHAPE_ARGS``) and the knobs of the variants in use."""
    from .fields import variant_fields  # noqa: PLC0415

    used = set(layers or ()) - {None}
    names = [n for n in MODEL_SHAPE_ARGS]
    for f in variant_fields():
        if f.name in ("attention_variant", "layer_pattern") or f.name in NON_MODEL_KNOBS:
            continue
        owner = _knob_owner(f.name)
        if owner is None or owner in used:
            names.append(f.name)
    return names


def model_mismatches(saved: dict, args) -> list:
    """'--flag: checkpoint X, this run Y' for every model-defining argument in which this run
    (``args``) differs from a checkpoint's stored arguments (``saved``). Arguments the
    checkpoint does not store (saved before they existed) are not compared. A knob with a
    ``Variant.derived_knobs`` entry is compared by the value in use (the mlp width, whose default
    depends on the TP size)."""
    from .fields import flag_for_field  # noqa: PLC0415

    out = []
    theirs, ours = layer_variants(saved), layer_variants(args)
    if theirs != ours:
        def describe(values, layers):
            get = values.get if isinstance(values, dict) else \
                (lambda k, d=None: getattr(values, k, d))
            text = str(get("attention_variant"))
            if get("layer_pattern") is not None:
                text += f" --layer-pattern {get('layer_pattern')}"
            return f"{text} (layers {','.join(str(n or '-') for n in layers or ['?'])})"
        out.append(f"--attention-variant/--layer-pattern: checkpoint {describe(saved, theirs)}, "
                   f"this run {describe(args, ours)}")
    derived_theirs, derived_ours = _derived_knobs(saved, theirs), _derived_knobs(args, ours)
    for name in model_args(set(theirs or ()) | set(ours or ())):
        if name in derived_theirs and name in derived_ours:
            if derived_theirs[name] != derived_ours[name]:
                flag = flag_for_field(name)
                out.append(f"{flag}: checkpoint {derived_theirs[name]!r} (in use; given "
                           f"{saved.get(name)!r}), this run {derived_ours[name]!r} (given "
                           f"{getattr(args, name, None)!r}); a default can depend on the TP "
                           f"size: pass {flag} {derived_theirs[name]} to build the checkpoint's "
                           "model")
            continue
        if name not in saved:
            continue
        if name == "max_position_embeddings" and "learned_absolute" not in (
                saved.get("position_embedding_type"), getattr(args, "position_embedding_type")):
            continue  # RoPE holds no weights per position
        mine = getattr(args, name, None)
        if saved[name] != mine:
            flag = "--vocab-size/--tokenizer-model (tokenizer vocabulary)" \
                if name == "tokenizer_vocab_size" else flag_for_field(name)
            out.append(f"{flag}: checkpoint {saved[name]!r}, this run {mine!r}")
    return out


def checkpoint_folder(root: str, step: Optional[int] = None) -> Optional[str]:
    """The folder ``--load root`` (``--ckpt-step step``) loads, or None when root has no
    complete checkpoint (no tracker and no step)."""
    iteration = step if step is not None else read_tracker(root)
    return None if iteration is None else checkpoint_dir(root, iteration)


def prepare_load(args, tokenizer_vocab_size: int, log=print) -> int:
    """Before the model is built: decide the padded vocabulary and check the model against the
    checkpoint that ``--load`` will load. Returns the padded vocabulary size.

    Sets ``args.tokenizer_vocab_size`` and ``args.padded_vocab_size`` (saved with every
    checkpoint). With a checkpoint to load, the padded vocabulary is the checkpoint's
    (``tokenizer.padded_vocab_size_for_load``), and every model-defining argument must equal the
    stored one: a difference raises ValueError listing all of them, unless
    ``--allow-model-change`` (then they are printed, and ``args._model_changed`` makes
    ``load_checkpoint`` load the matching weights only). Raises ValueError naming the flag.
    """
    from .tokenizer import padded_vocab_size_for_load  # noqa: PLC0415

    args.tokenizer_vocab_size = tokenizer_vocab_size
    args._model_changed = False
    saved, folder = {}, None
    if args.load:
        folder = checkpoint_folder(args.load, args.ckpt_step)
        if folder is not None and os.path.isdir(folder):
            with reading_checkpoint(folder):
                saved = dict(dist_checkpointing.load_common_state_dict(folder).get("args", {}))
    mismatches = model_mismatches(saved, args) if saved else []
    if mismatches and not args.allow_model_change:
        raise ValueError(
            f"--load {args.load}: {folder} holds a different model than this run asks for: "
            + "; ".join(mismatches) + ". Give the checkpoint's values, or "
            "--use-checkpoint-args to take them from it, or --allow-model-change to load "
            "its matching weights into this model on purpose")
    same_tokens = saved.get("tokenizer_vocab_size") in (None, tokenizer_vocab_size)
    vocab, note = padded_vocab_size_for_load(
        tokenizer_vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size,
        saved if same_tokens else None)
    args.padded_vocab_size = vocab
    if note:
        log(f"> {note}")
    if mismatches:
        args._model_changed = True
        log("> --allow-model-change: this model differs from the checkpoint's ("
            + "; ".join(mismatches) + "); only tensors of the same name are loaded, the "
            "optimizer state is not")
    return vocab


def warn_if_save_holds_another_model(args, log=print) -> None:
    """One warning line when ``--save`` already holds a run of a different model and this run
    does not load from it (its saves would sit beside, and its tracker replace, that run's)."""
    if not args.save or (args.load and os.path.realpath(args.load) ==
                         os.path.realpath(args.save)):
        return
    try:
        iteration = read_tracker(args.save)
        if iteration is None or not os.path.isdir(checkpoint_dir(args.save, iteration)):
            return
        saved = dict(dist_checkpointing.load_common_state_dict(
            checkpoint_dir(args.save, iteration)).get("args", {}))
    except Exception:  # noqa: BLE001 - an unreadable folder is not this warning's business
        return
    mismatches = model_mismatches(saved, args)
    if mismatches:
        log(f"> warning: --save {args.save} already holds a run of another model (iteration "
            f"{iteration}; {'; '.join(mismatches)}) and this run does not --load it: its saves "
            "will replace that run's tracker; use another --save folder")


def _ensure_adam_state(optimizer) -> None:
    """Give a fresh distributed Adam its (zero) moments and step before a load request is built.

    Without Apex/Transformer Engine, ``DistributedOptimizer.state_dict`` reads every parameter's
    ``step`` and fails on an optimizer that has not stepped yet; the loaded values replace these.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: PLC0415

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, DistributedOptimizer) or not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(0.0)
                    inner.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    inner.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


def _adam_steps(optimizer) -> List[Optional[float]]:
    """Per inner torch Adam (distributed optimizers; None elsewhere) the step count of its
    parameters (one number: they step together)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: PLC0415

    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        steps = [float(st["step"]) for st in inner.state.values() if "step" in st] \
            if isinstance(opt, DistributedOptimizer) and isinstance(inner, torch.optim.Adam) \
            else []
        out.append(max(steps) if steps else None)
    return out


def _restore_adam_steps(optimizer, steps: List[Optional[float]]) -> None:
    """Put the saved step counts back (the dp_reshardable load of megatron-core 0.16.1 without
    Apex/TE restores moments and main parameters but leaves torch Adam's ``step`` at its fresh
    0: a wrong bias correction for every later step)."""
    for opt, step in zip(getattr(optimizer, "chained_optimizers", [optimizer]), steps):
        if step is None:
            continue
        for st in opt.optimizer.state.values():
            if "step" in st:
                st["step"] = torch.tensor(float(step))


@contextlib.contextmanager
def _step_tolerant_param_state_load(optimizer):
    """Work around megatron-core 0.16.1 without Apex/Transformer Engine (torch's Adam), where
    loading a distributed optimizer (1) copies every key of the live per-parameter state, torch's
    ``step`` included, from the checkpoint's tensors, which hold no ``step`` (KeyError): hide it
    while the tensors are copied; and (2) leaves one ``step`` tensor shared by all parameters."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: PLC0415

    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        original = opt._set_main_param_and_optimizer_states

        def tolerant(model_param, tensors, _opt=opt, _original=original):
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
            state = _opt.optimizer.state[main_param]
            step = state.pop("step", None) if "step" not in tensors else None
            try:
                _original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        opt._set_main_param_and_optimizer_states = tolerant
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class's method
            # the same path gives every parameter one shared ``step`` tensor, which torch's Adam
            # then increments once per parameter per step (wrong bias correction): un-share it
            for state in opt.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].detach().clone()


def _state_dict(model, optimizer, scheduler, with_optimizer: bool, with_rng: bool,
                is_loading: bool, optim_metadata: Optional[dict] = None) -> dict:
    state = {}
    for i, chunk in enumerate(model):
        state["model" if len(model) == 1 else f"model{i}"] = unwrap(chunk).sharded_state_dict()
    if with_optimizer:
        if is_loading:
            _ensure_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                          metadata=optim_metadata)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_state()
    return state


def _finish_param_gather(model) -> None:
    """Finish the parameter all-gather before weights are read outside a forward: with
    --overlap-param-gather a step updates only this DP rank's shard and the others arrive in the
    next forward's pre-hooks, so a save would hold them one step stale (as Megatron-LM, sync
    first). The forced gather counts as dispatched: that forward does not gather again."""
    for chunk in model:
        # megatron DDP sets use_forward_hook for use_distributed_optimizer + overlap_param_gather
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(args, iteration: int, model, optimizer, scheduler, consumed_train_samples: int,
                    flops_so_far: float = 0.0, log=print) -> str:
    """Write ``iter_<iteration>`` and then point the tracker at it. Returns the folder."""
    root = args.save
    final = checkpoint_dir(root, iteration)
    partial = final + ".partial"
    rank = dist.get_rank() if dist.is_initialized() else 0
    start = time.perf_counter()
    if read_tracker(root) == iteration and os.path.isdir(final):
        log(f"checkpoint of iteration {iteration} already saved in {final}")
        return final
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in (partial, final):  # leftovers of an interrupted save of this iteration
            if os.path.exists(stale):
                shutil.rmtree(stale)
        os.makedirs(partial)
    _barrier()
    _finish_param_gather(model)
    metadata = optimizer_metadata(args)
    state = _state_dict(model, optimizer, scheduler, with_optimizer=args.save_optim,
                        with_rng=args.save_rng, is_loading=False, optim_metadata=metadata)
    state.update(args=_saved_args(args), checkpoint_version=CHECKPOINT_VERSION,
                 optimizer_metadata=metadata,
                 adam_steps=_adam_steps(optimizer) if optimizer is not None and args.save_optim
                 else None,
                 iteration=iteration, consumed_train_samples=consumed_train_samples,
                 num_floating_point_operations_so_far=flops_so_far)
    dist_checkpointing.save(state, partial, get_default_save_sharded_strategy(args.ckpt_format),
                            validate_access_integrity=True)
    _barrier()  # every rank's shards are on disk
    if rank == 0:
        os.rename(partial, final)
        write_tracker(root, iteration)
    _barrier()
    log(f"saved checkpoint at iteration {iteration:7d} to {final} "
        f"({time.perf_counter() - start:.1f} s)")
    return final


def load_checkpoint(args, model, optimizer, scheduler, log=print) -> Tuple[int, int, float]:
    """Load ``--load`` (the tracker's iteration, or ``--ckpt-step``) into model, optimizer,
    scheduler and RNGs. Returns (iteration, consumed_train_samples, flops_so_far); (0, 0, 0)
    when there is no checkpoint yet."""
    root = args.load
    iteration = args.ckpt_step if args.ckpt_step is not None else read_tracker(root)
    if iteration is None:
        if args.exit_on_missing_checkpoint:
            raise FileNotFoundError(f"--load {root}: no {TRACKER} (no complete checkpoint)")
        log(f"no checkpoint in --load {root}: starting from scratch")
        return 0, 0, 0.0
    folder = checkpoint_dir(root, iteration)
    if not os.path.isdir(folder):
        flag = "--ckpt-step" if args.ckpt_step is not None else f"--load ({TRACKER})"
        raise FileNotFoundError(f"{flag}: checkpoint folder {folder} does not exist")
    with reading_checkpoint(folder):
        common = dist_checkpointing.load_common_state_dict(folder)
    saved = common.get("args", {})
    saved_layout = (saved.get("tensor_model_parallel_size"),
                    saved.get("pipeline_model_parallel_size"))
    layout = (parallel_state.get_tensor_model_parallel_world_size(),
              parallel_state.get_pipeline_model_parallel_world_size())
    resharding = saved_layout != layout
    has_optimizer = "opt_param_scheduler" in common
    changed = getattr(args, "_model_changed", False)  # --allow-model-change, see prepare_load
    load_optim = (optimizer is not None and args.load_optim and not args.finetune
                  and has_optimizer and not changed)
    load_rng = args.load_rng and not args.finetune and not resharding and "rng_state" in \
        _sharded_keys(folder)
    metadata = common.get("optimizer_metadata") or {}
    saved_distributed = bool(saved.get("use_distributed_optimizer"))
    if load_optim and saved_distributed != bool(args.use_distributed_optimizer):
        raise ValueError(
            f"--load {root}: {folder} holds the state of "
            f"{'the distributed' if saved_distributed else 'a non-distributed'} optimizer, this "
            f"run {'uses' if args.use_distributed_optimizer else 'does not use'} "
            "--use-distributed-optimizer; match the flag, or load the weights only with "
            "--no-load-optim")
    if resharding:
        log(f"resharding checkpoint from (TP, PP)={saved_layout} to {layout}; RNG states are not "
            "restored")
        if (load_optim and args.use_distributed_optimizer and saved.get("use_distributed_optimizer")
                and metadata.get("distrib_optim_sharding_type") == "dp_reshardable"):
            raise ValueError(
                f"--load {root}: the distributed optimizer state of {folder} was saved with "
                "--no-dist-ckpt-optim-fully-reshardable and cannot change TP/PP size; load it "
                "with --no-load-optim (weights only) or at (TP, PP)=" + str(saved_layout))
    if load_optim:
        check_scheduler(args, scheduler, common["opt_param_scheduler"], log=log)
    request = _state_dict(model, optimizer, scheduler, with_optimizer=load_optim,
                          with_rng=load_rng, is_loading=True, optim_metadata=metadata or None)
    fresh = _drop_tensors_not_in(request, folder) if changed else []
    with reading_checkpoint(folder):
        state = dist_checkpointing.load(request, folder, get_default_load_sharded_strategy(folder),
                                        strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    for i, chunk in enumerate(model):
        key = "model" if len(model) == 1 else f"model{i}"
        missing, unexpected = unwrap(chunk).load_state_dict(state[key], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if changed:  # --allow-model-change: what the checkpoint lacks keeps its initial values
            missing = []
        if missing or unexpected:
            raise RuntimeError(f"checkpoint {folder} does not match the model: missing={missing} "
                               f"unexpected={unexpected}")
    if load_optim:
        # no_grad: with fp32 parameters the distributed optimizer's main parameters are views of
        # the model's (leaves that require grad), and its dp_reshardable load copies into them
        with _step_tolerant_param_state_load(optimizer), torch.no_grad():
            optimizer.load_state_dict(state["optimizer"])
        if metadata.get("distrib_optim_sharding_type") == "dp_reshardable" and \
                common.get("adam_steps") is not None:
            _restore_adam_steps(optimizer, common["adam_steps"])
        # the loaded param groups carry the saving run's fused/foreach: this run's choice again
        set_fused_adam(optimizer, bool(getattr(args, "subq_fused_adam", False)))
        scheduler.load_state_dict(state["opt_param_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()  # fp32 main params from the loaded weights
    if load_rng:
        _restore_rng(state["rng_state"][0])
    if fresh:
        log(f"> --allow-model-change: {len(fresh)} tensors are not in the checkpoint and keep "
            f"their initial values: {', '.join(fresh[:8])}{' ...' if len(fresh) > 8 else ''}")
    _barrier()
    if args.finetune:
        log(f"loaded weights of iteration {iteration} from {folder} (--finetune: iteration 0)")
        return 0, 0, 0.0
    log(f"loaded checkpoint at iteration {iteration} from {folder}")
    return (iteration, int(common.get("consumed_train_samples", 0)),
            float(common.get("num_floating_point_operations_so_far", 0.0)))


# The LR/WD schedule's values megatron's OptimizerParamScheduler.load_state_dict compares with the
# checkpoint's: (state key, what it is, the flags that set it).
SCHEDULE_FIELDS = (
    ("max_lr", "learning rate", "--lr"),
    ("min_lr", "minimum learning rate", "--min-lr"),
    ("lr_warmup_steps", "warm-up samples",
     "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction"),
    ("lr_decay_steps", "decay samples", "--lr-decay-iters/--lr-decay-samples/--train-iters"),
    ("lr_decay_style", "decay style", "--lr-decay-style"),
    ("start_wd", "start weight decay", "--start-weight-decay/--weight-decay"),
    ("end_wd", "end weight decay", "--end-weight-decay/--weight-decay"),
    ("wd_incr_steps", "weight-decay samples", "--train-iters/--train-samples"),
    ("wd_incr_style", "weight-decay style", "--weight-decay-incr-style"),
)


def check_scheduler(args, scheduler, saved: dict, log=print) -> None:
    """Say which LR/WD schedule a resumed run follows, as Megatron-LM decides it:
    ``--override-opt-param-scheduler`` takes the flags', ``--use-checkpoint-opt-param-scheduler``
    the checkpoint's; with neither, a schedule that differs from the checkpoint's is a
    ``ValueError`` listing every difference and both flags (megatron-core would assert on the
    first one), raised before anything is loaded."""
    differing = [(what, flags, getattr(scheduler, key), saved[key])
                 for key, what, flags in SCHEDULE_FIELDS
                 if key in saved and getattr(scheduler, key) != saved[key]]
    if args.override_opt_param_scheduler:
        log("> LR/WD schedule from the flags (--override-opt-param-scheduler)"
            + (": " + "; ".join(f"{w} {ours} (checkpoint {theirs})"
                                for w, _, ours, theirs in differing) if differing else ""))
    elif args.use_checkpoint_opt_param_scheduler:
        log("> LR/WD schedule from the checkpoint (--use-checkpoint-opt-param-scheduler)"
            + (": " + "; ".join(f"{w} {theirs} (flags {ours})"
                                for w, _, ours, theirs in differing) if differing else ""))
    elif differing:
        lines = "; ".join(f"{w} ({flags}): flags {ours}, checkpoint {theirs}"
                          for w, flags, ours, theirs in differing)
        raise ValueError(
            f"--load {args.load}: the LR/WD schedule of these flags differs from the "
            f"checkpoint's: {lines}. Resume with the checkpoint's schedule "
            "(--use-checkpoint-opt-param-scheduler) or replace it with the flags' "
            "(--override-opt-param-scheduler); sample counts are iterations x global batch")
    else:
        log("> LR/WD schedule: the flags and the checkpoint agree")


def _drop_tensors_not_in(request: dict, folder: str) -> list:
    """Remove from the model part of a load request the tensors the checkpoint does not hold
    (--allow-model-change); returns their keys. Tensors held with another shape still fail."""
    from megatron.core.dist_checkpointing.serialization import (  # noqa: PLC0415
        load_sharded_metadata,
    )

    held = set(load_sharded_metadata(folder))
    dropped = []
    for name in [k for k in request if k.startswith("model")]:
        for key, value in list(request[name].items()):
            if getattr(value, "key", key) not in held:
                del request[name][key]
                if not key.endswith("_extra_state"):
                    dropped.append(key)
    return dropped


def _sharded_keys(folder: str) -> set:
    """The top-level names stored in ``folder`` (``rng_state`` when the RNG states were saved)."""
    from megatron.core.dist_checkpointing.serialization import (  # noqa: PLC0415
        load_sharded_metadata,
    )

    try:
        return {k.split(".")[0].split("/")[0] for k in load_sharded_metadata(folder)}
    except Exception:  # noqa: BLE001 - older formats: assume present
        return {"rng_state"}


def saved_args(folder_or_root: str, iteration: Optional[int] = None) -> dict:
    """The arguments stored in a checkpoint (a ``--load`` root or an ``iter_*`` folder)."""
    folder = folder_or_root
    if os.path.isfile(os.path.join(folder_or_root, TRACKER)) or iteration is not None:
        it = iteration if iteration is not None else read_tracker(folder_or_root)
        folder = checkpoint_dir(folder_or_root, it)
    with reading_checkpoint(folder):
        return dict(dist_checkpointing.load_common_state_dict(folder).get("args", {}))


# ------------------------------------------------------------------------------------------------
# damaged checkpoints: say which folder and file, and which complete checkpoint to load instead
# ------------------------------------------------------------------------------------------------
class CheckpointReadError(RuntimeError):
    """A checkpoint's files cannot be read (truncated, overwritten, missing). The message names
    the folder, the damaged file(s) where found, and the complete checkpoints beside it; the
    original exception is chained (``__cause__``)."""


_ITER_DIR = re.compile(r"^iter_(\d+)$")
# exceptions (anywhere in the chain, or in torch's per-rank CheckpointException failures) that
# mean the bytes on disk are bad, when no file can be pointed at
_READ_ERRORS = (EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError, json.JSONDecodeError,
                UnicodeDecodeError)


def damaged_files(folder: str) -> List[str]:
    """``file: reason`` for every file of a torch_dist checkpoint folder that is missing or cannot
    be what the checkpoint says: ``metadata.json`` (not JSON), ``.metadata`` (not the pickled
    index), ``common.pt`` (not a readable zip), a ``*.distcp`` shard missing or shorter than the
    bytes the index places in it. Empty when nothing is found (garbage of the right length inside
    a shard goes unnoticed: torch_dist keeps no checksums)."""
    found = []

    def path(name):
        return os.path.join(folder, name)

    try:
        with open(path("metadata.json"), encoding="utf-8") as f:
            if not isinstance(json.load(f), dict):
                raise ValueError("not a JSON object")
    except FileNotFoundError:
        found.append(f"{path('metadata.json')}: missing")
    except (OSError, ValueError) as e:
        found.append(f"{path('metadata.json')}: unreadable ({type(e).__name__}: {e})")
    try:
        if not zipfile.is_zipfile(path("common.pt")):
            raise zipfile.BadZipFile("not a torch.save zip archive (truncated or overwritten)")
        with zipfile.ZipFile(path("common.pt")) as z:
            bad = z.testzip()
        if bad is not None:
            raise zipfile.BadZipFile(f"member {bad} fails its CRC check")
    except FileNotFoundError:
        found.append(f"{path('common.pt')}: missing")
    except (OSError, zipfile.BadZipFile) as e:
        found.append(f"{path('common.pt')}: unreadable ({e})")
    try:
        with open(path(".metadata"), "rb") as f:
            index = pickle.load(f)  # what torch.distributed.checkpoint itself reads
        storage = index.storage_data
    except FileNotFoundError:
        found.append(f"{path('.metadata')}: missing")
        return found
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        found.append(f"{path('.metadata')}: unreadable ({type(e).__name__}: {e})")
        return found
    needed = {}
    for info in (storage or {}).values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        try:
            actual = os.path.getsize(path(name))
        except OSError:
            found.append(f"{path(name)}: missing")
            continue
        if actual < size:
            found.append(f"{path(name)}: truncated ({actual} bytes, the index needs {size})")
    return found


def complete_checkpoints(root: str) -> List[int]:
    """Iterations of the ``iter_*`` folders under ``root`` (``.partial`` ones excluded) whose
    files are all present and consistent (``damaged_files`` finds nothing), ascending."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = []
    for name in names:
        m = _ITER_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)) and \
                not damaged_files(os.path.join(root, name)):
            out.append(int(m.group(1)))
    return sorted(out)


def _read_error_in(e: BaseException, depth: int = 0) -> bool:
    """Whether a bad-bytes error is anywhere in ``e``'s chain or torch's per-rank failures."""
    if depth > 20 or e is None:
        return False
    if isinstance(e, _READ_ERRORS) and not isinstance(e, (FileNotFoundError, PermissionError)):
        return True
    if isinstance(e, RuntimeError) and "PytorchStreamReader" in str(e):
        return True
    for failure in (getattr(e, "failures", None) or {}).values():  # CheckpointException
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException) and _read_error_in(inner, depth + 1):
            return True
    return _read_error_in(e.__cause__ or e.__context__, depth + 1)


def describe_damage(folder: str, error: Optional[BaseException] = None) -> str:
    """The message of a ``CheckpointReadError`` for ``folder``: the damaged files (when they can
    be found), and the complete checkpoints of its root with the flag that loads one."""
    folder = os.path.normpath(folder)
    root = os.path.dirname(folder) if _ITER_DIR.match(os.path.basename(folder)) else folder
    files = damaged_files(folder)
    text = f"checkpoint {folder} is damaged and cannot be loaded: "
    text += "; ".join(files) if files else (
        f"reading it failed ({type(error).__name__}: {str(error).strip()[:300]})" if error
        else "reading it failed")
    m = _ITER_DIR.match(os.path.basename(folder))
    current = int(m.group(1)) if m else None
    others = [i for i in complete_checkpoints(root) if i != current]
    if not others:
        return text + f". There is no other complete checkpoint in {root}."
    earlier = [i for i in others if current is None or i < current]
    pick = (earlier or others)[-1]
    return (text + f". Complete checkpoints in {root}: iteration(s) "
            f"{', '.join(str(i) for i in others)}; load one with `--ckpt-step {pick}` (or remove "
            f"the damaged folder and fix {TRACKER}).")


@contextlib.contextmanager
def reading_checkpoint(folder: str):
    """Turn a failure to read ``folder``'s files into a ``CheckpointReadError`` saying what is
    damaged (the original exception chained). Errors that are not about the bytes on disk — a
    model that does not match the checkpoint's shapes, a missing key — pass through unchanged.
    (torch's ``CheckpointException`` is a ``BaseException``, hence the broad catch.)"""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit, CheckpointReadError):
        raise
    except BaseException as e:  # noqa: BLE001
        if not os.path.isdir(folder):  # not there at all: not "damaged"
            raise
        if damaged_files(folder) or _read_error_in(e):
            raise CheckpointReadError(describe_damage(folder, e)) from e
        raise
