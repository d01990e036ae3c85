"""Plan a training run before starting it: parameters, parallel layout, memory per GPU, time.

    plan = plan_run("recipes/asa-1.3b-100b.yaml", nodes=4, gpus_per_node=8, gpu="H100")
    print(format_plan(plan))            # or plan.to_dict() for JSON

``tools/plan_run.py`` is the command line. Everything here is arithmetic on the trainer's own
parsed and validated arguments (``arguments.parse_args`` with ``check_files=False``: the data need
not exist yet) and on ``SubqTransformerConfig``; no process group, model or tensor is created.

* **Parameters** are counted analytically per layer from the shape and each variant's own
  parameters (``_VARIANT_PARAMS``); tests/test_recipes.py checks the counts against models built on
  the meta device. MoE models also get the active count (top-k of the routed experts).
* **Memory per GPU** (the most loaded pipeline stage), in bytes:
  weights and states ``P x (2 + 4 + 12)`` for bf16 weights, fp32 gradients and fp32 Adam (main
  copy, m, v) — with the distributed optimizer the 12 become ``12 / DP`` (Megatron-LM's
  distributed-optimizer table: 18 vs 6 + 12/d bytes per parameter); activations after Korthikanti
  et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4): per layer and
  micro-batch ``2 s b E`` bytes, E the elements per token the layer keeps for backward (see
  ``activation_elements``), divided by TP where sharded (all of it under sequence parallelism);
  1F1B keeps ``min(PP, micro-batches)`` micro-batches in flight on the first stage; full
  recomputation keeps only each recomputed group's input plus one group's activations; the last
  stage adds the logits (bf16) and their fp32 softmax, ``6 s b V / TP``. Backward's temporaries
  are a measured fraction of these two (``TRANSIENT_FACTOR``), and a fixed runtime reserve (CUDA
  context, NCCL buffers, allocator fragmentation) is added, not computed.
* **Time** comes from a measured table (``recipes/throughput.yaml``): tokens/s per GPU of a recipe
  on a GPU type at some layout; the estimate assumes that per-GPU throughput at the planned size,
  times a scaling efficiency that the output states. No row: no time, and the output says so.

Bad layouts (TP not dividing heads, query groups or the FFN width, PP not dividing layers, GPUs not
divisible by TP x PP x CP, a global batch not divisible by micro-batch x DP, context parallelism
where a layer has no CP path,
memory over the GPU's) are collected as ``PlanError`` messages naming the flags.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import math
import os
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class GPU:
    """One accelerator type: usable memory (what ``torch.cuda.mem_get_info`` reports free on an
    idle device, rounded down) and bf16 dense peak."""
    name: str
    memory_gib: float
    peak_tflops: float


GPUS: Dict[str, GPU] = {g.name: g for g in (
    GPU("H100", 79.1, 989.0),       # H100 SXM 80 GB
    GPU("H200", 139.8, 989.0),      # H200 SXM 141 GB
    GPU("A100-80GB", 79.1, 312.0),  # A100 SXM 80 GB
)}

RUNTIME_RESERVE_GIB = 4.0
"""CUDA context, NCCL communicators and buffers, allocator fragmentation: a reserve, not
computed."""

TRANSIENT_FACTOR = 0.55
"""Backward's temporaries (gradients of the logits and of each layer's activations, matmul and
cross-entropy workspaces) as a fraction of the activations + logits estimate: measured, not
derived. On one H100 (2026-11-25, tools/gpu_recipes.sh, docs/results.md) the peak allocated
memory less weights, gradients and optimizer was 1.53x (Transformer++ 1.3B), 1.54x (SAS 1.3B) and
1.25x (ASA 1.3B) the activations + logits estimate; the largest is kept."""

DEFAULT_SCALING_EFFICIENCY = 0.90
"""Assumed fraction of the measured per-GPU throughput kept when a run uses more GPUs than the
measurement (more data-parallel ranks: larger gradient reduce-scatters/all-gathers, across nodes).
Not measured; stated in every estimate."""

THROUGHPUT_FILE = os.path.join("recipes", "throughput.yaml")


class PlanError(ValueError):
    """Layout or configuration problems found before anything starts (one message per line)."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


# ----------------------------------------------------------------------------------------------
# the trainer's arguments, without exiting
# ----------------------------------------------------------------------------------------------
def _raising_parser():
    from . import arguments  # noqa: PLC0415

    parser = arguments.build_parser()

    def error(message):
        raise PlanError([message])

    parser.error = error
    return parser


def trainer_argv(config: str, tp=None, pp=None, micro_batch_size=None, ep=None,
                 extra: Sequence[str] = (), cp=None) -> List[str]:
    """The trainer command line the plan is for: ``--config FILE`` and the layout overrides."""
    argv = ["--config", config]
    for flag, value in (("--tensor-model-parallel-size", tp),
                        ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp),
                        ("--expert-model-parallel-size", ep),
                        ("--micro-batch-size", micro_batch_size)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + list(extra)


