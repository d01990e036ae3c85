"""Run a function in N gloo processes with megatron's parallel state set up (CPU or GPU).

    results = run_distributed(fn, world_size=2, tp=2, args=(...))   # one result per rank

``fn`` must be a module-level function (it is pickled into spawned processes). Each process:
initialises ``torch.distributed`` (gloo on the CPU, NCCL with CUDA unless ``backend`` says
otherwise), installs the CPU fallbacks when CUDA is absent, calls
``initialize_model_parallel(tp, pp)`` and ``model_parallel_cuda_manual_seed(seed)``, then returns
``fn(*args)`` to the parent through a file. An exception in any rank is re-raised in the parent
with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from typing import Any, Callable, List, Sequence

import torch
import torch.multiprocessing as mp

from ..distributed import free_port


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, **parallel_kwargs) -> None:
    """Megatron's parallel state + RNG for an already-initialised process group."""
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: PLC0415

    from ..cpu import install_cpu_fallbacks  # noqa: PLC0415

    install_cpu_fallbacks()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp, **parallel_kwargs)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def reinit_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, **parallel_kwargs) -> None:
    """Switch an initialised world to another layout between two model builds, seeded exactly
    as a fresh ``run_distributed`` rank (``init_parallel``): several layouts in one launch."""
    from megatron.core import parallel_state  # noqa: PLC0415

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_parallel(tp=tp, pp=pp, seed=seed, **parallel_kwargs)


def _worker(rank: int, world_size: int, port: int, tp: int, pp: int, seed: int, backend: str,
            fn: Callable, args: Sequence, out_dir: str, parallel_kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.distributed.init_process_group(backend, rank=rank, world_size=world_size)
        init_parallel(tp=tp, pp=pp, seed=seed, **parallel_kwargs)
        result = fn(*args)
        with open(result_path, "wb") as f:
            pickle.dump(("ok", _to_cpu(result)), f)
    except BaseException:  # noqa: BLE001 - report everything to the parent
        with open(result_path, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
    finally:
        from megatron.core import parallel_state  # noqa: PLC0415

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def run_distributed(fn: Callable, world_size: int, tp: int = 1, pp: int = 1, args: Sequence = (),
                    seed: int = 1234, backend: str | None = None, **parallel_kwargs) -> List[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks; return the list of per-rank results."""
    if world_size % (tp * pp):
        raise ValueError(f"world_size={world_size} must be a multiple of tp*pp={tp * pp}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    with tempfile.TemporaryDirectory(prefix="subq-dist-") as out_dir:
        mp.start_processes(_worker, nprocs=world_size, join=True, start_method="spawn",
                           args=(world_size, free_port(), tp, pp, seed, backend, fn, tuple(args),
                                 out_dir, parallel_kwargs))
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} exited without a result")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
