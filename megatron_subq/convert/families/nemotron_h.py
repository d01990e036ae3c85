"""NemotronH (``NemotronHForCausalLM``, Nemotron-H / Nemotron-3 Nano) -> the hybrid host.

The hub layout (``backbone.*``, one module per routed expert; transformers >= 5.3 writes it with
``save_pretrained``) maps 1:1 onto megatron's ``MambaModel`` at TP=1: layer ``i`` is
``backbone.layers.i.{norm, mixer}``, whose mixer is a Mamba-2 mixer (M), attention without RoPE
or biases (*), a squared-ReLU MLP (-) or a MoE with a sigmoid router, an expert bias and one
shared expert (E). The Mamba tensors keep HF's order (in_proj [z|x|B|C|dt], conv1d [x|B|C]); the
mixer's sharded state dict splits them per component, so the TP=1 import loads at any TP.

Superlinear '*' slots: ``NemotronHSuperlinearForCausalLM`` (``model_type:
nemotron_h_superlinear``), the remote code megatron_subq ships (``convert/remote/``), is the same
layout plus ``backbone.layers.i.mixer.qs_proj.weight`` (megatron's
``self_attention.linear_qs.weight``, the variant's ``hf_param_map``) in the Superlinear layers,
and the knobs in config.json (``superlinear_*``, the trainer's names; ``superlinear_layers``: the
0-based indices of the Superlinear layers). Import reads them into ``--attention-variant
superlinear`` (``--layer-pattern`` when only some '*' slots are Superlinear) and the knobs; export
writes them, with ``auto_map`` pointing at the shipped files (copied by ``api.export_hf``).
"""

from __future__ import annotations

import functools

from typing import Any, List, Optional

from . import base
from .base import Family, TensorMap, copy, qkv

# HF block type (transformers 5.3's names and the later ones) -> hybrid_override_pattern symbol
BLOCK_SYMBOL = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*",
                "mlp": "-", "moe": "E"}
SYMBOL_BLOCK = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
MAMBA_NORM_EPS = 1e-5  # megatron's Mamba mixer fixes its gated norm's epsilon
MAMBA_CONV = 4  # megatron's Mamba mixer fixes d_conv


refuse = functools.partial(base.refuse, host="hybrid")

# the Superlinear remote code (convert/remote/nemotron_h_superlinear), by name: importing it needs
# transformers, which the trainer flags of a config.json do not
SUPERLINEAR_ARCH = "NemotronHSuperlinearForCausalLM"
SUPERLINEAR_MODEL_TYPE = "nemotron_h_superlinear"
SUPERLINEAR_AUTO_MAP = {
    "AutoConfig": "configuration_nemotron_h_superlinear.NemotronHSuperlinearConfig",
    "AutoModelForCausalLM": "modeling_nemotron_h_superlinear.NemotronHSuperlinearForCausalLM",
}
# config.json field -> trainer flag (the same names: the config's superlinear_* fields)
SUPERLINEAR_KNOBS = ("superlinear_search_power", "superlinear_span_power", "superlinear_topk",
                     "superlinear_backward_factor", "superlinear_forward_factor",
                     "superlinear_sw_index", "superlinear_allow_no_random_access")


def hybrid_pattern(cfg: dict) -> str:
    """The M/*/-/E pattern of a NemotronH config.json: ``hybrid_override_pattern`` (hub files) or
    ``layers_block_type`` / ``layer_types`` (transformers >= 5.3)."""
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is None:
        key = "layers_block_type" if cfg.get("layers_block_type") else "layer_types"
        types = cfg.get(key)
        if not isinstance(types, list) or not types:
            refuse("hybrid_override_pattern", None, "a pattern of M, *, -, E (or "
                   "layers_block_type, a list of " + ", ".join(sorted(BLOCK_SYMBOL)) + ")")
        bad = sorted({t for t in types if t not in BLOCK_SYMBOL})
        if bad:
            refuse(key, bad, ", ".join(sorted(BLOCK_SYMBOL)))
        return "".join(BLOCK_SYMBOL[t] for t in types)
    if not isinstance(pattern, str) or not pattern or set(pattern) - set("M*-E"):
        refuse("hybrid_override_pattern", pattern, "a non-empty string of M, *, -, E")
    return pattern