def raw_args(argv: Sequence[str]) -> argparse.Namespace:
    """The flags as parsed (config file, then command line), before validation."""
    from . import arguments  # noqa: PLC0415

    parser = _raising_parser()
    argv = list(argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is not None:
        try:
            data = arguments._load_config_file(known.config)
        except Exception as e:  # noqa: BLE001 - any read/parse problem is reported
            raise PlanError([f"--config {known.config}: {type(e).__name__}: {e}"]) from e
        argv = arguments.config_to_argv(parser, data, known.config) + argv
    return parser.parse_args(argv)


def layout_problems(args: argparse.Namespace, world_size: int) -> List[str]:
    """Every layout problem of ``args`` (parsed, not yet validated) on ``world_size`` GPUs, each
    naming the flags; [] when the layout is sound. The trainer's ``validate_args`` checks the
    same at start-up (one at a time); this lists them all at once."""
    from ..variants import VARIANTS  # noqa: PLC0415

    out = []
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    ep = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    for flag, value in (("--tp (--tensor-model-parallel-size)", tp),
                        ("--pp (--pipeline-model-parallel-size)", pp), ("--cp", cp),
                        ("--micro-batch-size", args.micro_batch_size)):
        if value is None or value < 1:
            out.append(f"{flag}={value} must be >= 1")
    if out:
        return out
    if world_size % (tp * pp * cp):
        out.append(f"the world of {world_size} GPUs (--nodes x --gpus-per-node) is not divisible "
                   f"by --tp {tp} x --pp {pp} x --cp {cp} = {tp * pp * cp}")
    if cp > 1:
        layers = _layer_names(args)
        names = sorted({n for n in layers if n} - {"mlp"})
        refused = [n for n in names if n in VARIANTS and VARIANTS[n].context_parallel == "none"]
        if refused:
            out.append(f"--cp (--context-parallel-size) {cp}: variant(s) {', '.join(refused)} "
                       "have no context-parallel path (Variant.context_parallel='none'); "
                       "allowed: --cp 1")
        if args.hybrid_override_pattern and "M" in args.hybrid_override_pattern:
            from ..hybrid.flops import mamba_dims  # noqa: PLC0415

            nheads, _, ngroups, _, _ = mamba_dims(args)
            heads, groups = nheads // tp, ngroups // tp
            if heads % cp or (groups and groups % cp and cp % groups):
                out.append(f"--cp (--context-parallel-size) {cp}: the Mamba-2 layers need the "
                           f"Mamba heads per TP rank ({heads}) divisible by it and the groups "
                           f"per TP rank ({groups}) a divisor or a multiple of it")
        if args.seq_length and args.seq_length % (2 * cp):
            out.append(f"--seq-length {args.seq_length} is not divisible by 2 x --cp {cp} "
                       "(megatron's zig-zag split: 2 chunks per CP rank)")
    heads, groups = args.num_attention_heads, args.num_query_groups or args.num_attention_heads
    if heads and heads % tp:
        out.append(f"--tp (--tensor-model-parallel-size) {tp} does not divide "
                   f"--num-attention-heads {heads}")
    if args.num_query_groups and groups % tp:
        out.append(f"--tp (--tensor-model-parallel-size) {tp} does not divide "
                   f"--num-query-groups {groups}")
    ffn = args.ffn_hidden_size
    dense_mlp = args.hybrid_override_pattern is None or "-" in args.hybrid_override_pattern
    if ffn and dense_mlp and ffn % tp:
        out.append(f"--tp (--tensor-model-parallel-size) {tp} does not divide "
                   f"--ffn-hidden-size {ffn} (the MLP's column-parallel split)")
    if pp > 1 and args.decoder_first_pipeline_num_layers is None and \
            args.decoder_last_pipeline_num_layers is None and args.num_layers % pp:
        out.append(f"--pp (--pipeline-model-parallel-size) {pp} does not divide --num-layers "
                   f"{args.num_layers}")
    if args.num_experts:
        if args.num_experts % ep:
            out.append(f"--expert-model-parallel-size {ep} does not divide --num-experts "
                       f"{args.num_experts}")
        if world_size % (etp * ep * pp):
            out.append(f"the world of {world_size} GPUs is not divisible by "
                       f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size "
                       f"{ep} x --pp {pp}")
    if not world_size % (tp * pp * cp):
        dp = world_size // (tp * pp * cp)
        mbs, gbs = args.micro_batch_size, args.global_batch_size
        if gbs is not None and gbs % (mbs * dp):
            out.append(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} "
                       f"x data-parallel size {dp} = {mbs * dp} (DP = {world_size} GPUs / "
                       f"(TP {tp} x PP {pp} x CP {cp}))")
    return out


def _layer_names(args) -> List[Optional[str]]:
    from ..patterns import resolve_layer_variants  # noqa: PLC0415

    pattern = args.layer_pattern
    if pattern is not None and "," in pattern:
        pattern = [v.strip() for v in pattern.split(",") if v.strip()]
    try:
        return resolve_layer_variants(pattern, args.attention_variant, args.num_layers,
                                      args.hybrid_override_pattern)
    except ValueError:
        return [args.attention_variant] * (args.num_layers or 0)


