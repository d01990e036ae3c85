"""Test harness: megatron-core on CPU processes with gloo (``megatron_subq.cpu`` holds every
CUDA patch; it is runtime code, the trainer uses it too)."""

from .distributed import init_parallel, run_distributed

__all__ = ["init_parallel", "run_distributed"]
