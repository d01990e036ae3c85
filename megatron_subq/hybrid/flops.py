"""Forward FLOPs of the hybrid host's non-attention layers per sequence of L tokens.

Counted like ``training/flops.py`` (multiply-add = 2 FLOPs; norms, gating and element-wise work
left out), with h the hidden size:

    M  in_proj 2 L h (2 d + 2 g N + n) + out_proj 2 L d h + conv 2 L (d + 2 g N) k
       + SSD scan L (Q + 1)(g N + n P) + 4 L n N P
    -  2 L h F x (3 gated | 2)
    E  router 2 L h E + top-k experts k · 2 L h F_e x (3|2) + shared 2 L h F_s x (3|2)

(Mamba-2: n heads of P channels, d = n P, g groups of state N, conv width k, chunk Q. The scan
counts, per chunk, the causal C B^T (per group) and its product with x (per head) over the
(Q+1)/2 earlier positions on average, and per token the state update B x^T and readout C S.)
MoE counts the *active* experts only: MFU measures useful work per token.
"""

from __future__ import annotations

MAMBA_CONV_WIDTH = 4  # megatron's MambaMixer d_conv
MAMBA_CHUNK = 128  # megatron's MambaMixer chunk_size


def mamba_dims(cfg):
    """(heads n, head dim P, groups g, state N, inner width d = n P) as megatron's mixer."""
    P, N, g = cfg.mamba_head_dim, cfg.mamba_state_dim, cfg.mamba_num_groups
    n = cfg.mamba_num_heads or (2 * cfg.hidden_size) // P
    return n, P, g, N, n * P


def mamba_layer_flops(cfg, L: int) -> float:
    h = cfg.hidden_size
    n, P, g, N, d = mamba_dims(cfg)
    projections = 2.0 * L * h * (2 * d + 2 * g * N + n) + 2.0 * L * d * h
    conv = 2.0 * L * (d + 2 * g * N) * MAMBA_CONV_WIDTH
    scan = float(L) * (MAMBA_CHUNK + 1) * (g * N + n * P) + 4.0 * L * n * N * P
    return projections + conv + scan


def _mlp(h: int, width: int, gated: bool, L: int) -> float:
    return 2.0 * L * h * width * (3 if gated else 2)


def mlp_layer_flops(cfg, L: int) -> float:
    return _mlp(cfg.hidden_size, cfg.ffn_hidden_size, cfg.gated_linear_unit, L)


def moe_layer_flops(cfg, L: int) -> float:
    h, gated = cfg.hidden_size, cfg.gated_linear_unit
    width = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    total = 2.0 * L * h * cfg.num_moe_experts + cfg.moe_router_topk * _mlp(h, width, gated, L)
    if cfg.moe_shared_expert_intermediate_size:
        total += _mlp(h, cfg.moe_shared_expert_intermediate_size, gated, L)
    return total


LAYER_FLOPS = {"M": mamba_layer_flops, "-": mlp_layer_flops, "E": moe_layer_flops}
"""pattern symbol -> (config, L) -> forward FLOPs ('*' is the attention slot's)."""


def active_parameters(model, config) -> int:
    """Parameters a token passes through in ``model`` (this rank's modules): every parameter
    except the routed experts it is not sent to (top-k of ``num_moe_experts`` per MoE layer).
    Both embedding tables count, as in the published Nemotron-H figures."""
    total = routed = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".mlp.experts." in name:
            routed += p.numel()
    if not config.num_moe_experts or not routed:
        return total
    ep = config.expert_model_parallel_size or 1
    # this rank holds num_moe_experts / ep experts; a token uses top-k of all of them
    inactive = routed - routed * ep * config.moe_router_topk // config.num_moe_experts
    return total - inactive