def resolve(argv: Sequence[str], world_size: int):
    """(validated trainer args, SubqTransformerConfig, notes printed while validating).
    Raises PlanError listing every layout problem, or the trainer's first error."""
    from . import arguments  # noqa: PLC0415
    from .trainer import build_config  # noqa: PLC0415

    raw = raw_args(argv)
    problems = layout_problems(raw, world_size)
    if problems:
        raise PlanError(problems)
    notes = io.StringIO()
    with contextlib.redirect_stdout(notes), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron's config warnings are about runtime choices
        args = arguments.validate_args(_raising_parser(), raw, world_size,
                                       check_files=False)
        args._parser = _raising_parser()
        config = build_config(args)
    return args, config, [line[len("note: "):] if line.startswith("note: ") else line
                          for line in notes.getvalue().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------
# parameters
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Params:
    """Parameter counts, split the way they are distributed: ``sharded`` split over TP (and
    experts over EP x expert-TP), ``replicated`` whole on every TP rank."""
    sharded: int = 0
    replicated: int = 0
    experts: int = 0          # routed experts (split over EP and expert TP)

    def __add__(self, other: "Params") -> "Params":
        return Params(self.sharded + other.sharded, self.replicated + other.replicated,
                      self.experts + other.experts)

    @property
    def total(self) -> int:
        return self.sharded + self.replicated + self.experts

    def per_rank(self, tp: int, ep: int = 1, etp: int = 1) -> float:
        return self.sharded / tp + self.replicated + self.experts / (ep * etp)


def _norm(cfg, width: int) -> int:
    return width * (2 if cfg.normalization == "LayerNorm" else 1)


def _bias(cfg) -> int:
    return int(bool(cfg.add_bias_linear))


def _standard_attention(cfg) -> Params:
    h, H, D = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_channels
    G = cfg.num_query_groups or H
    qkv = (H + 2 * G) * D
    p = Params(sharded=h * qkv + H * D * h)
    if cfg.add_bias_linear or cfg.add_qkv_bias:
        p.sharded += qkv
    p.replicated += h * _bias(cfg)  # linear_proj's bias (row-parallel: whole on every rank)
    if cfg.qk_layernorm:
        p.replicated += 2 * _norm(cfg, D)
    return p


def _asa_params(cfg) -> Params:
    return Params(sharded=2 * cfg.num_attention_heads * cfg.kv_channels * cfg.asa_rank)


def _sas_params(cfg) -> Params:
    H, Hs, D, Ds, k = (cfg.num_attention_heads, cfg.sas_heads, cfg.kv_channels,
                       cfg.sas_head_dim, cfg.sas_kernel)
    b = _bias(cfg)
    # conv_res (TP-sharded by output head), conv_in (replicated)
    heads = Params(sharded=Hs * Hs * k + b * Hs, replicated=Hs * H * k + b * Hs)
    features = Params(replicated=Ds * D + Ds * Ds + 2 * b * Ds)                  # lin, lin_res
    return heads + features + heads + features + heads  # q, k (heads + features), v (heads)


def _superlinear_params(cfg) -> Params:
    HD = cfg.num_attention_heads * cfg.kv_channels
    return Params(sharded=cfg.hidden_size * HD + (HD if cfg.add_bias_linear or cfg.add_qkv_bias
                                                  else 0))


def _mlp_variant_params(cfg) -> Params:
    from ..variants.mlp import gated_mlp_param_count, mlp_width  # noqa: PLC0415

    width, h = mlp_width(cfg), cfg.hidden_size
    total = gated_mlp_param_count(cfg, width)
    return Params(sharded=total - h * _bias(cfg), replicated=h * _bias(cfg))


# variant -> its attention slot's parameters beyond (or instead of) standard attention's
_VARIANT_PARAMS = {
    "asa": ("add", _asa_params),
    "sas": ("add", _sas_params),
    "superlinear": ("add", _superlinear_params),
    "mlp": ("replace", _mlp_variant_params),
    # the Q/K-source variants split linear_qkv into linear_qk + linear_v: the same weights,
    # no q/k norms (the Q/K come from elsewhere)
    "rnd_emb_qk": ("qk_source", None), "fixed_seq_qk": ("qk_source", None),
    "static_emb_qk": ("qk_source", None),
}
"""How a variant's attention slot differs in parameters from standard attention; a registered
variant absent here has none of its own (standard, ppa, approx, nonapprox)."""


def attention_slot_params(cfg, variant: str) -> Params:
    kind, fn = _VARIANT_PARAMS.get(variant, ("add", None))
    if kind == "replace":
        return fn(cfg)
    p = _standard_attention(cfg)
    if kind == "qk_source" and cfg.qk_layernorm:
        p.replicated -= 2 * _norm(cfg, cfg.kv_channels)
    return p + fn(cfg) if fn is not None else p


def _mlp(cfg, width: int) -> Params:
    h, b = cfg.hidden_size, _bias(cfg)
    up = width * (2 if cfg.gated_linear_unit else 1)
    return Params(sharded=h * up + b * up + width * h, replicated=b * h)


def _mamba(cfg) -> Params:
    from ..hybrid.flops import MAMBA_CONV_WIDTH, mamba_dims  # noqa: PLC0415

    n, _P, g, N, d = mamba_dims(cfg)
    h, conv = cfg.hidden_size, d + 2 * g * N
    sharded = (h * (2 * d + 2 * g * N + n) + conv * MAMBA_CONV_WIDTH + conv + 3 * n + d
               + d * h)  # in_proj, conv1d (+bias), dt_bias/A_log/D, gated norm, out_proj
    return Params(sharded=sharded, replicated=_norm(cfg, h))


def _moe(cfg) -> Tuple[Params, int]:
    """(the layer's parameters, its routed experts' parameters a token uses)."""
    h, E = cfg.hidden_size, cfg.num_moe_experts
    width = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    one = _mlp(cfg, width).total
    p = Params(replicated=_norm(cfg, h) + E * h, experts=E * one)
    if cfg.moe_shared_expert_intermediate_size:
        p = p + _mlp(cfg, cfg.moe_shared_expert_intermediate_size)
    return p, cfg.moe_router_topk * one


def layer_params(cfg, index: int) -> Tuple[Params, int]:
    """(parameters of layer ``index`` (0-based), the routed-expert parameters a token skips)."""
    h = cfg.hidden_size
    variant = cfg.layer_variants[index]
    pattern = cfg.hybrid_override_pattern
    symbol = pattern[index] if pattern else None
    if symbol == "M":
        return _mamba(cfg), 0
    if symbol == "-":
        return Params(replicated=_norm(cfg, h)) + _mlp(cfg, cfg.ffn_hidden_size), 0
    if symbol == "E":
        p, used = _moe(cfg)
        return p, p.experts - used
    attention = Params(replicated=_norm(cfg, h)) + attention_slot_params(cfg, variant)
    if symbol == "*":
        return attention, 0
    return attention + Params(replicated=_norm(cfg, h)) + _mlp(cfg, cfg.ffn_hidden_size), 0


def embedding_params(args, cfg, vocab: int) -> Tuple[Params, Params, Params]:
    """(first stage's embedding, last stage's output layer, final norm) parameters."""
    h = cfg.hidden_size
    emb = Params(sharded=vocab * h)
    if args.position_embedding_type == "learned_absolute":
        emb.replicated += args.max_position_embeddings * h
    out = Params(sharded=vocab * h) if args.untie_embeddings_and_output_weights else Params()
    return emb, out, Params(replicated=_norm(cfg, h))


def parameter_count(args, cfg, padded_vocab: int) -> Tuple[int, Optional[int]]:
    """(parameters of the whole model, parameters a token uses: None without MoE layers), as the
    trainer's model of ``args``/``cfg`` holds them (TP-split tensors counted once)."""
    emb, out, final = embedding_params(args, cfg, padded_vocab)
    total, skipped = emb + out + final, 0
    for i in range(cfg.num_layers):
        p, s = layer_params(cfg, i)
        total, skipped = total + p, skipped + s
    return total.total, (total.total - skipped if cfg.num_moe_experts else None)


def stage_layers(args) -> List[range]:
    """The global layer indices of each pipeline stage (megatron's even or first/last split)."""
    L, pp = args.num_layers, args.pipeline_model_parallel_size
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if pp == 1:
        return [range(L)]
    sizes = [None] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    rest = L - sum(s for s in sizes if s is not None)
    middle = sum(1 for s in sizes if s is None)
    sizes = [s if s is not None else rest // middle for s in sizes]
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]


# ----------------------------------------------------------------------------------------------
# activations
# ----------------------------------------------------------------------------------------------
def _core_extra_elements(cfg, variant: str) -> float:
    """Elements per token that a layer's attention core keeps beyond its q, k, v inputs and its
    output (rough; zero for fused/flash cores that keep only a per-head log-sum-exp)."""
    H, D = cfg.num_attention_heads, cfg.kv_channels
    if variant == "asa":  # the softmax feature maps q', k' (m each per head) and a normaliser
        return H * (2 * cfg.asa_rank + 1)
    if variant == "sas":  # expanded q, k (D-hat), v; head-conv and feature-MLP intermediates;
        Hs, Ds = cfg.sas_heads, cfg.sas_head_dim  # attention output before PEAA
        return 8 * Hs * D + 6 * Hs * Ds
    if variant == "superlinear":  # the search queries
        return H * D
    return 0.0


def activation_elements(cfg, index: int) -> Tuple[float, float, float]:
    """(elements per token of layer ``index`` kept for backward that TP does not shard (the
    layer's inputs to its norms and column-parallel linears: sharded only under sequence
    parallelism), elements TP shards, of which the core's internals that selective recompute
    drops). 16-bit activations; no dropout masks (dropout is 0)."""
    h = cfg.hidden_size
    variant = cfg.layer_variants[index]
    pattern = cfg.hybrid_override_pattern
    symbol = pattern[index] if pattern else None
    H, D = cfg.num_attention_heads, cfg.kv_channels
    G = cfg.num_query_groups or H

    def mlp(width):  # fc1 input (h, replicated), fc1 output, activation output
        return h, width * (2 if cfg.gated_linear_unit else 1) + width

    if symbol == "M":  # norm input, in_proj input; z,x,B,C,dt; conv output; scan output, norm
        from ..hybrid.flops import mamba_dims  # noqa: PLC0415

        n, _P, g, N, d = mamba_dims(cfg)
        return 2 * h, (2 * d + 2 * g * N + n) + (d + 2 * g * N) + 2 * d, 0.0
    if symbol == "-":
        rep, shard = mlp(cfg.ffn_hidden_size)
        return h + rep, shard, 0.0
    if symbol == "E":
        width = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        rep, shard = mlp(width)
        shard *= cfg.moe_router_topk
        if cfg.moe_shared_expert_intermediate_size:
            shard += mlp(cfg.moe_shared_expert_intermediate_size)[1]
        return h + rep + cfg.num_moe_experts, shard, 0.0
    if variant == "mlp":
        from ..variants.mlp import mlp_width  # noqa: PLC0415

        rep, shard = mlp(mlp_width(cfg))
        attn_rep, attn_shard, core = h + rep, shard, 0.0
    else:
        core = _core_extra_elements(cfg, variant)
        attn_rep = 2 * h                              # norm input, QKV input
        attn_shard = (H + 2 * G) * D + H * D + core   # q, k, v; core output (= proj input)
    if symbol == "*":
        return attn_rep, attn_shard, core
    rep, shard = mlp(cfg.ffn_hidden_size)
    return attn_rep + h + rep, attn_shard + shard, core  # + pre-MLP norm input


def activation_bytes(args, cfg, layers: range, microbatches_in_flight: int,
                     last_stage: bool) -> Dict[str, float]:
    """Activation bytes of one pipeline stage holding ``layers`` (a CP rank holds seq / CP
    tokens of every tensor: the all-to-all path's head-sharded full sequence is as large)."""
    s, b = args.seq_length // args.context_parallel_size, args.micro_batch_size
    tp, sp = args.tensor_model_parallel_size, args.sequence_parallel
    sb = s * b

    def layer_bytes(i, recompute_core):
        rep, shard, core = activation_elements(cfg, i)
        if recompute_core:
            shard -= core
        return 2.0 * sb * ((rep / tp if sp else rep) + shard / tp)

    input_bytes = 2.0 * sb * cfg.hidden_size / (tp if sp else 1)
    granularity = args.recompute_granularity
    idx = list(layers)
    if granularity == "full":
        n = args.recompute_num_layers or 1
        if args.recompute_method == "block":
            kept = sum(layer_bytes(i, False) for i in idx[n:])
            stored = kept + min(n, len(idx)) * input_bytes
            working = max((layer_bytes(i, False) for i in idx[:n]), default=0.0)
            per_mb = stored
        else:  # uniform: groups of n layers, each keeping only its input
            groups = math.ceil(len(idx) / n)
            per_mb = groups * input_bytes
            working = max((sum(layer_bytes(i, False) for i in idx[j:j + n])
                           for j in range(0, len(idx), n)), default=0.0)
        layers_total = per_mb * microbatches_in_flight + working
    else:
        per_mb = sum(layer_bytes(i, granularity == "selective") for i in idx)
        layers_total = per_mb * microbatches_in_flight
    out = {"layers": layers_total}
    if last_stage:  # output layer input, bf16 logits and their fp32 softmax (one micro-batch)
        out["logits"] = input_bytes + 6.0 * sb * args.padded_vocab_size / tp
    return out


# ----------------------------------------------------------------------------------------------
# throughput table
# ----------------------------------------------------------------------------------------------
def load_throughput(path: str) -> List[dict]:
    """The measured rows of ``path`` (YAML: ``rows: [...]``); [] when the file has none."""
    if not os.path.isfile(path):
        return []
    import yaml  # noqa: PLC0415

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    return [r for r in (data.get("rows") or []) if isinstance(r, dict)]


def find_throughput(rows: List[dict], recipe: str, variant: str, gpu: str, layout: dict):
    """(row, same_layout) of the best measurement of ``recipe`` with ``variant`` on ``gpu``: one
    at the same TP/PP/micro-batch if any, else the first; (None, False) when there is none."""
    mine = [r for r in rows if r.get("recipe") == recipe and r.get("gpu") == gpu
            and r.get("attention_variant", variant) == variant
            and r.get("tokens_per_s_per_gpu")]
    for r in mine:
        if all(int(r.get(k, -1)) == v for k, v in layout.items()):
            return r, True
    return (mine[0], False) if mine else (None, False)


# ----------------------------------------------------------------------------------------------
# the plan
# ----------------------------------------------------------------------------------------------
BYTES_PER_PARAM = {  # (weights, gradients, optimizer states with DP=1): Megatron-LM's table
    "bf16": (2, 4, 12), "fp16": (2, 4, 12), "fp32": (4, 4, 8)}


@dataclasses.dataclass
class Plan:
    """A planned run: the validated arguments and config, counts, the most loaded GPU's memory
    (bytes by part), problems (empty when sound) and the time estimate (None without a
    measured throughput row). ``format_plan`` prints it, ``to_dict`` is the JSON."""
    config: str
    recipe: str
    gpu: GPU
    nodes: int
    gpus_per_node: int
    args: argparse.Namespace
    cfg: object
    notes: List[str]
    params: int
    active_params: Optional[int]
    vocab: int
    tokenizer_vocab: int
    stage: int
    stage_params: float
    memory: Dict[str, float]
    memory_without_distopt: float
    problems: List[str]
    throughput_row: Optional[dict]
    same_layout: bool
    scaling_efficiency: Optional[float]
    seconds: Optional[float]
    time_note: str

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def tokens_per_iteration(self) -> int:
        return self.args.global_batch_size * self.args.seq_length

    @property
    def iterations(self) -> int:
        return self.args.train_iters

    @property
    def total_memory_gib(self) -> float:
        return sum(self.memory.values()) / GIB

    def to_dict(self) -> dict:
        a = self.args
        return {
            "config": self.config, "recipe": self.recipe,
            "gpu": dataclasses.asdict(self.gpu), "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node, "world_size": self.world,
            "model": {"attention_variant": a.attention_variant,
                      "layer_variants": list(self.cfg.layer_variants),
                      "num_layers": a.num_layers, "hidden_size": a.hidden_size,
                      "num_attention_heads": a.num_attention_heads,
                      "num_query_groups": a.num_query_groups, "kv_channels": a.kv_channels,
                      "ffn_hidden_size": a.ffn_hidden_size, "mlp": _mlp_name(a),
                      "normalization": a.normalization, "norm_epsilon": a.norm_epsilon,
                      "seq_length": a.seq_length, "vocab_size": self.tokenizer_vocab,
                      "padded_vocab_size": self.vocab,
                      "untied_embeddings": a.untie_embeddings_and_output_weights},
            "parameters": self.params, "active_parameters": self.active_params,
            "layout": {"tp": a.tensor_model_parallel_size, "pp": a.pipeline_model_parallel_size,
                       "cp": a.context_parallel_size, "ep": a.expert_model_parallel_size,
                       "dp": a.data_parallel_size, "sequence_parallel": a.sequence_parallel,
                       "micro_batch_size": a.micro_batch_size,
                       "global_batch_size": a.global_batch_size,
                       "micro_batches_per_iteration": a.global_batch_size // (
                           a.micro_batch_size * a.data_parallel_size),
                       "distributed_optimizer": a.use_distributed_optimizer,
                       "recompute": _recompute_name(a)},
            "memory_gib": {k: v / GIB for k, v in self.memory.items()},
            "memory_total_gib": self.total_memory_gib,
            "memory_total_without_distributed_optimizer_gib": self.memory_without_distopt / GIB,
            "most_loaded_stage": self.stage, "params_on_that_gpu": self.stage_params,
            "tokens_per_iteration": self.tokens_per_iteration, "iterations": self.iterations,
            "tokens": self.tokens_per_iteration * self.iterations,
            "throughput_row": self.throughput_row, "same_layout": self.same_layout,
            "scaling_efficiency": self.scaling_efficiency, "seconds": self.seconds,
            "time_note": self.time_note, "problems": self.problems, "notes": self.notes,
        }


