"""A trained checkpoint, ready for inference: its model, trainer arguments and tokenizer.

Evaluation tools (generation, lm-evaluation-harness, NIAH) load checkpoints through this one
function. Run as a single process it creates a process group of one (gloo on the CPU, NCCL on a
GPU) and megatron's parallel state; under torchrun it uses the group that exists, at the TP size
given (torch_dist reshards the checkpoint). The whole pipeline must be on each rank (PP = 1):
decoding runs the model token by token.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class LoadedModel:
    """``model``: the host model (GPTModel or MambaModel), eval mode, on the GPU when there is
    one; ``args``: the checkpoint's trainer arguments; ``tokenizer``: the one it was trained
    with (``tokenize``, ``detokenize``, ``eod``, ``vocab_size``); ``iteration``: the step
    loaded; ``created_process_group``: True if loading created the process group
    (``unload`` destroys it)."""

    model: torch.nn.Module
    args: Any
    tokenizer: Any
    iteration: Optional[int]
    created_process_group: bool


def load_for_inference(load: str, ckpt_step: Optional[int] = None,
                       tensor_model_parallel_size: int = 1, **overrides) -> LoadedModel:
    """The checkpoint in ``load`` (its latest step, or ``ckpt_step``) at TP =
    ``tensor_model_parallel_size`` (default 1; the world size must be a multiple of it),
    PP = 1. ``overrides`` set trainer arguments of the rebuilt model (e.g. ``bf16=True``,
    ``subq_impl="reference"``). Raises ``FileNotFoundError``/``ValueError`` naming ``load`` or the
    argument before any process group is created."""
    import torch.distributed as dist  # noqa: PLC0415

    from ..convert.api import checkpoint_namespace, load_converted_model  # noqa: PLC0415
    from ..training.checkpointing import checkpoint_folder, read_tracker, saved_args  # noqa: PLC0415
    from ..training.tokenizer import build_tokenizer  # noqa: PLC0415
    from ..training.trainer import initialize_distributed  # noqa: PLC0415

    if not isinstance(tensor_model_parallel_size, int) or tensor_model_parallel_size < 1:
        raise ValueError(f"tensor_model_parallel_size={tensor_model_parallel_size!r}: must be an "
                         "integer >= 1")
    folder = checkpoint_folder(load, ckpt_step)
    if folder is None or not os.path.isdir(folder):
        raise FileNotFoundError(f"load={load!r}: no checkpoint folder there (ckpt_step="
                                f"{ckpt_step}; a checkpoint root holds the tracker file "
                                "latest_checkpointed_iteration.txt)")
    args, _ = checkpoint_namespace(saved_args(folder), folder)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE",
                                                                                   "1"))
    if world % tensor_model_parallel_size:
        raise ValueError(f"tensor_model_parallel_size={tensor_model_parallel_size}: must divide "
                         f"the world size {world}")
    args.tensor_model_parallel_size = tensor_model_parallel_size
    args.pipeline_model_parallel_size = 1
    args.context_parallel_size = 1
    args.expert_model_parallel_size = 1
    args.expert_tensor_parallel_size = None
    args.data_parallel_size = world // tensor_model_parallel_size
    args.micro_batch_size, args.global_batch_size = 1, args.data_parallel_size
    args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    created = initialize_distributed(args)
    model, args = load_converted_model(load, ckpt_step, **overrides)
    model.eval()
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    step = ckpt_step if ckpt_step is not None else read_tracker(load)
    return LoadedModel(model=model, args=args, tokenizer=tokenizer, iteration=step,
                       created_process_group=created)


def unload(loaded: LoadedModel) -> None:
    """Tear down the parallel state (and the process group if ``load_for_inference`` made it)."""
    from ..training.trainer import teardown  # noqa: PLC0415

    teardown(loaded.created_process_group)
