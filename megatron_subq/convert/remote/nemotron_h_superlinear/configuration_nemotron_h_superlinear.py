"""NemotronH with Superlinear attention layers: the configuration (Hugging Face remote code).

Shipped by megatron_subq (``megatron_subq/convert/remote/nemotron_h_superlinear/``) and copied
into every folder ``export_hf`` writes for a NemotronH model with Superlinear '*' slots; loaded
with ``AutoConfig.from_pretrained(folder, trust_remote_code=True)``. It needs transformers >= 5.3
(native NemotronH) and nothing of megatron_subq.

``NemotronHSuperlinearConfig`` is ``NemotronHConfig`` plus the Superlinear knobs, named as
megatron_subq's config fields (``superlinear_*``, same meaning and defaults), and
``superlinear_layers``: the 0-based indices of the attention layers that are Superlinear (None:
every attention layer; the others stay NemotronH's standard attention).
"""

from __future__ import annotations

from transformers import NemotronHConfig


class NemotronHSuperlinearConfig(NemotronHConfig):
    """``NemotronHConfig`` + Superlinear knobs (module docstring). Defaults are megatron_subq's:
    search power p = 1/2, span power 1/2, top-2 anchors, backward factor 2, forward factor 0,
    window index 32 (w = 1088 keys at p = 1/2, the paper's)."""

    model_type = "nemotron_h_superlinear"

    superlinear_search_power: float = 0.5
    superlinear_span_power: float = 0.5
    superlinear_topk: int = 2
    superlinear_backward_factor: float = 2.0
    superlinear_forward_factor: float = 0.0
    superlinear_sw_index: int = 32
    # the knobs break random context access knowingly (megatron_subq's config refuses otherwise)
    superlinear_allow_no_random_access: bool = False
    # 0-based layer indices of the Superlinear attention layers; None: every attention layer
    superlinear_layers: list[int] | None = None
    # "auto": megatron_subq's op (its kernels) on CUDA when importable, else this folder's
    # PyTorch; "torch": always this folder's PyTorch
    superlinear_impl: str = "auto"


__all__ = ["NemotronHSuperlinearConfig"]