def _mlp_name(a) -> str:
    if getattr(a, "squared_relu", False):
        return "squared-relu"
    if getattr(a, "silu", False):
        return "silu"
    return "swiglu" if a.swiglu else "gelu"


def _recompute_name(a) -> str:
    if a.recompute_granularity == "full":
        return f"full ({a.recompute_method}, {a.recompute_num_layers} layer(s))"
    return a.recompute_granularity or "none"


def _vocab(args) -> int:
    """The tokenizer's vocabulary: the recipe's --vocab-size, else the tokenizer itself."""
    if args.vocab_size is not None:
        return args.vocab_size
    from .tokenizer import build_tokenizer  # noqa: PLC0415

    try:
        return build_tokenizer(args.tokenizer_type, args.tokenizer_model).vocab_size
    except ValueError as e:
        raise PlanError([f"{e}; the planner needs the vocabulary: give --vocab-size (the "
                         "recipe's tokenizer size)"]) from e


def plan_run(config: str, nodes: int, gpus_per_node: int = 8, gpu: str = "H100",
             tp: Optional[int] = None, pp: Optional[int] = None, cp: int = 1,
             ep: Optional[int] = None, micro_batch_size: Optional[int] = None,
             extra: Sequence[str] = (), throughput_file: str = THROUGHPUT_FILE,
             scaling_efficiency: Optional[float] = None) -> Plan:
    """Plan ``config`` on ``nodes`` x ``gpus_per_node`` GPUs of type ``gpu``. Raises PlanError
    (every problem, each naming its flag) for a bad layout, a bad flag, or memory over the
    GPU's."""
    if gpu not in GPUS:
        raise PlanError([f"--gpu {gpu} is unknown: allowed {', '.join(GPUS)}"])
    if nodes < 1 or gpus_per_node < 1:
        raise PlanError([f"--nodes {nodes} and --gpus-per-node {gpus_per_node} must be >= 1"])
    device = GPUS[gpu]
    world = nodes * gpus_per_node
    argv = trainer_argv(config, tp, pp, micro_batch_size, ep, extra,
                        cp=cp if cp != 1 else None)
    args, cfg, notes = resolve(argv, world)
    from .tokenizer import padded_vocab_size  # noqa: PLC0415

    tokenizer_vocab = _vocab(args)
    vocab = padded_vocab_size(tokenizer_vocab, args.make_vocab_size_divisible_by,
                              args.tensor_model_parallel_size)
    args.padded_vocab_size = vocab

    # parameters, per layer and per stage
    per_layer = [layer_params(cfg, i) for i in range(cfg.num_layers)]
    emb, out, final = embedding_params(args, cfg, vocab)
    total_count, active = parameter_count(args, cfg, vocab)

    tp_, pp_ = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep_ = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp_
    dp = args.data_parallel_size
    expert_dp = world // (etp * ep_ * pp_)
    stages = stage_layers(args)
    n_micro = args.global_batch_size // (args.micro_batch_size * dp)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    w_bytes, g_bytes, o_bytes = BYTES_PER_PARAM[precision]

    best = None
    for s, layers in enumerate(stages):
        p = Params()
        for i in layers:
            p = p + per_layer[i][0]
        if s == 0:
            p = p + emb
        if s == len(stages) - 1:
            p = p + final + (out if args.untie_embeddings_and_output_weights or len(stages) == 1
                             else Params(sharded=vocab * cfg.hidden_size))  # tied copy
        dense = p.sharded / tp_ + p.replicated
        experts = p.experts / (ep_ * etp)
        n = dense + experts
        cp_ = args.context_parallel_size  # megatron's distributed optimizer shards over DP x CP
        opt = o_bytes * (dense / (dp * cp_) + experts / expert_dp
                         if args.use_distributed_optimizer else n)
        in_flight = min(pp_ - s, n_micro) if pp_ > 1 else 1
        act = activation_bytes(args, cfg, layers, in_flight, s == len(stages) - 1)
        memory = {"parameters": w_bytes * n, "gradients": g_bytes * n, "optimizer": opt,
                  "activations": act["layers"], "logits": act.get("logits", 0.0),
                  "transients": TRANSIENT_FACTOR * (act["layers"] + act.get("logits", 0.0)),
                  "runtime reserve": RUNTIME_RESERVE_GIB * GIB}
        without = sum(memory.values()) - opt + o_bytes * n
        if best is None or sum(memory.values()) > sum(best[2].values()):
            best = (s, n, memory, without)
    stage, stage_params, memory, without = best

    problems = []
    total_gib = sum(memory.values()) / GIB
    if total_gib > device.memory_gib:
        problems.append(
            f"memory: {total_gib:.1f} GiB per GPU (PP stage {stage}) exceeds the {device.name}'s "
            f"{device.memory_gib} GiB: raise --tp/--pp (or --cp, long sequences), lower "
            "--micro-batch-size "
            f"{args.micro_batch_size}, or recompute activations (--recompute-activations, "
            "--recompute-granularity full)"
            + ("" if args.use_distributed_optimizer else ", or --use-distributed-optimizer"))

    recipe = os.path.splitext(os.path.basename(config))[0]
    row, same = find_throughput(load_throughput(throughput_file), recipe, args.attention_variant,
                                device.name, {"tp": tp_, "pp": pp_,
                                              "micro_batch_size": args.micro_batch_size})
    seconds, eff, note = None, None, ""
    if row is None:
        note = (f"no measured throughput for {recipe} (variant {args.attention_variant}) on "
                f"{device.name} in {throughput_file}: time not estimated")
    else:
        measured_gpus = int(row.get("gpus", 1))
        eff = scaling_efficiency if scaling_efficiency is not None else (
            1.0 if world <= measured_gpus else DEFAULT_SCALING_EFFICIENCY)
        rate = float(row["tokens_per_s_per_gpu"]) * world * eff
        seconds = args.train_iters * args.global_batch_size * args.seq_length / rate
        note = (f"measured {float(row['tokens_per_s_per_gpu']):,.0f} tokens/s per GPU on "
                f"{measured_gpus} {device.name} at TP {row.get('tp')} PP {row.get('pp')} "
                f"micro-batch {row.get('micro_batch_size')} ({row.get('date')}); assumed: the same "
                f"per-GPU rate on {world} GPUs x scaling efficiency {eff:.2f}"
                + ("" if world <= measured_gpus else " (assumed, not measured: more "
                   "data-parallel ranks, inter-node gradient traffic)")
                + ("" if same else "; measured at another layout than planned: rougher"))
    return Plan(config=config, recipe=recipe, gpu=device, nodes=nodes,
                gpus_per_node=gpus_per_node, args=args, cfg=cfg, notes=notes,
                params=total_count, active_params=active, vocab=vocab,
                tokenizer_vocab=tokenizer_vocab, stage=stage, stage_params=stage_params,
                memory=memory, memory_without_distopt=without, problems=problems,
                throughput_row=row, same_layout=same, scaling_efficiency=eff, seconds=seconds,
                time_note=note)