def trainer_flags(cfg: dict) -> dict:
    pattern = hybrid_pattern(cfg)
    for key in ("hidden_size", "vocab_size", "num_attention_heads"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            refuse(key, cfg.get(key), "a positive integer")
    # what megatron's mixer / MoE layer / attention cannot represent
    fixed = [("use_bias", False, "false"), ("attention_bias", False, "false"),
             ("mlp_bias", False, "false"), ("mlp_hidden_act", "relu2", "'relu2' (--squared-relu)"),
             ("residual_in_fp32", False, "false")]
    if "M" in pattern:
        fixed += [("conv_kernel", MAMBA_CONV, "4 (megatron's Mamba mixer d_conv)"),
                  ("mamba_proj_bias", False, "false"), ("use_conv_bias", True, "true"),
                  ("mamba_hidden_act", "silu", "'silu'"),
                  ("layer_norm_epsilon", MAMBA_NORM_EPS, "1e-05 (megatron's Mamba mixer fixes "
                   "its gated norm's epsilon; HF uses layer_norm_epsilon there)")]
    if "E" in pattern:
        fixed += [("n_group", 1, "1 (no group-limited routing)"), ("topk_group", 1, "1"),
                  ("n_shared_experts", 1, "1"), ("moe_latent_size", None, "null"),
                  ("norm_topk_prob", True, "true (megatron's sigmoid router normalises the "
                   "top-k weights)")]
    if cfg.get("num_nextn_predict_layers"):
        fixed.append(("num_nextn_predict_layers", 0, "0 (no multi-token prediction layers)"))
    for key, want, allowed in fixed:
        have = cfg.get(key, want)
        if isinstance(want, float) and isinstance(have, (int, float)):
            ok = float(have) == want
        else:
            ok = have == want
        if not ok:
            refuse(key, have, allowed)
    if cfg.get("sliding_window") is not None:
        refuse("sliding_window", cfg["sliding_window"], "null")
    heads = cfg["num_attention_heads"]
    flags = dict(
        num_layers=len(pattern), hybrid_override_pattern=pattern, is_hybrid_model=True,
        hidden_size=cfg["hidden_size"], num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_hidden_size=int(cfg.get("intermediate_size") or 4 * cfg["hidden_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        position_embedding_type="none", normalization="RMSNorm",
        norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)), squared_relu=True,
        swiglu=False, add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False,
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False))
    if "M" in pattern:
        flags.update(mamba_num_heads=int(cfg["mamba_num_heads"]),
                     mamba_head_dim=int(cfg["mamba_head_dim"]),
                     mamba_state_dim=int(cfg["ssm_state_size"]),
                     mamba_num_groups=int(cfg["n_groups"]))
    if "E" in pattern:
        flags.update(num_experts=int(cfg["n_routed_experts"]),
                     moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                     moe_shared_expert_intermediate_size=int(
                         cfg["moe_shared_expert_intermediate_size"]),
                     moe_router_topk=int(cfg["num_experts_per_tok"]),
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                     moe_router_topk_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                     moe_router_dtype="fp32")
    flags.update(base.dtype_flags(cfg, "hybrid"))
    if _is_superlinear(cfg):
        flags.update(_superlinear_flags(cfg, pattern))
    return flags


def _is_superlinear(cfg: dict) -> bool:
    return (cfg.get("model_type") == SUPERLINEAR_MODEL_TYPE
            or SUPERLINEAR_ARCH in (cfg.get("architectures") or []))


def _superlinear_flags(cfg: dict, pattern: str) -> dict:
    """--attention-variant superlinear, its knobs, and --layer-pattern (one name per '*' slot)
    when ``superlinear_layers`` names only some attention layers."""
    flags = {"attention_variant": "superlinear"}
    for key in SUPERLINEAR_KNOBS:
        if cfg.get(key) is not None:
            flags[key] = cfg[key]
    slots = [i for i, symbol in enumerate(pattern) if symbol == "*"]
    chosen = cfg.get("superlinear_layers")
    if chosen is not None:
        if not isinstance(chosen, list) or any(i not in slots for i in chosen):
            refuse("superlinear_layers", chosen, f"null or a list of attention layer indices "
                   f"(0-based) from {slots}")
        if sorted(chosen) != slots:
            flags["layer_pattern"] = ",".join("superlinear" if i in chosen else "standard"
                                              for i in slots)
    return flags


