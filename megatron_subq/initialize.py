"""One-process set-up for using the library outside a launcher (notebooks, scripts, the README).

megatron-core's layers read its global parallel state and need a ``torch.distributed`` process
group even for one process; ``init_single_process`` creates both (TP = PP = 1), seeds every RNG
megatron uses, and on a machine without CUDA installs the CPU fallbacks (gloo). Under torchrun or
in the trainer, megatron's parallel state is set up there instead.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_single_process(seed: int = 1234) -> None:
    """Make this process a world of one: a process group (nccl on CUDA, else gloo), megatron's
    parallel state at TP = PP = 1 and seeded RNGs. Calling it again is a no-op, so scripts and
    notebooks may call it freely; ``destroy_single_process`` undoes it."""
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: PLC0415

    from .cpu import install_cpu_fallbacks  # noqa: PLC0415
    from .distributed import free_port  # noqa: PLC0415

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        # MASTER_ADDR/MASTER_PORT when the caller set them, else a free port of our own, kept out
        # of os.environ: a port left there would send a child process (a trainer, torchrun's
        # workers, a notebook's subprocess) to this process's socket (EADDRINUSE)
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT") or str(free_port())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                init_method=f"tcp://{addr}:{port}", rank=0, world_size=1)
    if not torch.cuda.is_available():
        install_cpu_fallbacks()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                                 pipeline_model_parallel_size=1)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)


def destroy_single_process() -> None:
    """Tear down what ``init_single_process`` set up (megatron's parallel state, the group)."""
    from megatron.core import parallel_state  # noqa: PLC0415

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