def _duration(seconds: float) -> str:
    days, rest = divmod(seconds, 86400)
    return f"{seconds / 3600:,.1f} h ({int(days)} d {rest / 3600:.1f} h)"


def format_plan(plan: Plan) -> str:
    """The human-readable plan (the lines that matter)."""
    a, c = plan.args, plan.cfg
    kinds = {}
    symbols = c.hybrid_override_pattern or "*" * c.num_layers
    what = {"M": "Mamba-2", "-": "MLP", "E": "MoE"}
    for symbol, name in zip(symbols, c.layer_variants):
        key = what.get(symbol) or (f"attention {name}" if c.hybrid_override_pattern else name)
        kinds[key] = kinds.get(key, 0) + 1
    layer_text = ", ".join(f"{k} x{v}" for k, v in kinds.items())
    if c.hybrid_override_pattern:
        layer_text += f"; pattern {c.hybrid_override_pattern}"
    mlp = _mlp_name(a)
    n_micro = a.global_batch_size // (a.micro_batch_size * a.data_parallel_size)
    dtype = "bf16" if a.bf16 else "fp16" if a.fp16 else "fp32"
    lines = [
        f"plan: {plan.config} on {plan.nodes} node(s) x {plan.gpus_per_node} {plan.gpu.name} = "
        f"{plan.world} GPUs",
        f"model        {a.num_layers} layers ({layer_text}), hidden {a.hidden_size}, "
        f"{a.num_attention_heads} heads x {a.kv_channels} ({a.num_query_groups} query groups), "
        f"MLP {mlp} {a.ffn_hidden_size}, {a.normalization} eps {a.norm_epsilon:g}, "
        f"{'untied' if a.untie_embeddings_and_output_weights else 'tied'} embeddings",
        f"data         seq {a.seq_length}, vocab {plan.tokenizer_vocab:,} (padded {plan.vocab:,}), "
        f"{a.tokenizer_type} {a.tokenizer_model}",
        f"parameters   {plan.params:,} ({plan.params / 1e9:.3f}B)"
        + (f", active per token {plan.active_params:,} ({plan.active_params / 1e9:.3f}B)"
           if plan.active_params is not None else ""),
        f"layout       TP {a.tensor_model_parallel_size} x PP {a.pipeline_model_parallel_size} "
        f"x CP {a.context_parallel_size} x DP {a.data_parallel_size} (EP {a.expert_model_parallel_size})"
        f"{' + SP' if a.sequence_parallel else ''}; micro-batch {a.micro_batch_size}, global "
        f"batch {a.global_batch_size} = {n_micro} micro-batch(es) per DP rank per iteration; "
        "checks: "
        + ("ok" if not plan.problems else "FAILED"),
        f"memory/GPU   (GiB, most loaded GPU: PP stage {plan.stage}, "
        f"{plan.stage_params / 1e9:.3f}B parameters on it; {dtype}, "
        f"recompute {_recompute_name(a)})",
    ]
    labels = {
        "parameters": "parameters (bf16)" if a.bf16 or a.fp16 else "parameters (fp32)",
        "gradients": "gradients (fp32 buffers)",
        "optimizer": ("optimizer (fp32 main + Adam m, v; distributed over DP "
                      f"{a.data_parallel_size}"
                      + (f" x CP {a.context_parallel_size})" if a.context_parallel_size > 1
                         else ")") if a.use_distributed_optimizer
                      else "optimizer (fp32 main + Adam m, v; not distributed)"),
        "activations": "activations (Korthikanti et al. 2022, see docs/training.md)",
        "logits": "logits + fp32 softmax (last stage)",
        "transients": f"backward temporaries ({TRANSIENT_FACTOR:.0%} of the two above, measured)",
        "runtime reserve": "runtime reserve (CUDA, NCCL, fragmentation)",
    }
    for k, v in plan.memory.items():
        lines.append(f"  {labels[k]:<62} {v / GIB:8.2f}")
    fits = plan.total_memory_gib <= plan.gpu.memory_gib
    lines.append(f"  {'total':<62} {plan.total_memory_gib:8.2f} of {plan.gpu.memory_gib} "
                 f"({'fits' if fits else 'DOES NOT FIT'})")
    lines.append(f"  {'total without the distributed optimizer':<62} "
                 f"{plan.memory_without_distopt / GIB:8.2f}")
    tokens = plan.tokens_per_iteration * plan.iterations
    warm = (a.lr_warmup_samples * a.seq_length if a.train_samples is not None
            else a.lr_warmup_iters * plan.tokens_per_iteration)
    lines.append(f"tokens       {plan.tokens_per_iteration:,} per iteration x {plan.iterations:,} "
                 f"iterations = {tokens:,} ({tokens / 1e9:.3f}B); LR warm-up {warm / 1e9:.3f}B "
                 "tokens")
    if plan.seconds is not None:
        lines.append(f"time         {_duration(plan.seconds)}: {plan.time_note}")
    else:
        lines.append(f"time         {plan.time_note}")
    for note in plan.notes:
        lines.append(f"note         {note}")
    for problem in plan.problems:
        lines.append(f"error        {problem}")
    return "\n".join(lines)
