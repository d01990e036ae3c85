"""The GPT-host families (Llama, Mistral, Qwen2, Qwen3): one decoder layout, a few switches.

All four name their tensors alike (``model.layers.N.self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``model.norm``,
``model.embed_tokens``, ``lm_head``) and differ in what ``gpt_family`` switches: q/k/v biases
(Qwen2), per-head q/k RMSNorms (Qwen3), the config fields each may carry (Mistral's
``sliding_window``, Qwen's ``use_sliding_window``). HF's rotate-half RoPE is megatron's default
(``rotary_interleaved=False``): q/k rows need no permutation.
"""

from __future__ import annotations

import functools

from typing import Any, Dict, List, Optional

from . import base
from .base import Family, TensorMap, copy, gated_fc1, qkv

# megatron's RotaryEmbedding._apply_scaling fixes these; a llama3 rope_scaling with other
# values is refused
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


refuse = functools.partial(base.refuse, host="GPT")


def _rope(cfg: dict) -> Dict[str, Any]:
    """rotary_base / use_rope_scaling / rope_scaling_factor from transformers 5's
    ``rope_parameters`` or 4's ``rope_theta`` + ``rope_scaling``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        where = "rope_parameters"
        if not any(k in params for k in ("rope_theta", "rope_type", "type", "factor")):
            refuse(where, params, "one set of RoPE parameters for every layer (no per-layer-type "
                   "RoPE)")
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = params
    else:
        where = "rope_scaling"
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    if not isinstance(theta, (int, float)) or theta <= 0 or float(theta) != int(theta):
        refuse("rope_theta", theta, "a positive integer value (the trainer's --rotary-base)")
    out = {"rotary_base": int(theta), "use_rope_scaling": False, "rope_scaling_factor": 8.0}
    if kind == "default":
        return out
    if kind != "llama3":
        refuse(f"{where}.rope_type", kind, "'default' or 'llama3' (megatron's rope_scaling)")
    for key, fixed in LLAMA3_FIXED.items():
        if key in scaling and float(scaling[key]) != fixed:
            refuse(f"{where}.{key}", scaling[key], f"{fixed:g} (fixed by megatron-core's "
                   "llama3 RoPE scaling)")
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        refuse(f"{where}.factor", factor, "a positive number")
    out.update(use_rope_scaling=True, rope_scaling_factor=float(factor))
    return out


def gpt_family(name: str, architectures, model_type: str, summary: str, *,
               qkv_bias: bool = False, qk_norm: bool = False,
               max_positions_default: int = 2048) -> Family:
    """A GPT-host family: Llama's layout with Qwen2's biases (``qkv_bias``) or Qwen3's q/k norms
    (``qk_norm``)."""

    def trainer_flags(cfg: dict) -> dict:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            refuse("hidden_act", act, "'silu' (SwiGLU)")
        if cfg.get("attention_bias") and not qkv_bias:
            refuse("attention_bias", True, "false (megatron's --add-qkv-bias puts no bias on "
                   "o_proj, and --add-bias-linear adds MLP biases too)")
        if cfg.get("mlp_bias"):
            refuse("mlp_bias", True, "false")
        window = cfg.get("sliding_window")
        max_pos = int(cfg.get("max_position_embeddings") or max_positions_default)
        if model_type == "mistral" and window is not None and window < max_pos:
            refuse("sliding_window", window, f"null or >= max_position_embeddings={max_pos} "
                   "(sliding-window attention is not a variant here)")
        if cfg.get("use_sliding_window"):
            refuse("use_sliding_window", True, "false")
        layer_types = cfg.get("layer_types") or []
        odd = sorted({t for t in layer_types if t != "full_attention"})
        if odd:
            refuse("layer_types", odd, "'full_attention' in every layer")
        partial = cfg.get("partial_rotary_factor", 1.0)
        if partial not in (None, 1, 1.0):
            refuse("partial_rotary_factor", partial, "1.0")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size", "vocab_size"):
            if not isinstance(cfg.get(key), int) or cfg[key] < 1:
                refuse(key, cfg.get(key), "a positive integer")
        heads = cfg["num_attention_heads"]
        groups = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        flags = dict(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                     ffn_hidden_size=cfg["intermediate_size"], num_attention_heads=heads,
                     num_query_groups=groups, kv_channels=head_dim,
                     max_position_embeddings=max_pos, position_embedding_type="rope",
                     normalization="RMSNorm", norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
                     swiglu=True, add_bias_linear=False, add_qkv_bias=qkv_bias,
                     qk_layernorm=qk_norm,
                     untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings",
                                                                     False))
        flags.update(_rope(cfg))
        flags.update(base.dtype_flags(cfg, "GPT"))
        return flags

    def tensor_maps(args, vocab: int) -> List[TensorMap]:
        H, F = args.hidden_size, args.ffn_hidden_size
        nh, ng, hd = args.num_attention_heads, args.num_query_groups, args.kv_channels
        maps = [copy("embedding.word_embeddings.weight", "model.embed_tokens.weight", (vocab, H))]
        for i in range(args.num_layers):
            m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
            a, ha = m + "self_attention.", h + "self_attn."
            maps.append(copy(m + "input_layernorm.weight", h + "input_layernorm.weight", (H,), i))
            maps.append(qkv(a + "linear_qkv.weight", ha + "q_proj.weight", ha + "k_proj.weight",
                            ha + "v_proj.weight", nh, ng, hd, (H,), i))
            if qkv_bias:
                maps.append(qkv(a + "linear_qkv.bias", ha + "q_proj.bias", ha + "k_proj.bias",
                                ha + "v_proj.bias", nh, ng, hd, (), i))
            if qk_norm:
                maps.append(copy(a + "q_layernorm.weight", ha + "q_norm.weight", (hd,), i,
                                 "attention"))
                maps.append(copy(a + "k_layernorm.weight", ha + "k_norm.weight", (hd,), i,
                                 "attention"))
            maps.append(copy(a + "linear_proj.weight", ha + "o_proj.weight", (H, nh * hd), i,
                             "attention"))
            maps.append(copy(m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight",
                             (H,), i))
            maps.append(gated_fc1(m + "mlp.linear_fc1.weight", h + "mlp.gate_proj.weight",
                                  h + "mlp.up_proj.weight", F, H, i))
            maps.append(copy(m + "mlp.linear_fc2.weight", h + "mlp.down_proj.weight", (H, F), i))
        maps.append(copy("decoder.final_layernorm.weight", "model.norm.weight", (H,)))
        if args.untie_embeddings_and_output_weights:
            maps.append(copy("output_layer.weight", "lm_head.weight", (vocab, H)))
        return maps

    def check_export(args) -> None:
        wrong = [(flag, have, want) for flag, have, want in (
            ("--normalization", args.normalization, "RMSNorm"),
            ("--swiglu", args.swiglu, True),
            ("--add-bias-linear", args.add_bias_linear, False),
            ("--position-embedding-type", args.position_embedding_type, "rope"),
            ("--add-qkv-bias", bool(getattr(args, "add_qkv_bias", False)), qkv_bias),
            ("--qk-layernorm", bool(getattr(args, "qk_layernorm", False)), qk_norm),
        ) if have != want]
        if wrong:
            raise ValueError(f"the checkpoint's model is not a {name} model: " + "; ".join(
                f"{flag} is {have!r}, {name} needs {want!r}" for flag, have, want in wrong))

    def hf_config(args, vocab: int, base: Optional[dict] = None) -> dict:
        check_export(args)
        cfg = {k: v for k, v in (base or {}).items()
               if k not in ("rope_parameters", "rope_scaling", "rope_theta", "architectures",
                            "model_type", "transformers_version", "torch_dtype", "dtype")}
        dtype = "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"
        cfg.update(
            architectures=[architectures[0]], model_type=model_type,
            vocab_size=vocab, hidden_size=args.hidden_size,
            intermediate_size=args.ffn_hidden_size, num_hidden_layers=args.num_layers,
            num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_query_groups, head_dim=args.kv_channels,
            rms_norm_eps=args.norm_epsilon, hidden_act="silu",
            max_position_embeddings=args.max_position_embeddings,
            tie_word_embeddings=not args.untie_embeddings_and_output_weights,
            rope_theta=float(args.rotary_base), dtype=dtype)
        if getattr(args, "use_rope_scaling", False):
            cfg["rope_scaling"] = {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                                   **LLAMA3_FIXED}
        if model_type in ("llama", "mistral", "qwen3"):
            cfg["attention_bias"] = False
        if model_type == "llama":
            cfg["mlp_bias"] = False
        if model_type == "mistral":
            cfg["sliding_window"] = None
        if model_type in ("qwen2", "qwen3"):
            cfg["use_sliding_window"] = False
            cfg.pop("layer_types", None)
        return cfg

    def matches_args(args) -> bool:
        return (not getattr(args, "hybrid_override_pattern", None)
                and bool(getattr(args, "add_qkv_bias", False)) == qkv_bias
                and bool(getattr(args, "qk_layernorm", False)) == qk_norm)

    return Family(name=name, architectures=tuple(architectures), model_type=model_type,
                  host="gpt", summary=summary, trainer_flags=trainer_flags,
                  tensor_maps=tensor_maps, hf_config=hf_config, matches_args=matches_args)


