"""``--subq-fused-adam``: torch's fused Adam/AdamW inside megatron-core's optimizer.

Without Transformer Engine or apex, megatron-core 0.16.1 builds ``torch.optim.AdamW`` (or
``Adam``) with torch's default implementation (``foreach``: one kernel per operation over lists
of tensors), which took 30 ms of a 387 ms step of the 1.3B Transformer++ on one H200.
``set_fused_adam(optimizer, True)`` switches the param groups of every inner torch Adam (the
distributed optimizer's, each of a chained optimizer's) to torch's fused implementation
(``fused=True, foreach=False``: one kernel per step for all parameters of a device and dtype),
the same update rule, on CUDA and CPU parameters (torch fuses both).

What it keeps unchanged, so a checkpoint does not depend on the flag:

* The state it saves: a state-dict hook on each switched optimizer writes the param groups'
  ``fused``/``foreach`` as the optimizer was built and every ``step`` as a CPU float32 scalar
  (torch keeps ``step`` on the parameter's device when fused), so a checkpoint saved with the
  flag equals one saved without it, key for key.
* What a load brings back: torch's ``load_state_dict`` takes ``fused``/``foreach`` from the
  loaded groups, so ``checkpointing.load_checkpoint`` calls ``set_fused_adam`` again with the
  run's own choice (on or off), which also moves each ``step`` to where that implementation
  keeps it.

TE's or apex's ``FusedAdam`` (what megatron-core builds when either is importable) is fused
already: it is left as it is and the returned note says so.
"""

from __future__ import annotations

from typing import List

import torch

FLAG = "--subq-fused-adam"
# the device types whose parameters torch's fused Adam takes (torch 2.13 also fuses on the CPU)
FUSED_DEVICE_TYPES = ("cuda", "cpu")


def inner_optimizers(optimizer) -> List[object]:
    """The optimizers megatron-core wraps (``MegatronOptimizer.optimizer``), over every member
    of a ``ChainedOptimizer``; ranks without parameters (inner None) are skipped."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            out.append(inner)
    return out


def _is_fused_elsewhere(inner) -> bool:
    """TE's or apex's FusedAdam (megatron-core's choice when either is importable)."""
    module = type(inner).__module__ or ""
    return type(inner).__name__ == "FusedAdam" and module.split(".")[0] in (
        "transformer_engine", "apex")


def _check_params(inner) -> None:
    for group in inner.param_groups:
        if group.get("differentiable"):
            raise ValueError(f"{FLAG}: torch's fused Adam refuses differentiable=True param "
                             f"groups; allowed: --no-subq-fused-adam")
        for p in group["params"]:
            if p.device.type not in FUSED_DEVICE_TYPES or not p.is_floating_point():
                raise ValueError(
                    f"{FLAG}: torch's fused Adam needs floating-point parameters on "
                    f"{' or '.join(FUSED_DEVICE_TYPES)}; this optimizer holds a {p.dtype} "
                    f"parameter on {p.device.type}; allowed: --no-subq-fused-adam")


def _place_steps(inner, fused: bool) -> None:
    """Each ``step`` where torch's Adam keeps it: on the parameter's device when fused or
    capturable, else a CPU scalar; float32 either way (copies: never shared between params)."""
    for group in inner.param_groups:
        on_device = fused or group.get("capturable", False)
        for p in group["params"]:
            state = inner.state.get(p)
            if not state or not torch.is_tensor(state.get("step")):
                continue
            device = p.device if on_device else torch.device("cpu")
            step = state["step"]
            if step.device != device or step.dtype != torch.float32:
                state["step"] = step.detach().to(device=device, dtype=torch.float32, copy=True)


def _as_built_state_dict(inner, state_dict):
    """State-dict post hook: the state as the unfused optimizer would save it (``fused`` and
    ``foreach`` as built, CPU ``step``), without touching the live state."""
    defaults = inner.defaults
    groups = []
    for group in state_dict["param_groups"]:
        group = dict(group)
        for key in ("fused", "foreach"):
            if key in group:
                group[key] = defaults.get(key)
        groups.append(group)
    states = {}
    for key, value in state_dict["state"].items():
        if isinstance(value, dict) and torch.is_tensor(value.get("step")) \
                and value["step"].device.type != "cpu":
            value = {**value, "step": value["step"].detach().to("cpu", torch.float32)}
        states[key] = value
    return {**state_dict, "param_groups": groups, "state": states}


def set_fused_adam(optimizer, fused: bool) -> str:
    """Switch every inner torch Adam/AdamW of a megatron-core optimizer to torch's fused
    implementation (``fused=True``) or back to the one it was built with (``fused=False``: the
    groups' ``fused``/``foreach`` from the optimizer's defaults). Idempotent; call it after
    building the optimizer and after every load of its state (both done by the trainer).

    Returns a one-line note of what it did ("" when off and nothing was switched). Raises
    ValueError naming ``--subq-fused-adam`` when on and an inner optimizer is neither torch's
    Adam nor an already fused one, or holds parameters torch's fused Adam refuses."""
    notes = []
    for inner in inner_optimizers(optimizer):
        if isinstance(inner, torch.optim.Adam):  # AdamW is its subclass
            if fused:
                _check_params(inner)
            for group in inner.param_groups:
                group["fused"] = True if fused else inner.defaults.get("fused")
                group["foreach"] = False if fused else inner.defaults.get("foreach")
            _place_steps(inner, fused)
            hook = getattr(inner, "_subq_fused_adam_hook", None)
            if fused and hook is None:
                inner._subq_fused_adam_hook = inner.register_state_dict_post_hook(
                    _as_built_state_dict)
            elif not fused and hook is not None:
                hook.remove()
                del inner._subq_fused_adam_hook
            if fused:
                devices = sorted({p.device.type for g in inner.param_groups for p in g["params"]})
                notes.append(f"torch {type(inner).__name__} fused (fused=True, foreach=False) on "
                             f"{len(inner.param_groups)} param groups ({', '.join(devices)})")
        elif _is_fused_elsewhere(inner):
            if fused:
                notes.append(f"{type(inner).__module__}.{type(inner).__name__} is fused "
                             "already: nothing changed")
        elif fused:
            raise ValueError(f"{FLAG} switches torch's Adam/AdamW to its fused implementation; "
                             f"this optimizer is {type(inner).__module__}.{type(inner).__name__}; "
                             "allowed: --optimizer adam, or --no-subq-fused-adam")
    return "; ".join(notes)