def tensor_maps(args, vocab: int) -> List[TensorMap]:
    """One map per tensor of the hybrid host at TP=1 (the router's expert bias included, a
    buffer in both models)."""
    pattern = args.hybrid_override_pattern
    H = args.hidden_size
    nh, ng, hd = args.num_attention_heads, args.num_query_groups, args.kv_channels
    maps = [copy("embedding.word_embeddings.weight", "backbone.embeddings.weight", (vocab, H))]
    for i, symbol in enumerate(pattern):
        m, h = f"decoder.layers.{i}.", f"backbone.layers.{i}."
        if symbol == "M":
            heads, dim = args.mamba_num_heads, args.mamba_head_dim
            d_inner, gn = heads * dim, args.mamba_num_groups * args.mamba_state_dim
            shapes = {"in_proj.weight": (2 * d_inner + 2 * gn + heads, H),
                      "conv1d.weight": (d_inner + 2 * gn, 1, MAMBA_CONV),
                      "conv1d.bias": (d_inner + 2 * gn,), "A_log": (heads,), "D": (heads,),
                      "dt_bias": (heads,), "norm.weight": (d_inner,),
                      "out_proj.weight": (H, d_inner)}
            maps.append(copy(m + "norm.weight", h + "norm.weight", (H,), i))
            maps += [copy(m + "mixer." + k, h + "mixer." + k, s, i) for k, s in shapes.items()]
        elif symbol == "*":
            a, x = m + "self_attention.", h + "mixer."
            maps.append(copy(m + "input_layernorm.weight", h + "norm.weight", (H,), i))
            maps.append(qkv(a + "linear_qkv.weight", x + "q_proj.weight", x + "k_proj.weight",
                            x + "v_proj.weight", nh, ng, hd, (H,), i))
            maps.append(copy(a + "linear_proj.weight", x + "o_proj.weight", (H, nh * hd), i,
                             "attention"))
        elif symbol == "-":
            F = args.ffn_hidden_size
            maps.append(copy(m + "pre_mlp_layernorm.weight", h + "norm.weight", (H,), i))
            maps.append(copy(m + "mlp.linear_fc1.weight", h + "mixer.up_proj.weight", (F, H), i))
            maps.append(copy(m + "mlp.linear_fc2.weight", h + "mixer.down_proj.weight", (H, F),
                             i))
        else:  # E
            E, F = args.num_experts, args.moe_ffn_hidden_size
            S = args.moe_shared_expert_intermediate_size
            e, x = m + "mlp.", h + "mixer."
            maps.append(copy(m + "pre_mlp_layernorm.weight", h + "norm.weight", (H,), i))
            maps.append(copy(e + "router.weight", x + "gate.weight", (E, H), i))
            maps.append(copy(e + "router.expert_bias", x + "gate.e_score_correction_bias", (E,),
                             i))
            for j in range(E):
                le = f"{e}experts.local_experts.{j}."
                maps.append(copy(le + "linear_fc1.weight", f"{x}experts.{j}.up_proj.weight",
                                 (F, H), i))
                maps.append(copy(le + "linear_fc2.weight", f"{x}experts.{j}.down_proj.weight",
                                 (H, F), i))
            maps.append(copy(e + "shared_experts.linear_fc1.weight",
                             x + "shared_experts.up_proj.weight", (S, H), i))
            maps.append(copy(e + "shared_experts.linear_fc2.weight",
                             x + "shared_experts.down_proj.weight", (H, S), i))
    maps.append(copy("decoder.final_norm.weight", "backbone.norm_f.weight", (H,)))
    if args.untie_embeddings_and_output_weights:
        maps.append(copy("output_layer.weight", "lm_head.weight", (vocab, H)))
    return maps


def check_export(args) -> None:
    pattern = getattr(args, "hybrid_override_pattern", None)
    wrong = [(flag, have, want) for flag, have, want in (
        ("--hybrid-override-pattern", bool(pattern), True),
        ("--normalization", args.normalization, "RMSNorm"),
        ("--squared-relu", bool(getattr(args, "squared_relu", False)), True),
        ("--add-bias-linear", args.add_bias_linear, False),
        ("--position-embedding-type", args.position_embedding_type, "none"),
        ("--add-qkv-bias", bool(getattr(args, "add_qkv_bias", False)), False),
        ("--qk-layernorm", bool(getattr(args, "qk_layernorm", False)), False),
    ) if have != want]
    if pattern and "E" in pattern:
        wrong += [(flag, have, want) for flag, have, want in (
            ("--moe-router-score-function", args.moe_router_score_function, "sigmoid"),
            ("--moe-router-enable-expert-bias", bool(args.moe_router_enable_expert_bias), True),
            ("--moe-shared-expert-intermediate-size",
             bool(args.moe_shared_expert_intermediate_size), True),
        ) if have != want]
    if wrong:
        raise ValueError("the checkpoint's model is not a NemotronH model: " + "; ".join(
            f"{flag} is {have!r}, NemotronH needs {want!r}" for flag, have, want in wrong))


