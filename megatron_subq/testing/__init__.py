"""Test harness: megatron-core on CPU processes with gloo (see ``cpu`` for every CUDA patch)."""

from .cpu import install_cpu_fallbacks
from .distributed import free_port, init_parallel, run_distributed

__all__ = ["install_cpu_fallbacks", "free_port", "init_parallel", "run_distributed"]
