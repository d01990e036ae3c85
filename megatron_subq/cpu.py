"""Running megatron-core on the CPU (gloo): every CUDA assumption we patch, in one place.

megatron-core assumes CUDA in a few spots that our CPU runs (CI, newcomers without a GPU) reach.
``install_cpu_fallbacks()`` patches exactly these, and only when CUDA is absent; it is a no-op on a
GPU machine. Each patch says what it answers:

1. ``torch.cuda.current_device()`` -> ``"cpu"``: tensor_parallel/mappings.py, p2p communication and
   the optimizer allocate buffers with ``device=torch.cuda.current_device()``.
2. ``GlobalMemoryBuffer.get_tensor``: sequence-parallel all-gathers take their buffer from it; it
   allocates on ``torch.cuda.current_device()`` (covered by 1) — no separate patch needed.
3. ``CudaRNGStatesTracker.add/fork``: the model-parallel RNG tracker keeps CUDA generator states.
   On the CPU, ``add`` records the seed and ``fork`` runs under a forked CPU generator seeded from it,
   so dropout inside ``fork()`` still differs per TP rank as megatron intends.
4. A ``TorchFunctionMode`` that maps ``device="cuda"`` (and ``.cuda()``, ``.to("cuda")``) to the CPU:
   pipeline schedules, the optimizer, grad scaler, grad clipping and the default causal mask
   create tensors with ``device="cuda"`` literals.
5. ``torch.cuda.synchronize`` / ``torch.cuda.empty_cache`` / memory statistics -> no-ops/zeros
   (torch_dist saves and logging call them).
6. ``param.grad.type() == 'torch.cuda.FloatTensor'`` in clip_grads: under the mode, ``Tensor.type()``
   (no arguments) names the CUDA type of a CPU tensor.
7. ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` -> None / no-op:
   activation recomputation (``CheckpointFunction``) saves and restores the CUDA generator's state
   around the recomputed forward; megatron still saves and restores the CPU generator and the
   tracker (3) there.
8. ``pin_memory=True`` (and ``Tensor.pin_memory()``) under the mode of 4 -> unpinned: RoPE's
   per-context-parallel-rank index (``rope_utils.get_pos_emb_on_this_cp_rank``) pins a CPU
   tensor, which needs an accelerator.
9. ``tensor_parallel.random.CheckpointFunction.backward`` runs under the mode of 4: activation
   recomputation re-runs the forward inside autograd's backward, where torch does not carry the
   mode (Python function modes are not active in a custom Function's backward), so megatron's
   local ``DotProductAttention`` recomputed under ``--recompute-granularity selective`` met its
   ``device="cuda"`` causal mask (``transformer/utils.py: get_default_causal_mask``) unpatched.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    d = torch.device(device)
    return torch.device("cpu") if d.type == "cuda" else d


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch function call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # 8
            kwargs["pin_memory"] = False
        name = getattr(func, "__name__", "")
        if name in ("cuda", "pin_memory"):  # Tensor.cuda(...), 8: Tensor.pin_memory()
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs:  # 6: Tensor.type() type checks
            t = func(*args)
            return t.replace("torch.", "torch.cuda.", 1) if ".cuda." not in t else t
        if name == "to" and args:
            args = tuple(_cpu_device(a) if (isinstance(a, torch.device) or
                                           (isinstance(a, str) and a.startswith("cuda")))
                         else a for a in args)
        return func(*args, **kwargs)


class _CpuRngTracker:
    """The CPU stand-in for megatron's ``CudaRNGStatesTracker``."""

    def __init__(self):
        self.seeds = {}
        self._states = {}

    def reset(self):
        self.seeds, self._states = {}, {}

    def get_states(self):
        return dict(self._states)

    def set_states(self, states):
        self._states = dict(states)

    def add(self, name, seed):
        if name in self.seeds:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds[name] = seed
        self._states[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self._states:
            yield
            return
        saved = torch.get_rng_state()
        torch.set_rng_state(self._states[name])
        try:
            yield
        finally:
            self._states[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

    def is_initialized(self):
        return True


def install_cpu_fallbacks() -> bool:
    """Apply the CPU patches once per process when CUDA is absent. Returns True if installed."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if torch.cuda.is_available():
        return False

    torch.cuda.current_device = lambda: "cpu"  # 1
    torch.cuda.synchronize = lambda *a, **k: None  # 5
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_reserved = lambda *a, **k: 0
    torch.cuda.memory_reserved = lambda *a, **k: 0
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.manual_seed_all = lambda *a, **k: None

    from megatron.core.tensor_parallel import random as tp_random  # noqa: PLC0415

    tp_random._get_cuda_rng_state = lambda *a, **k: None  # 7
    tp_random._set_cuda_rng_state = lambda *a, **k: None

    tracker = _CpuRngTracker()  # 3
    tp_random._CUDA_RNG_STATE_TRACKER = tracker
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tp_random.initialize_rng_tracker = lambda *a, **k: None
    tp_random.get_cuda_rng_tracker = functools.wraps(tp_random.get_cuda_rng_tracker)(
        lambda *a, **k: tracker)
    for mod_name in ("megatron.core.tensor_parallel", "megatron.core.tensor_parallel.layers",
                     "megatron.core.transformer.transformer_layer",
                     "megatron.core.transformer.attention", "megatron.core.transformer.mlp",
                     "megatron.core.models.common.embeddings.language_model_embedding",
                     "megatron.core.transformer.dot_product_attention"):
        try:
            mod = __import__(mod_name, fromlist=["_"])
        except ImportError:
            continue
        if hasattr(mod, "get_cuda_rng_tracker"):
            mod.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker

    checkpoint_backward = tp_random.CheckpointFunction.backward  # 9

    @functools.wraps(checkpoint_backward)
    def backward_under_mode(ctx, *grads):
        with CudaToCpuMode():
            return checkpoint_backward(ctx, *grads)

    tp_random.CheckpointFunction.backward = staticmethod(backward_under_mode)

    CudaToCpuMode().__enter__()  # 4: stays active for the life of the process
    _INSTALLED = True
    return True