# fields of an imported config.json that the model's flags decide (rewritten on export)
_DERIVED = ("architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
            "hybrid_override_pattern", "layers_block_type", "layer_types", "num_hidden_layers",
            "auto_map", "superlinear_layers", "superlinear_impl") + SUPERLINEAR_KNOBS


def _layer_variants(args) -> list:
    """Every layer's variant (None at M/-/E) from the model's flags."""
    from ...patterns import resolve_layer_variants  # noqa: PLC0415

    pattern = getattr(args, "layer_pattern", None)
    if isinstance(pattern, str) and "," in pattern:
        pattern = [v.strip() for v in pattern.split(",") if v.strip()]
    return resolve_layer_variants(pattern, getattr(args, "attention_variant", None) or "standard",
                                  len(args.hybrid_override_pattern),
                                  args.hybrid_override_pattern)


def hf_config(args, vocab: int, base: Optional[dict] = None) -> dict:
    check_export(args)
    cfg = {k: v for k, v in (base or {}).items() if k not in _DERIVED}
    pattern = args.hybrid_override_pattern
    cfg.update(
        architectures=["NemotronHForCausalLM"], model_type="nemotron_h", vocab_size=vocab,
        hidden_size=args.hidden_size, layers_block_type=[SYMBOL_BLOCK[s] for s in pattern],
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_query_groups, head_dim=args.kv_channels,
        intermediate_size=args.ffn_hidden_size, layer_norm_epsilon=args.norm_epsilon,
        mlp_hidden_act="relu2", use_bias=False, attention_bias=False, mlp_bias=False,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
        dtype="bfloat16" if args.bf16 else "float16" if args.fp16 else "float32")
    if "M" in pattern:
        cfg.update(mamba_num_heads=args.mamba_num_heads, mamba_head_dim=args.mamba_head_dim,
                   ssm_state_size=args.mamba_state_dim, n_groups=args.mamba_num_groups,
                   conv_kernel=MAMBA_CONV, use_conv_bias=True, mamba_proj_bias=False,
                   mamba_hidden_act="silu")
    if "E" in pattern:
        cfg.update(n_routed_experts=args.num_experts,
                   moe_intermediate_size=args.moe_ffn_hidden_size,
                   moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                   n_shared_experts=1, num_experts_per_tok=args.moe_router_topk,
                   routed_scaling_factor=float(args.moe_router_topk_scaling_factor or 1.0),
                   norm_topk_prob=True, n_group=1, topk_group=1)
    chosen = [i for i, v in enumerate(_layer_variants(args)) if v == "superlinear"]
    if chosen:  # the shipped remote code (api.export_hf copies its files)
        cfg.update(architectures=[SUPERLINEAR_ARCH], model_type=SUPERLINEAR_MODEL_TYPE,
                   auto_map=dict(SUPERLINEAR_AUTO_MAP), superlinear_layers=chosen,
                   **{k: getattr(args, k) for k in SUPERLINEAR_KNOBS})
    return cfg


def matches_args(args) -> bool:
    return bool(getattr(args, "hybrid_override_pattern", None))


FAMILY = Family(name="nemotron_h", architectures=("NemotronHForCausalLM", SUPERLINEAR_ARCH),
                model_type="nemotron_h", host="hybrid",
                summary="NemotronH / Nemotron-3 Nano (Mamba-2, NoPE attention, relu2 MLP, "
                        "sigmoid-routed MoE with a shared expert)",
                trainer_flags=trainer_flags, tensor_maps=tensor_maps, hf_config=hf_config,
                matches_args=matches_args, hf_layer_prefix="backbone.layers.{i}.",
                script="examples/pretrain_hybrid.py", hf_variants=("standard", "superlinear"))
