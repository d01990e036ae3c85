"""megatron-core's ``SequentialMLP`` (the local path's routed experts), without the empty experts
when nothing is trained.

megatron's ``SequentialMLP.forward`` splits the permuted tokens by expert and runs every local
expert on its slice, empty slices included. In training that keeps every expert's parameters in
the autograd graph (megatron's DDP waits for a gradient hook per parameter). In generation it is
pure cost: a one-token decode step with top-k routing over E experts runs E - k empty expert MLPs
per MoE layer, with their launches and host work (Nemotron-3-Nano: 122 of 128 per layer, 23 MoE
layers). ``SubqSequentialMLP`` runs only the experts that received tokens when autograd is off
(``torch.no_grad()``, ``torch.inference_mode()``: generation, evaluation, scoring) and is
megatron's forward otherwise. The outputs are the same tensors: the same slices through the same
experts, concatenated in the same order (an empty expert contributes an empty slice).

``SubqLocalSpecProvider.grouped_mlp_modules`` (slots.py) puts it where megatron's local spec has
``SequentialMLP``; grouped GEMM and Transformer Engine's experts are unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


class SubqSequentialMLP(SequentialMLP):
    """``SequentialMLP`` that skips experts with no tokens when autograd is off (module
    docstring). Same constructor, parameters and state dict as megatron's."""

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        cfg = self.config
        if torch.is_grad_enabled() or self.num_local_experts == 1 or cfg.fp8 or cfg.fp4 \
                or cfg.moe_apply_probs_on_input:
            return super().forward(permuted_local_hidden_states, tokens_per_expert,
                                   permuted_probs)
        outputs, start = [], 0
        for expert, count in zip(self.local_experts, tokens_per_expert.tolist()):
            if count:
                stop = start + count
                out, _ = expert(permuted_local_hidden_states[start:stop],
                                permuted_probs[start:stop])
                outputs.append(out)
                start = stop
        if not outputs:  # no token reached this rank's experts
            return permuted_local_hidden_states[:0], None
        return torch.cat(outputs, dim=0), None
