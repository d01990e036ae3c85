"""``HybridStack``: megatron-core's ``MambaStack`` with one spec per layer and any final norm.

megatron-core 0.16.1's ``MambaStack.__init__`` takes one ``attention_layer`` spec for every
``*`` slot (so slots cannot hold different variants) and always builds a Transformer Engine
``TENorm`` as its final norm (no CPU path). ``HybridStack`` replaces only ``__init__``: it
allocates the layers with megatron's ``allocate_layers`` and pipeline split
(``MambaStack._select_layers_for_pipeline_parallel``), builds layer n from
``submodules.layer_specs`` (global index) and its final norm from ``submodules.final_norm``.
Forward, sharded state dict (keys ``layers.<global n-1>.``), ``set_input_tensor`` and the
inference hooks are ``MambaStack``'s own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Union

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.mamba_block import MambaStack
from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols, allocate_layers
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import nn


@dataclass
class HybridStackSubmodules:
    """Every layer's spec (index = global layer number - 1) and the final norm's."""

    layer_specs: List[ModuleSpec] = field(default_factory=list)
    final_norm: Union[ModuleSpec, type] = IdentityOp


class HybridStack(MambaStack):
    """``MambaStack`` whose layer n is ``submodules.layer_specs[n-1]``; arguments as
    ``MambaStack`` (``MambaModel`` passes them). Attention/MLP/MoE layers get their local index
    as ``layer_number`` (``TransformerLayer`` adds the pipeline offset), Mamba layers the global
    one, as in ``MambaStack``."""

    def __init__(self, config, submodules: HybridStackSubmodules, residual_in_fp32=False,
                 pre_process: bool = True, hybrid_attention_ratio: float = 0.0,
                 hybrid_mlp_ratio: float = 0.0, hybrid_override_pattern: str = None,
                 post_layer_norm: bool = True, post_process: bool = True, device=None,
                 dtype=None, pg_collection: ProcessGroupCollection = None) -> None:
        MegatronModule.__init__(self, config=config)  # MambaStack.__init__ is what we replace
        if pg_collection is None:
            raise ValueError("HybridStack needs pg_collection (MambaModel passes its own)")
        if len(submodules.layer_specs) != config.num_layers:
            raise ValueError(f"HybridStackSubmodules has {len(submodules.layer_specs)} layer "
                             f"specs; allowed: num_layers={config.num_layers}")
        self.residual_in_fp32 = residual_in_fp32
        self.pre_process, self.post_process = pre_process, post_process
        self.post_layer_norm = post_layer_norm
        self.pp_group, self.tp_group = pg_collection.pp, pg_collection.tp
        self.input_tensor = None
        self.hybrid_attention_ratio = hybrid_attention_ratio
        self.hybrid_mlp_ratio = hybrid_mlp_ratio
        self.hybrid_override_pattern = hybrid_override_pattern
        self.layer_type_list = allocate_layers(config.num_layers, hybrid_attention_ratio,
                                               hybrid_mlp_ratio, hybrid_override_pattern)
        offset = 0
        if self.pp_group.size() > 1:
            offset, self.layer_type_list = self._select_layers_for_pipeline_parallel(
                self.layer_type_list)
        self.layers = nn.ModuleList()
        for i, symbol in enumerate(self.layer_type_list):
            spec = submodules.layer_specs[offset + i]
            if symbol == Symbols.MAMBA:
                layer = build_module(spec, config=config, residual_in_fp32=residual_in_fp32,
                                     layer_number=offset + i + 1, pp_layer_offset=offset,
                                     pg_collection=pg_collection)
            else:
                layer = build_module(spec, config=config, layer_number=i + 1,
                                     pg_collection=pg_collection)
            if layer.layer_number != offset + i + 1:  # TransformerLayer's offset vs ours
                raise RuntimeError(f"layer {offset + i + 1} was numbered {layer.layer_number}: "
                                   "the pipeline split of the hybrid stack and megatron's "
                                   "transformer-layer offset disagree")
            self.layers.append(layer)
        self.num_layers_per_pipeline_rank = len(self.layers)
        if post_process and post_layer_norm:
            self.final_norm = build_module(submodules.final_norm, config=config,
                                           hidden_size=config.hidden_size,
                                           eps=config.layernorm_epsilon)
