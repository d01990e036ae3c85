"""sas: Simulated Attention Score — megatron's ``SelfAttention`` with an SAS core.

The SAS layer is "fused QKV projection -> head/feature expansion -> causal attention over Ĥ
simulated heads -> PEAA group average -> output projection". Everything between the projections
sits in megatron's ``core_attention`` slot, so the self-attention is megatron's own
(column-parallel QKV, RoPE, GQA layout, sequence parallelism, row-parallel output) and
``SASCoreAttention`` holds the expansion weights, the TP communication, the attention and PEAA
(the math: ``megatron_subq/ops/sas.py``).

RoPE is applied by megatron to q and k as produced by the QKV projection, i.e. *before* the
expansion — the paper's code path (its SAS module receives the query/key embeddings and calls SDPA
directly).

Tensor parallelism (TP=N, rank r owns query heads ``H_r = [r·H/N, (r+1)·H/N)``): PEAA output head
h is the mean of simulated heads ``{g·H + h}``, so rank r computes exactly the Ĥ/N simulated heads
``{g·H + h : h ∈ H_r, all g}``. Their PEAA averages are the H/N heads that its row-parallel
output projection expects: no gather after the attention. Before it, the head convolutions mix all
heads, so each rank all-gathers q, k, v over TP (k, v with their own head count: megatron's GQA
layout), runs ``Conv_{H→Ĥ}`` for all Ĥ simulated heads (the RCNN's ``Conv_{Ĥ→Ĥ}`` reads all of
them; it is a small H·Ĥ·k·D MACs per token) and the rest only for its own. Weights:

* ``conv_res`` (RCNN's ``Conv_{Ĥ→Ĥ}``, and its bias) is sharded over TP by output channel. It is
  stored as ``[H, Ĥ/H, Ĥ, k]``: entry ``[h, g]`` is the paper's output channel ``g·H + h``, so
  a rank's channels are one contiguous slice of dim 0 (a plain TP shard in checkpoints).
* ``conv_in``, ``lin``, ``lin_res`` (and biases) are replicated; each rank's activations only
  reach part of their gradient, so they pass through ``parallel.tp_replicated`` (gradient
  all-reduced over TP).
* The all-gather's backward is a reduce-scatter: each rank's partial gradient of the gathered
  q/k/v is summed back onto the owner.

Init follows the paper's code (torch's ``Conv1d`` / ``Linear`` defaults): weights and biases
``U(-1/√fan_in, 1/√fan_in)``, drawn as full master tensors on the CPU so TP=N starts from TP=1's
weights. Biases exist only with ``add_bias_linear`` (off in Transformer++).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from ..attention import KVCache, SubqCoreAttention
from ..ops.sas import SASBranchWeights, sas_expand_qkv, sas_simulated_attention
from ..ops.standard import standard_prefill
from ..parallel import (
    head_sharded_parameter,
    sharded_state_dict_with_head_params,
    tp_group_or_global,
    tp_rank,
    tp_replicated,
    tp_world_size,
)
from .base import Variant, causal_pairs, knob_error
from .standard import self_attention_spec


def _fan_in_uniform(fan_in: int) -> Callable[[torch.Tensor], None]:
    bound = 1.0 / math.sqrt(fan_in)
    return lambda t: torch.nn.init.uniform_(t, -bound, bound)


class SASExpansion(torch.nn.Module):
    """The weights of one expansion (q, k: heads and features; v: heads only), TP-laid out over
    ``tp_group`` (default: megatron's global TP group).

    Parameters (H heads, Ĥ simulated, kernel k, N = TP size):
      ``conv_in``  ``[Ĥ, H, k]``            replicated
      ``conv_res`` ``[H/N, Ĥ/H, Ĥ, k]``     TP-sharded on dim 0 (full: ``[H, Ĥ/H, Ĥ, k]``)
      ``lin``      ``[D̂, D]``, ``lin_res`` ``[D̂, D̂]``   replicated (q and k only)
    and with ``bias``: ``conv_in_bias [Ĥ]``, ``conv_res_bias [H/N, Ĥ/H]`` (sharded),
    ``lin_bias [D̂]``, ``lin_res_bias [D̂]``.
    """

    def __init__(self, num_heads: int, sim_heads: int, head_dim: int, sim_head_dim: Optional[int],
                 kernel: int, bias: bool, dtype: torch.dtype, device=None, tp_group=None):
        super().__init__()
        H, Hs, k = num_heads, sim_heads, kernel
        self.num_heads, self.sim_heads = H, Hs
        self.tp_group = tp_group_or_global(tp_group)

        def replicated(shape, fan_in):
            master = torch.empty(shape, dtype=torch.float32)
            _fan_in_uniform(fan_in)(master)
            return torch.nn.Parameter(master.to(dtype=dtype, device=device))

        def by_output_head(init):
            # the paper's [Ĥ, ...] master (channel g·H + h) stored as [H, Ĥ/H, ...]
            def fill(master):
                paper = torch.empty((Hs,) + tuple(master.shape[2:]), dtype=master.dtype)
                init(paper)
                master.copy_(paper.view((Hs // H, H) + tuple(paper.shape[1:])).transpose(0, 1))
            return fill

        # Draw order is fixed and TP-independent (every rank draws every full master).
        self.conv_in = replicated((Hs, H, k), H * k)
        self.conv_res = head_sharded_parameter((H, Hs // H, Hs, k),
                                               by_output_head(_fan_in_uniform(Hs * k)), dtype,
                                               device, tp_group=self.tp_group)
        self.conv_in_bias = replicated((Hs,), H * k) if bias else None
        self.conv_res_bias = (head_sharded_parameter((H, Hs // H), by_output_head(
            _fan_in_uniform(Hs * k)), dtype, device, tp_group=self.tp_group) if bias else None)
        self.lin = self.lin_res = self.lin_bias = self.lin_res_bias = None
        if sim_head_dim is not None:
            self.lin = replicated((sim_head_dim, head_dim), head_dim)
            self.lin_res = replicated((sim_head_dim, sim_head_dim), sim_head_dim)
            if bias:
                self.lin_bias = replicated((sim_head_dim,), head_dim)
                self.lin_res_bias = replicated((sim_head_dim,), sim_head_dim)

    def local_weights(self) -> SASBranchWeights:
        """The op's weights for this rank's simulated heads, in (local head, group) order."""
        rep = lambda p: None if p is None else tp_replicated(p, self.tp_group)  # noqa: E731
        return SASBranchWeights(
            conv_in=rep(self.conv_in),
            conv_res=self.conv_res.reshape(-1, self.sim_heads, self.conv_res.shape[-1]),
            lin=rep(self.lin), lin_res=rep(self.lin_res),
            conv_in_bias=rep(self.conv_in_bias),
            conv_res_bias=None if self.conv_res_bias is None else self.conv_res_bias.reshape(-1),
            lin_bias=rep(self.lin_bias), lin_res_bias=rep(self.lin_res_bias))

    def paper_weights(self) -> SASBranchWeights:
        """All weights in the paper's numbering (TP=1 only): what ``ops.sas_attention`` takes."""
        if tp_world_size(self.tp_group) != 1:
            raise RuntimeError("paper_weights() needs the full conv_res: call it at TP=1")
        Hs = self.sim_heads

        def paper(t):  # [H, Ĥ/H, ...] -> [Ĥ, ...], channel g·H + h
            return None if t is None else t.transpose(0, 1).reshape((Hs,) + tuple(t.shape[2:]))

        return SASBranchWeights(self.conv_in, paper(self.conv_res), self.lin, self.lin_res,
                                self.conv_in_bias, paper(self.conv_res_bias), self.lin_bias,
                                self.lin_res_bias)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        return sharded_state_dict_with_head_params(self, prefix, sharded_offsets, metadata)


def _gather_heads(x: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gather ``[B, T, h, D]`` over ``tp_group`` along heads (rank order); backward:
    reduce-scatter."""
    if tp_world_size(tp_group) == 1:
        return x
    heads_first = x.permute(2, 0, 1, 3).contiguous()  # megatron gathers along dim 0
    full = gather_from_sequence_parallel_region(
        heads_first, tensor_parallel_output_grad=True, group=tp_group)
    return full.permute(1, 2, 0, 3)


class SASCoreAttention(SubqCoreAttention):
    """Expansion + causal attention over this rank's Ĥ/N simulated heads + PEAA.

    In: q ``[B, T, H/N, D]``, k/v ``[B, T, H_kv_local, D]`` (after RoPE); out ``[B, T, H/N, D]``.
    Submodules ``q_expansion``, ``k_expansion``, ``v_expansion`` (``SASExpansion``).
    """

    def __init__(self, config, layer_number, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        H, Hs, D = config.num_attention_heads, config.sas_heads, config.kv_channels
        self.sim_heads, self.sim_head_dim = Hs, config.sas_head_dim
        device = None
        if torch.cuda.is_available() and not config.use_cpu_initialization:
            device = torch.cuda.current_device()
        common = dict(num_heads=H, sim_heads=Hs, head_dim=D, kernel=config.sas_kernel,
                      bias=config.add_bias_linear, dtype=config.params_dtype, device=device,
                      tp_group=self.tp_group)
        self.q_expansion = SASExpansion(sim_head_dim=config.sas_head_dim, **common)
        self.k_expansion = SASExpansion(sim_head_dim=config.sas_head_dim, **common)
        self.v_expansion = SASExpansion(sim_head_dim=None, **common)
        # This rank's simulated heads, ordered (local head h, group g) like conv_res's rows:
        # paper index g·H + h.
        first = tp_rank(self.tp_group) * self.num_heads_local
        self.register_buffer("owned_heads", torch.tensor(
            [g * H + h for h in range(first, first + self.num_heads_local)
             for g in range(Hs // H)], dtype=torch.long), persistent=False)

    def attend(self, q, k, v):
        B, T = q.shape[:2]
        q_all, k_all, v_all = (_gather_heads(x, self.tp_group) for x in (q, k, v))
        out = sas_simulated_attention(
            q_all, k_all, v_all, self.q_expansion.local_weights(),
            self.k_expansion.local_weights(), self.v_expansion.local_weights(),
            heads=self.owned_heads, scale=self.softmax_scale, impl=self.config.subq_impl)
        # PEAA: this rank's simulated heads are grouped by local output head already
        return self._peaa(out)

    def _peaa(self, out):
        B, T = out.shape[:2]
        groups = self.sim_heads // self.num_heads
        return out.view(B, T, self.num_heads_local, groups, out.shape[-1]).mean(dim=3)

    def _expand(self, q, k, v):
        """This rank's simulated heads of the (TP-gathered) q, k, v: (q̂, k̂, v̂, D̂)."""
        q_all, k_all, v_all = (_gather_heads(x, self.tp_group) for x in (q, k, v))
        return sas_expand_qkv(q_all, k_all, v_all, self.q_expansion.local_weights(),
                              self.k_expansion.local_weights(), self.v_expansion.local_weights(),
                              heads=self.owned_heads)

    def new_decode_cache(self, q, k, v, max_length):
        """A KV cache of the expanded keys and values k̂, v̂ of this rank's simulated heads (the
        expansion is per token, so each token's is computed once)."""
        _, k_hat, v_hat, _ = self._expand(q, k, v)
        return KVCache.like(k_hat, v_hat, max_length)

    def attend_cached(self, q, k, v, cache, start):
        q_hat, k_hat, v_hat, q_dim = self._expand(q, k, v)
        k_all, v_all = cache.append(k_hat, v_hat, start)
        scale = 1.0 / math.sqrt(q_dim) if self.softmax_scale is None else self.softmax_scale
        impl = "reference" if self.config.subq_impl == "reference" else None
        out = standard_prefill(q_hat, k_all, v_all, start=start, scale=scale, impl=impl)
        return self._peaa(out)


def attention_spec(config, layer_number: int, provider):
    return self_attention_spec(SASCoreAttention, provider)


def check_knobs(config) -> None:
    """Range of sas_kernel (whether or not a layer uses sas)."""
    k = config.sas_kernel
    if not isinstance(k, int) or k < 1 or k % 2 == 0:
        knob_error("sas_kernel", k, "an odd positive integer (1, 3, 5, ...)")


def resolve(config) -> None:
    """sas_heads defaults to 3 H (a multiple of H and of the TP size), sas_head_dim to
    1.5 kv_channels rounded up to even."""
    H, D, tp = config.num_attention_heads, config.kv_channels, config.tensor_model_parallel_size
    if config.sas_heads is None:
        config.sas_heads = 3 * H
    if config.sas_head_dim is None:
        config.sas_head_dim = 2 * math.ceil(0.75 * D)
    if not isinstance(config.sas_heads, int) or config.sas_heads < H or config.sas_heads % H:
        knob_error("sas_heads", config.sas_heads, f"a positive multiple of num_attention_heads={H}")
    if not isinstance(config.sas_head_dim, int) or config.sas_head_dim < 1:
        knob_error("sas_head_dim", config.sas_head_dim, "a positive integer")
    if config.sas_heads % tp:
        knob_error("sas_heads", config.sas_heads, f"a multiple of tensor_model_parallel_size={tp}")


def validate(config) -> None:
    # sas_kernel: check_knobs; sas_heads, sas_head_dim: resolve; context_parallel_size: the
    # config's one check (VARIANT.context_parallel is "none": the head expansion mixes heads).
    return None


def core_flops(config, L: int) -> float:
    """The head/feature expansions per token, then attention over the simulated heads."""
    H, D = config.num_attention_heads, config.kv_channels
    Hh, Dh, k = config.sas_heads, config.sas_head_dim, config.sas_kernel
    per_token = (3 * 2 * Hh * H * k * D      # Conv_{H->Hh} on q, k, v (a kernel of k along D)
                 + 3 * 2 * Hh * Hh * k * D   # RCNN's Conv_{Hh->Hh} on q, k, v
                 + 2 * 2 * Hh * D * Dh       # Lin_{D->Dh} on q, k
                 + 2 * 2 * Hh * Dh * Dh)     # RMLP's Lin_{Dh->Dh} on q, k
    core = 2.0 * causal_pairs(L) * Hh * (Dh + D)  # QK^T over Dh, PV over D
    return L * per_token + core


VARIANT = Variant(
    name="sas",
    summary="simulated attention score: heads and q/k features expanded by small convs/MLPs, "
            "attention over the simulated heads, groups averaged (PEAA)",
    attention_spec=attention_spec,
    validate=validate,
    packed_sequences=True,
    knobs=("sas_",),
    check_knobs=check_knobs,
    resolve=resolve,
    core_flops=core_flops,
    decode_cache="kv",
)
