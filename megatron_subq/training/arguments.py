"""The trainer's command line: Megatron-LM's ``pretrain_gpt.py`` flags + every variant knob.

    args = parse_args(["--num-layers", "2", ...])          # argv list, or sys.argv[1:] if None

* Flags and meanings follow Megatron-LM where it has them (``--num-layers``, ``--seq-length``,
  ``--tensor-model-parallel-size``, ``--lr-decay-style``, ...).
* ``--attention-variant``, ``--layer-pattern`` and every variant knob are generated from
  ``SubqTransformerConfig``'s own dataclass fields (their docstrings are the help text), so a knob
  added to the config is a flag at once and the two never drift apart.
* ``--config FILE`` (YAML or JSON) may set any flag, keyed by the flag's name (dashes or
  underscores); the command line overrides it. Config values are turned into flag tokens placed
  before the command line, so argparse checks them exactly like typed flags.
* Wrong or conflicting flags fail at start-up through ``parser.error``: the usage line and a
  message naming the flag, exit status 2.

Booleans accept ``--flag`` and ``--no-flag`` (so a config file's ``true`` can be undone).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import sys
import typing
from typing import Dict, List, Optional, Sequence


from ..config import SubqTransformerConfig
from .blend import parse_blend, read_data_args_file, read_per_split_file
from .fields import flag_for_field, variant_fields

TOKENIZER_TYPES = ("GPTSentencePieceTokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer",
                   "NullTokenizer")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")

# SubqTransformerConfig fields that are flags of their own below, or resolved, not set.
_HAND_WRITTEN_VARIANT_FIELDS = ("attention_variant", "layer_pattern", "hybrid_override_pattern",
                                "mamba_impl")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
MOE_DISPATCHERS = ("allgather", "alltoall", "flex")


# --subq-sdpa-backend: torch.backends.cuda.enable_<name>_sdp for each name after "auto"
SDPA_BACKENDS = ("auto", "cudnn", "flash", "mem_efficient", "math")


def _bool_flag(group, name: str, default: bool, help: str) -> None:
    group.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help)


# ----------------------------------------------------------------------------------------------
# variant knobs, generated from the dataclass
# ----------------------------------------------------------------------------------------------
def _field_docs(cls) -> Dict[str, str]:
    """Attribute docstrings (the string literal right after ``name: type = default``)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):  # source not available (zipped install): no help text
        return {}
    docs: Dict[str, str] = {}
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _resolve_type(f: dataclasses.Field):
    """(scalar type, is_optional) of a field annotation such as ``Optional[int]``."""
    ann = f.type
    if isinstance(ann, str):
        namespace = dict(vars(sys.modules[SubqTransformerConfig.__module__]))
        namespace.update(vars(typing))
        ann = eval(ann, namespace)  # noqa: S307 - our own dataclass's annotation
    optional = False
    origin = typing.get_origin(ann)
    if origin is typing.Union:
        members = [a for a in typing.get_args(ann) if a is not type(None)]
        optional = len(members) < len(typing.get_args(ann))
        scalars = [a for a in members if a in (int, float, str, bool)]
        ann = scalars[0] if scalars else str  # Union[str, List[str]] -> str (comma lists)
    if ann not in (int, float, str, bool):
        ann = str
    return ann, optional


def _number(kind):
    def convert(text: str):
        if text.lower() in ("none", "null"):
            return None
        return kind(text)
    convert.__name__ = kind.__name__
    return convert


def add_variant_arguments(parser: argparse.ArgumentParser) -> None:
    from ..variants import VARIANTS  # noqa: PLC0415

    docs = _field_docs(SubqTransformerConfig)
    group = parser.add_argument_group(
        "attention variant", "which attention each layer uses, and every variant's knobs "
        "(generated from SubqTransformerConfig; see docs/variants.md)")
    group.add_argument("--attention-variant", default="standard", choices=sorted(VARIANTS),
                       help=docs.get("attention_variant"))
    group.add_argument("--layer-pattern", default=None,
                       help=(docs.get("layer_pattern", "") + " A comma-separated list gives each "
                             "layer's variant."))
    for f in variant_fields():
        if f.name in _HAND_WRITTEN_VARIANT_FIELDS:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind, optional = _resolve_type(f)
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = docs.get(f.name, "")
        if kind is bool:
            _bool_flag(group, flag, bool(default), help_text)
        elif f.name == "subq_impl":
            group.add_argument(flag, default=default, choices=("reference", "kernel"),
                               help=help_text)
        elif kind in (int, float):
            group.add_argument(flag, type=_number(kind) if optional else kind, default=default,
                               metavar=kind.__name__.upper(), help=help_text)
        else:
            group.add_argument(flag, type=str, default=default, help=help_text)


def add_hybrid_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags of the hybrid host (``pretrain_mamba.py``) and of MoE layers."""
    docs = _field_docs(SubqTransformerConfig)
    g = parser.add_argument_group(
        "hybrid model (Mamba-2, MoE)", "megatron's MambaModel layout (docs/hybrid.md); the "
        "attention variant flags apply to its '*' slots")
    _bool_flag(g, "--is-hybrid-model", False, "build the hybrid host (needs "
               "--hybrid-override-pattern)")
    g.add_argument("--hybrid-override-pattern", default=None,
                   help=docs.get("hybrid_override_pattern"))
    g.add_argument("--mamba-num-heads", type=int, default=None,
                   help="default 2*hidden/--mamba-head-dim")
    g.add_argument("--mamba-head-dim", type=int, default=64)
    g.add_argument("--mamba-state-dim", type=int, default=128)
    g.add_argument("--mamba-num-groups", type=int, default=8)
    g.add_argument("--mamba-impl", default=None, choices=("auto", "megatron", "pytorch"),
                   help=docs.get("mamba_impl"))
    _bool_flag(g, "--disable-mamba-mem-eff-path", False, "megatron's mixer without its fused "
               "conv+scan path (which needs causal_conv1d's CUDA build)")
    g.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="width of one expert; default --ffn-hidden-size")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=("softmax", "sigmoid"))
    _bool_flag(g, "--moe-router-enable-expert-bias", False,
               "aux-loss-free balancing: a per-expert bias that chooses (does not weight) "
               "experts, updated after each step from the token counts (needs sigmoid)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-topk-scaling-factor", type=_number(float), default=None)
    g.add_argument("--moe-router-dtype", default=None, choices=("fp32", "fp64"),
                   help="router logits and probabilities in this dtype")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=MOE_LOAD_BALANCING_TYPES)
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=MOE_DISPATCHERS)
    _bool_flag(g, "--moe-grouped-gemm", False, "experts as one grouped GEMM (needs the "
               "grouped_gemm package or TE); default one GEMM per expert (SequentialMLP)")
    _bool_flag(g, "--squared-relu", False, "squared-ReLU MLPs and experts, no gating "
               "(Nemotron-H); implies --no-swiglu")


def validate_hybrid_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The hybrid/MoE flags' checks and derived defaults (before the world-size checks)."""
    pattern = args.hybrid_override_pattern
    if args.is_hybrid_model and pattern is None:
        parser.error("--is-hybrid-model needs --hybrid-override-pattern (one of M, *, -, E per "
                     "layer; attention/MLP ratios are not supported)")
    if pattern is not None:
        args.is_hybrid_model = True
        bad = sorted(set(pattern) - set("M*-E"))
        if bad:
            parser.error(f"--hybrid-override-pattern={pattern!r} has {bad}: allowed symbols "
                         "M (Mamba-2), * (attention), - (MLP), E (MoE)")
        if len(pattern) != args.num_layers:
            parser.error(f"--hybrid-override-pattern has {len(pattern)} symbols; allowed: "
                         f"exactly --num-layers={args.num_layers}")
        if "E" in pattern and not args.num_experts:
            parser.error("--hybrid-override-pattern has MoE layers (E): give --num-experts")
        if "M" in pattern and args.reset_attention_mask:
            parser.error("--reset-attention-mask (packed documents) is not supported by Mamba "
                         "layers (M in --hybrid-override-pattern)")
    if args.position_embedding_type is None:
        args.position_embedding_type = "none" if args.is_hybrid_model else "rope"
    if args.squared_relu and args.silu:
        parser.error("--squared-relu conflicts with --silu (one MLP activation; allowed: "
                     "either, or neither for --swiglu / GeLU)")
    for flag, on in (("--squared-relu", args.squared_relu), ("--silu", args.silu)):
        if on:
            if args.swiglu:
                note(f"{flag}: switching --swiglu off (as Megatron-LM, a non-gated activation "
                     "excludes the gated one)")
            args.swiglu = False
    if args.num_experts is not None:
        if args.num_experts < 1:
            parser.error(f"--num-experts={args.num_experts} must be >= 1")
        if not 1 <= args.moe_router_topk <= args.num_experts:
            parser.error(f"--moe-router-topk={args.moe_router_topk} must be in 1.."
                         f"--num-experts={args.num_experts}")
        if args.num_experts % args.expert_model_parallel_size:
            parser.error(f"--num-experts={args.num_experts} is not divisible by "
                         f"--expert-model-parallel-size={args.expert_model_parallel_size}")
        if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
            parser.error("MoE layers with --tensor-model-parallel-size > 1 need "
                         "--sequence-parallel (megatron's MoE layer refuses to train without it)")
    elif args.expert_model_parallel_size > 1:
        parser.error("--expert-model-parallel-size > 1 needs --num-experts")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        parser.error("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    if args.moe_token_dispatcher_type != "allgather" and not _cuda():
        parser.error(f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type} needs CUDA "
                     "(megatron's dispatcher creates CUDA streams); allowed on the CPU: allgather")
    if args.moe_grouped_gemm and not _cuda():
        parser.error("--moe-grouped-gemm needs CUDA (grouped_gemm/TE); allowed on the CPU: "
                     "--no-moe-grouped-gemm")


def _cuda() -> bool:
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


# ----------------------------------------------------------------------------------------------
# Megatron-LM's flags
# ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        usage="torchrun --nproc-per-node N %(prog)s [--config FILE] [flags]",
        description="Pretrain a GPT whose attention layers are megatron_subq variants, with "
                    "Megatron-LM's flags. Any flag may also come from --config FILE (YAML/JSON); "
                    "the command line wins. See docs/training.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="YAML or JSON file setting any flag by name; the command line overrides it")

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default: 4*hidden, or int(8*hidden/3) rounded down to a multiple of 64 "
                        "(at least 64) with SwiGLU, as Megatron-LM")
    g.add_argument("--num-attention-heads", type=int, default=None)
    _bool_flag(g, "--group-query-attention", False,
               "use --num-query-groups key/value heads (implied by --num-query-groups)")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None,
                   help="head dim; default hidden/heads")
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="default --seq-length")
    g.add_argument("--position-embedding-type", default=None,
                   choices=("rope", "learned_absolute", "none"),
                   help="default rope (Transformer++), none for a hybrid (Nemotron-H is NoPE)")
    g.add_argument("--rotary-base", type=int, default=10000)
    _bool_flag(g, "--use-rope-scaling", False,
               "Llama 3.x RoPE frequency scaling (megatron's rope_scaling: low/high frequency "
               "factors 1/4, original context 8192)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="the factor of --use-rope-scaling (Llama 3.1: 8, Llama 3.2: 32)")
    _bool_flag(g, "--qk-layernorm", False,
               "normalise each query and key head (the --normalization kind) before RoPE "
               "(Qwen3's q/k norms)")
    _bool_flag(g, "--add-qkv-bias", False,
               "biases on the query/key/value projection only (Qwen2)")
    g.add_argument("--normalization", default="RMSNorm", choices=("RMSNorm", "LayerNorm"))
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    _bool_flag(g, "--swiglu", True, "SwiGLU MLP (Transformer++); --no-swiglu for GeLU")
    _bool_flag(g, "--silu", False, "non-gated SiLU (Swish) MLPs: fc2(silu(fc1 x)), e.g. the ASA "
               "paper's 1.3B at --ffn-hidden-size 4*hidden; implies --no-swiglu (as "
               "--squared-relu; --swiglu is the gated SiLU)")
    _bool_flag(g, "--add-bias-linear", False, "biases in linear layers (Megatron-LM's "
               "--disable-bias-linear is the default here)")
    _bool_flag(g, "--untie-embeddings-and-output-weights", True,
               "separate output layer (Transformer++); --no-untie-... ties them")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    _bool_flag(g, "--use-cpu-initialization", False,
               "initialise full weights on the CPU then split (TP=N starts like TP=1); always on "
               "without CUDA")

    add_variant_arguments(p)
    add_hybrid_arguments(p)
    add_fusion_arguments(p)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default micro-batch-size * data-parallel size")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    _bool_flag(g, "--skip-train", False, "no training: load, evaluate on the validation set, exit")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, if --save) when the iteration is a multiple of this")
    _bool_flag(g, "--exit-signal-handler", False,
               "on SIGTERM, finish the iteration, save (if --save) and exit 0 (a cluster's time "
               "limit or preemption; recipes/slurm/train.sbatch then resumes the requeued job)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop (after saving, if --save) once training has run this many minutes")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--recompute-granularity", default=None, choices=("full", "selective"))
    _bool_flag(g, "--recompute-activations", False, "= --recompute-granularity selective")
    g.add_argument("--recompute-method", default=None, choices=("uniform", "block"))
    g.add_argument("--recompute-num-layers", type=int, default=None)
    _bool_flag(g, "--check-for-nan-in-loss-and-grad", True,
               "fail on a NaN gradient in the gradient all-reduce")

    g = p.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", default="linear", choices=LR_DECAY_STYLES)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=("exponential", "linear", "cosine", "minus_sqrt"))
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    _bool_flag(g, "--override-opt-param-scheduler", False,
               "on --load, take the LR/WD schedule (lr, min lr, warm-up, decay length and style, "
               "weight decay) from these flags, not from the checkpoint (Megatron-LM's flag)")
    _bool_flag(g, "--use-checkpoint-opt-param-scheduler", False,
               "on --load, take the LR/WD schedule from the checkpoint and ignore these flags "
               "(Megatron-LM's flag). With neither, a schedule that differs from the "
               "checkpoint's is an error")

    g = p.add_argument_group("optimizer and regularization")
    g.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant",
                   choices=("constant", "linear", "cosine"))
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)

    g = p.add_argument_group("mixed precision")
    _bool_flag(g, "--bf16", False, "bf16 weights and activations, fp32 main params/grads")
    _bool_flag(g, "--fp16", False, "fp16 with dynamic loss scaling")
    g.add_argument("--loss-scale", type=float, default=None, help="fixed fp16 loss scale")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    _bool_flag(g, "--accumulate-allreduce-grads-in-fp32", False,
               "fp32 gradient buffers (always on with --bf16, as Megatron-LM)")

    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="CP: every sequence split over this many ranks (megatron's zig-zag "
                        "halves); the variant's context-parallel path exchanges them")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP: MoE experts split over this many data-parallel ranks")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="TP inside each expert; default --tensor-model-parallel-size")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    _bool_flag(g, "--sequence-parallel", False, "shard activations along the sequence over TP")
    _bool_flag(g, "--use-distributed-optimizer", False, "shard optimizer state over DP")
    _bool_flag(g, "--overlap-grad-reduce", False, "overlap DP gradient reduction with backward")
    _bool_flag(g, "--overlap-param-gather", False,
               "overlap the distributed optimizer's parameter all-gather with forward")
    g.add_argument("--distributed-backend", default=None, choices=("nccl", "gloo"),
                   help="default nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="dataset prefixes (PATH_text_document), optionally weighted: "
                        "'0.3 A 0.7 B'")
    g.add_argument("--split", default="969,30,1",
                   help="train,valid,test weights of the --data-path documents")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--data-args-path", default=None,
                   help="a blend file holding the --data-path value (tools/preprocess_data.py "
                        "writes PREFIX_text.blend): 'PREFIX ...' or 'WEIGHT PREFIX ...', '#' "
                        "comments; relative prefixes are relative to the file's folder")
    g.add_argument("--per-split-data-args-path", default=None,
                   help='a JSON file {"train": [...], "valid": [...], "test": [...]} holding the '
                        "--train/valid/test-data-path values (prefixes as --data-args-path)")
    _bool_flag(g, "--mock-data", False, "random tokens instead of --data-path")
    g.add_argument("--data-cache-path", default=None,
                   help="where GPTDataset index files are cached (default beside the data)")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes")
    g.add_argument("--num-dataset-builder-threads", type=int, default=1)
    _bool_flag(g, "--reset-position-ids", False, "restart position ids after each EOD (RoPE "
               "reads no position ids: it restarts per document under --reset-attention-mask)")
    _bool_flag(g, "--reset-attention-mask", False, "documents end at EOD tokens: each micro-"
               "batch runs as packed sequences (THD) so that no token attends across documents "
               f"(variants {', '.join(_packed_variants())})")
    _bool_flag(g, "--eod-mask-loss", False, "no loss on predicting the token after an EOD")
    _bool_flag(g, "--subq-loss-mask-data", False,
               "per-token loss masks from sidecar datasets: every data prefix P that has "
               "P_lossmask.bin/.idx (a uint8 megatron indexed dataset, one sequence per document "
               "of P of the same length, 1 where that token as a label counts in the loss, 0 "
               "where not) trains only on its 1s (multiplied into megatron's loss mask, so "
               "--eod-mask-loss still applies); prefixes without one train on every token. So "
               "retrieval samples (NIAH) teach only their answer while LM text in the same blend "
               "keeps the full loss. Default off: sidecars are ignored. Refused with "
               "--mock-data, when no prefix has a sidecar, and for a sidecar that does not match "
               "its prefix (megatron_subq/training/loss_mask_data.py)")

    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model file, HuggingFace tokenizer.json (or its folder), "
                        "or 'mistral': the Mistral 7B SentencePiece model shipped inside the "
                        "mistral-common package (never downloaded)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer's vocabulary; with another tokenizer, the vocabulary the "
                        "run expects (start-up fails when the tokenizer's differs; "
                        "tools/plan_run.py reads it without the tokenizer file)")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint folder to save to")
    g.add_argument("--load", default=None, help="checkpoint folder to resume from")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-format", default="torch_dist", choices=("torch_dist",))
    _bool_flag(g, "--dist-ckpt-optim-fully-reshardable", True,
               "save the distributed optimizer's state per parameter, so it loads at any "
               "TP/PP/DP (--no-...: per-rank buffers, faster, DP resharding only)")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration instead of the tracker file's")
    _bool_flag(g, "--save-optim", True, "save optimizer + scheduler state (Megatron-LM: "
               "--no-save-optim)")
    _bool_flag(g, "--save-rng", True, "save RNG state")
    _bool_flag(g, "--load-optim", True, "load optimizer + scheduler state")
    _bool_flag(g, "--load-rng", True, "load RNG state")
    _bool_flag(g, "--finetune", False, "load weights only; iteration and data restart from 0")
    _bool_flag(g, "--exit-on-missing-checkpoint", False,
               "fail when --load has no checkpoint instead of starting from scratch")
    _bool_flag(g, "--use-checkpoint-args", False,
               "take the model-defining flags (shape, --attention-variant, --layer-pattern, the "
               "variant knobs, the tokenizer) from the --load checkpoint's stored arguments, "
               "over the command line and --config (as Megatron-LM)")
    _bool_flag(g, "--allow-model-change", False,
               "load a checkpoint whose model-defining flags differ from this run's, on purpose: "
               "tensors of the same name are loaded, the others keep their initial values, the "
               "optimizer state is not loaded (without it such a difference is an error)")

    g = p.add_argument_group("logging and validation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument("--metrics-file", default=None,
                   help="JSON lines with every iteration's exact loss, grad norm, lr and each "
                        "validation (written by the last rank)")
    g.add_argument("--peak-tflops-per-gpu", type=float, default=None,
                   help="peak dense TFLOP/s of one accelerator for MFU (default: known GPUs' "
                        "bf16 dense peak; no MFU on the CPU)")
    return p


# ----------------------------------------------------------------------------------------------
# --config FILE
# ----------------------------------------------------------------------------------------------
def _load_config_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        import yaml  # noqa: PLC0415

        data = yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError("the top level must be a mapping of flag names to values")
    return data


def config_to_argv(parser: argparse.ArgumentParser, data: dict, path: str) -> List[str]:
    """Flag tokens that set what the config file sets (argparse then checks them)."""
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    tokens: List[str] = []
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest == "config" or dest not in actions:
            parser.error(f"--config {path}: unknown key {key!r} (there is no flag "
                         f"--{dest.replace('_', '-')})")
        action = actions[dest]
        flag = "--" + dest.replace("_", "-")
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                parser.error(f"--config {path}: {key} must be true or false, got {value!r}")
            tokens.append(flag if value else "--no-" + dest.replace("_", "-"))
        elif value is None:
            continue
        elif action.nargs in ("*", "+"):
            values = value if isinstance(value, list) else str(value).split()
            tokens += [flag] + [str(v) for v in values]
        else:
            if isinstance(value, list):  # e.g. layer_pattern as a YAML list
                value = ",".join(str(v) for v in value)
            tokens.append(f"{flag}={value}")  # one token: a value may start with '-' ("-*E")
    return tokens


# ----------------------------------------------------------------------------------------------
# checks and derived values
# ----------------------------------------------------------------------------------------------
def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def note(message: str) -> None:
    """A one-line start-up note about an adjusted flag, printed once (by rank 0 under torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {message}", flush=True)


def _require(parser, args, *names: str) -> None:
    for name in names:
        if getattr(args, name) is None:
            parser.error(f"--{name.replace('_', '-')} is required")


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  world_size: Optional[int] = None, check_files: bool = True
                  ) -> argparse.Namespace:
    """Megatron-LM's start-up checks and derived defaults; every failure names its flag.
    ``check_files=False`` skips the dataset checks (``data.check_data``): for planning a run
    (tools/plan_run.py) on a machine that does not hold the data."""
    world_size = world_size_from_env() if world_size is None else world_size
    _require(parser, args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
             "micro_batch_size")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "context_parallel_size", "log_interval",
                 "eval_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.eval_iters < 0:
        parser.error(f"--eval-iters={args.eval_iters} must be >= 0")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    if world_size % (tp * pp * cp):
        parser.error(f"--tensor-model-parallel-size={tp} x --pipeline-model-parallel-size={pp} "
                     f"x --context-parallel-size={cp} does not divide the world size "
                     f"{world_size}")
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or tp
    if ep < 1 or etp < 1:
        parser.error("--expert-model-parallel-size and --expert-tensor-parallel-size must be >= 1")
    if world_size % (etp * ep * pp):
        parser.error(f"--expert-tensor-parallel-size={etp} x --expert-model-parallel-size={ep} "
                     f"x --pipeline-model-parallel-size={pp} does not divide the world size "
                     f"{world_size}")
    validate_hybrid_args(parser, args)
    check_fusions(parser, args)
    args.world_size = world_size
    args.data_parallel_size = world_size // (tp * pp * cp)
    if cp > 1:
        _check_context_parallel(parser, args)

    if args.hidden_size % args.num_attention_heads:
        parser.error(f"--hidden-size={args.hidden_size} is not divisible by "
                     f"--num-attention-heads={args.num_attention_heads}")
    if args.num_attention_heads % tp:
        parser.error(f"--num-attention-heads={args.num_attention_heads} is not divisible by "
                     f"--tensor-model-parallel-size={tp}")
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    else:
        args.group_query_attention = True
    if args.num_attention_heads % args.num_query_groups:
        parser.error(f"--num-attention-heads={args.num_attention_heads} is not divisible by "
                     f"--num-query-groups={args.num_query_groups}")
    if args.num_query_groups % tp:
        parser.error(f"--num-query-groups={args.num_query_groups} is not divisible by "
                     f"--tensor-model-parallel-size={tp}")
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.ffn_hidden_size is None:
        if args.swiglu:
            args.ffn_hidden_size = max(64, int((4 * args.hidden_size * 2 / 3) / 64) * 64)
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    dense_mlp = args.hybrid_override_pattern is None or "-" in args.hybrid_override_pattern
    if dense_mlp and args.ffn_hidden_size % tp:
        parser.error(f"--ffn-hidden-size={args.ffn_hidden_size} is not divisible by "
                     f"--tensor-model-parallel-size={tp} (the MLP's column-parallel split)")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        parser.error(f"--seq-length={args.seq_length} exceeds --max-position-embeddings="
                     f"{args.max_position_embeddings}")
    if pp > 1 and args.decoder_first_pipeline_num_layers is None and \
            args.decoder_last_pipeline_num_layers is None and args.num_layers % pp:
        parser.error(f"--num-layers={args.num_layers} is not divisible by "
                     f"--pipeline-model-parallel-size={pp} (or set "
                     "--decoder-first/last-pipeline-num-layers)")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # as Megatron-LM: nothing to shard over
        note("--sequence-parallel has no effect at --tensor-model-parallel-size 1: switched off "
             "(as Megatron-LM)")
    if args.reset_attention_mask:
        _check_packed_sequences(parser, args)
    if args.sequence_parallel and args.seq_length % tp:
        parser.error(f"--sequence-parallel needs --seq-length={args.seq_length} divisible by "
                     f"--tensor-model-parallel-size={tp}")

    # batch sizes
    dp = args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        parser.error(f"--global-batch-size={args.global_batch_size} is not divisible by "
                     f"--micro-batch-size={args.micro_batch_size} x data-parallel size {dp}")
    if pp > 1 and args.global_batch_size // (args.micro_batch_size * dp) < pp:
        note(f"{args.global_batch_size // (args.micro_batch_size * dp)} micro-batches per step "
             f"for {pp} pipeline stages: the pipeline is mostly bubble")

    # iterations
    if not args.skip_train:
        if (args.train_iters is None) == (args.train_samples is None):
            parser.error("give exactly one of --train-iters and --train-samples")
        if args.train_iters is not None and args.train_iters < 1:
            parser.error(f"--train-iters={args.train_iters} must be >= 1")
    if args.train_samples is not None:
        args.train_iters = args.train_samples // args.global_batch_size
    if args.lr is None and not args.skip_train:
        parser.error("--lr is required")
    if args.lr is None:
        args.lr = 0.0
    if args.min_lr > args.lr:
        parser.error(f"--min-lr={args.min_lr} exceeds --lr={args.lr}")
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        parser.error("--lr-warmup-fraction conflicts with --lr-warmup-iters/--lr-warmup-samples")
    if args.lr_warmup_iters and args.lr_warmup_samples:
        parser.error("--lr-warmup-iters conflicts with --lr-warmup-samples")
    if not args.skip_train and args.lr_warmup_fraction is None:
        gbs = args.global_batch_size
        warmup = args.lr_warmup_iters * gbs if args.train_samples is None else \
            args.lr_warmup_samples
        decay = ((args.lr_decay_iters or args.train_iters) * gbs if args.train_samples is None
                 else args.lr_decay_samples or args.train_samples)
        if warmup >= decay:
            parser.error("the LR warm-up (--lr-warmup-iters/--lr-warmup-samples) must be shorter "
                         "than the decay (--lr-decay-iters/--train-iters)")
    if args.lr_decay_style == "WSD" and args.lr_wsd_decay_iters is None and \
            args.lr_wsd_decay_samples is None:
        parser.error("--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay

    # precision
    if args.bf16 and args.fp16:
        parser.error("--bf16 conflicts with --fp16")
    if args.fp16:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            parser.error("--fp16 needs CUDA (megatron's fp16 loss scaler and its optimizer "
                         "steps run on GPUs only); on the CPU use --bf16 or full precision")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        parser.error("--override-opt-param-scheduler conflicts with "
                     "--use-checkpoint-opt-param-scheduler (take the schedule from the flags, or "
                     "from the checkpoint: not both)")
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            parser.error("--recompute-activations (selective) conflicts with "
                         "--recompute-granularity full")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full" and args.recompute_method is None:
        args.recompute_method = "uniform"
    if args.recompute_granularity == "full" and args.recompute_num_layers is None:
        args.recompute_num_layers = 1
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        parser.error("--overlap-param-gather needs --use-distributed-optimizer")

    # data and tokenizer
    _read_data_files(parser, args, check_files)
    has_paths = bool(args.data_path) or bool(args.train_data_path)
    if args.mock_data and has_paths:
        parser.error("--mock-data conflicts with --data-path/--train-data-path")
    if not args.mock_data and not has_paths:
        parser.error("give --data-path (or --train-data-path, or a blend file: --data-args-path "
                     "/ --per-split-data-args-path) or --mock-data")
    if args.data_path and (args.train_data_path or args.valid_data_path or args.test_data_path):
        parser.error("--data-path conflicts with --train/valid/test-data-path")
    if args.subq_loss_mask_data and args.mock_data:
        parser.error("--subq-loss-mask-data conflicts with --mock-data (mock data has no "
                     "PREFIX_lossmask sidecars to read); allowed: --data-path with sidecars, or "
                     "--no-subq-loss-mask-data")
    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if getattr(args, name):
            parse_blend(parser, getattr(args, name), "--" + name.replace("_", "-"))
    from .data import check_data  # noqa: PLC0415 - megatron's dataset modules load only when used

    if check_files:
        check_data(parser, args)  # prefixes exist, .bin matches .idx, every split can be built
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if args.mock_data and args.vocab_size else None
    if args.tokenizer_type is None:
        parser.error("--tokenizer-type is required (NullTokenizer with --vocab-size for mock "
                     "data)")
    if args.tokenizer_type == "NullTokenizer":
        if args.vocab_size is None:
            parser.error("--tokenizer-type NullTokenizer needs --vocab-size")
    elif args.tokenizer_model is None:
        parser.error(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")

    # checkpoints and logging
    if args.save_interval is not None and args.save is None:
        parser.error("--save-interval needs --save")
    if args.save is not None and args.save_interval is None:
        args.save_interval = args.train_iters or 1
    if args.skip_train and args.load is None:
        parser.error("--skip-train needs --load (there is nothing to evaluate)")
    if args.ckpt_step is not None and args.load is None:
        parser.error("--ckpt-step needs --load")
    for name in ("use_checkpoint_args", "allow_model_change"):
        if getattr(args, name) and args.load is None:
            parser.error(f"--{name.replace('_', '-')} needs --load")
    if args.distributed_backend is None:
        import torch  # noqa: PLC0415

        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    return args


def _read_data_files(parser, args: argparse.Namespace, check_files: bool = True) -> None:
    """--data-args-path / --per-split-data-args-path: read the blend file into --data-path /
    --train/valid/test-data-path (prefixes resolved against the file's folder); each excludes
    the flags it replaces, the other file flag and --mock-data. Without ``check_files`` (the
    planner, before the data exists) a missing blend file stands for its own data."""
    given = [f for f, v in (("--data-args-path", args.data_args_path),
                            ("--per-split-data-args-path", args.per_split_data_args_path)) if v]
    if not given:
        return
    if len(given) == 2:
        parser.error("--data-args-path conflicts with --per-split-data-args-path (give one "
                     "blend file)")
    others = [f for f, v in (("--data-path", args.data_path),
                             ("--train-data-path", args.train_data_path),
                             ("--valid-data-path", args.valid_data_path),
                             ("--test-data-path", args.test_data_path),
                             ("--mock-data", args.mock_data)) if v]
    if others:
        parser.error(f"{given[0]} conflicts with {', '.join(others)} (the file holds the data "
                     "paths)")
    path = args.data_args_path or args.per_split_data_args_path
    if not check_files and not os.path.isfile(path):
        if args.data_args_path:
            args.data_path = [path]
        else:
            args.train_data_path = [path]
        return
    if args.data_args_path:
        args.data_path = read_data_args_file(parser, args.data_args_path)
    else:
        splits = read_per_split_file(parser, args.per_split_data_args_path)
        args.train_data_path = splits["train"]
        args.valid_data_path = splits["valid"]
        args.test_data_path = splits["test"]


DATA_SOURCE_FLAGS = frozenset((
    "--data-path", "--data-args-path", "--per-split-data-args-path", "--train-data-path",
    "--valid-data-path", "--test-data-path", "--mock-data"))
"""Where the training data comes from: a data source given on the command line replaces the config
file's (a recipe's SlimPajama blend, say, by ``--mock-data`` or the docs corpus), instead of
conflicting with it; other flags override one by one."""


def parse_args(argv: Optional[Sequence[str]] = None,
               world_size: Optional[int] = None, check_files: bool = True,
               parser: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    """Parse (config file, then command line) and validate. Exits with status 2 on bad flags
    (``parser``: a ``build_parser()`` whose ``error`` may raise instead; ``check_files``: see
    ``validate_args``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = parser or build_parser()
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is not None:
        try:
            data = _load_config_file(known.config)
        except Exception as e:  # noqa: BLE001 - any read/parse problem is a start-up error
            parser.error(f"--config {known.config}: {type(e).__name__}: {e}")
        given = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
        if given & DATA_SOURCE_FLAGS or given & {"--no-mock-data"}:
            data = {k: v for k, v in data.items()
                    if "--" + str(k).lstrip("-").replace("_", "-") not in DATA_SOURCE_FLAGS}
        argv = config_to_argv(parser, data, known.config) + argv
    args = parser.parse_args(argv)
    if args.use_checkpoint_args:
        _take_checkpoint_args(parser, args)
    args = validate_args(parser, args, world_size, check_files=check_files)
    args._parser = parser  # for errors found later (model config) to name their flag
    return args


def _take_checkpoint_args(parser, args: argparse.Namespace) -> None:
    """--use-checkpoint-args: overwrite the model-defining arguments (``checkpointing.model_args``
    of the checkpoint's layers, the variant and pattern, the tokenizer flags) with the values
    stored in the --load checkpoint, before validation. ``args._checkpoint_args_note`` lists the
    values that changed. Without a checkpoint in --load the command line is kept (a note says so),
    as Megatron-LM does."""
    from . import checkpointing  # noqa: PLC0415

    if args.load is None:
        parser.error("--use-checkpoint-args needs --load")
    folder = checkpointing.checkpoint_folder(args.load, args.ckpt_step)
    if folder is None or not os.path.isdir(folder):
        args._checkpoint_args_note = (f"--use-checkpoint-args: no checkpoint in --load "
                                      f"{args.load}; the command line's model flags are used")
        return
    try:
        saved = checkpointing.saved_args(folder)
    except Exception as e:  # noqa: BLE001 - an unreadable checkpoint is a start-up error
        parser.error(f"--use-checkpoint-args: cannot read the arguments of {folder} "
                     f"({type(e).__name__}: {e})")
    names = (["attention_variant", "layer_pattern", "group_query_attention"]
             + checkpointing.model_args(checkpointing.layer_variants(saved))
             + list(checkpointing.TOKENIZER_ARGS))
    taken = []
    for name in names:
        if name in saved and hasattr(args, name) and getattr(args, name) != saved[name]:
            taken.append(f"{flag_for_field(name)} {saved[name]}")
            setattr(args, name, saved[name])
    args._checkpoint_args_note = (f"--use-checkpoint-args: from {folder}: "
                                  + (", ".join(taken) or "nothing differed"))


def add_fusion_arguments(parser: argparse.ArgumentParser) -> None:
    """megatron-core's own fusions under Megatron-LM's flag names (docs/training.md, "Fused
    kernels"). Off by default here (Megatron-LM defaults most on): the local spec's unfused path
    stays the default until the A/B measurements are in. ``--subq-fused-norm`` (this package's
    Triton RMSNorm) is a config field, in the variant group; ``--subq-fused-adam`` (torch's fused
    Adam for megatron-core's optimizer) is an optimizer flag here, not a model one."""
    g = parser.add_argument_group(
        "fusions", "megatron-core's fused ops that run without Transformer Engine or apex; "
        "the flags naming one that needs them are refused at start-up")
    _bool_flag(g, "--bias-swiglu-fusion", False,
               "megatron-core's fused (bias +) SwiGLU (fusions/fused_bias_swiglu.py, "
               "torch.compile'd forward and hand-written backward): config.bias_activation_fusion; "
               "needs --swiglu")
    _bool_flag(g, "--bias-dropout-fusion", False,
               "megatron-core's fused bias + dropout + residual add (fusions/fused_bias_dropout.py,"
               " torch.compile'd): config.bias_dropout_fusion")
    _bool_flag(g, "--cross-entropy-loss-fusion", False,
               "megatron-core's fused vocab-parallel cross-entropy (fusions/fused_cross_entropy.py,"
               " torch.compile'd pieces, one all-reduce fewer): config.cross_entropy_loss_fusion")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=("native", "te"),
                   help="native: megatron-core's; te: Transformer Engine's (needs TE)")
    _bool_flag(g, "--apply-rope-fusion", False,
               "megatron-core's fused RoPE: Transformer Engine's kernel (refused without TE; "
               "see --subq-fused-rope)")
    _bool_flag(g, "--masked-softmax-fusion", False,
               "megatron's fused scale-mask-softmax (refused: Megatron-LM's compiled CUDA "
               "extension, and the local core attention is torch SDPA, fused already)")
    _bool_flag(g, "--persist-layer-norm", False,
               "apex's persistent LayerNorm (refused without apex; see --subq-fused-norm)")
    _bool_flag(g, "--gradient-accumulation-fusion", False,
               "weight-gradient GEMMs accumulating into main_grad (apex's "
               "fused_weight_gradient_mlp_cuda; refused without it)")
    g.add_argument("--subq-sdpa-backend", default="auto", choices=SDPA_BACKENDS,
                   help="the backend of torch's scaled_dot_product_attention (the standard "
                        "variant's core attention and any other SDPA call): auto lets torch "
                        "choose (cuDNN first on Hopper); a name allows only that one (torch."
                        "backends.cuda.enable_<name>_sdp). The same math through another "
                        "kernel: for A/B timing, and the bf16-rounding yardstick of "
                        "tools/loss_match.py's control-sdpa arm")
    _bool_flag(g, "--subq-fused-adam", False,
               "torch's fused Adam/AdamW (fused=True, foreach=False: one kernel per step) for "
               "megatron-core's torch optimizer, which it builds with torch's default foreach "
               "implementation without TE/apex; the same update, CUDA or CPU parameters; "
               "checkpoints do not depend on it (megatron_subq/training/fused_adam.py); needs "
               "--optimizer adam")


def _importable(module: str) -> bool:
    import importlib.util  # noqa: PLC0415

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def apply_sdpa_backend(name: str) -> None:
    """``--subq-sdpa-backend``: torch's process-wide SDPA switches (``auto``: left as they are);
    a backend that cannot run a call then fails in SDPA with torch's own message."""
    if name == "auto":
        return
    import torch  # noqa: PLC0415

    for other in SDPA_BACKENDS[1:]:
        getattr(torch.backends.cuda, f"enable_{other}_sdp")(other == name)


def check_fusions(parser, args) -> None:
    """Refuse, naming the flag, a fusion whose kernel is missing here or that cannot apply to
    this model; what runs is handed to the config by ``trainer.build_config``."""
    have_te = _importable("transformer_engine") and _cuda()
    if args.bias_swiglu_fusion and (not args.swiglu or args.squared_relu
                                    or getattr(args, "silu", False)):
        parser.error("--bias-swiglu-fusion fuses the gated SiLU (SwiGLU) MLP: it needs --swiglu "
                     "(not --no-swiglu, --silu or --squared-relu); allowed: "
                     "--no-bias-swiglu-fusion")
    if (args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "native"
            and not args.bf16):
        # megatron-core 0.16.1 fused_cross_entropy.calculate_gradients ends in
        # grad_input.to(torch.bfloat16): exact under --bf16 (the logits are bf16 there, so the
        # unfused gradient is rounded to bf16 too), a rounding of the gradient otherwise
        parser.error("--cross-entropy-loss-fusion (native) rounds the logits' gradient to bf16 "
                     "(megatron-core's fused_cross_entropy.py), which changes fp32 and fp16 "
                     "training; allowed: with --bf16, or --no-cross-entropy-loss-fusion")
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te" and not have_te:
        parser.error("--cross-entropy-fusion-impl te needs Transformer Engine (not importable "
                     "here, or no CUDA); allowed: --cross-entropy-fusion-impl native")
    if args.apply_rope_fusion and not have_te:
        parser.error("--apply-rope-fusion: megatron-core's fused RoPE is Transformer Engine's "
                     "(fused_apply_rotary_pos_emb), which is not importable here (or no CUDA); "
                     "allowed: --no-apply-rope-fusion, or --subq-fused-rope (the same fusion on "
                     "this package's Triton kernel)")
    if args.masked_softmax_fusion:
        parser.error("--masked-softmax-fusion: megatron's FusedScaleMaskSoftmax needs Megatron-"
                     "LM's compiled scaled_masked_softmax_cuda extension, and the local core "
                     "attention (torch SDPA) fuses the softmax already; allowed: "
                     "--no-masked-softmax-fusion")
    if args.persist_layer_norm and not _importable("apex"):
        parser.error("--persist-layer-norm needs apex (FusedLayerNorm), which is not importable "
                     "here; allowed: --no-persist-layer-norm (--subq-fused-norm is the fused "
                     "RMSNorm without apex)")
    if args.gradient_accumulation_fusion and not _importable("fused_weight_gradient_mlp_cuda"):
        parser.error("--gradient-accumulation-fusion needs apex's fused_weight_gradient_mlp_cuda "
                     "extension, which is not importable here; allowed: "
                     "--no-gradient-accumulation-fusion")
    if args.subq_fused_adam and args.optimizer != "adam":
        parser.error("--subq-fused-adam switches torch's Adam/AdamW to its fused "
                     f"implementation; --optimizer {args.optimizer} is not Adam; allowed: "
                     "--optimizer adam, or --no-subq-fused-adam")
    if getattr(args, "subq_fused_norm", False) and have_te:
        parser.error("--subq-fused-norm replaces the local spec's norm, but Transformer Engine is "
                     "in use (its norm is fused already); allowed: --no-subq-fused-norm")


def fail(args: argparse.Namespace, message: str) -> None:
    """A start-up error found after parsing (e.g. by the model config): usage + message, exit 2."""
    parser = getattr(args, "_parser", None) or build_parser()
    parser.error(message)


def _check_context_parallel(parser, args) -> None:
    """--context-parallel-size > 1: the sequence splits into 2·CP equal chunks (megatron's
    zig-zag), and what has no CP path is refused before anything is built (each variant's own
    path is checked by the model config: ``Variant.context_parallel``)."""
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if args.seq_length % (2 * cp):
        parser.error(f"--context-parallel-size={cp} needs --seq-length={args.seq_length} "
                     f"divisible by 2 x --context-parallel-size = {2 * cp}")
    if args.sequence_parallel and (args.seq_length // cp) % tp:
        parser.error(f"--sequence-parallel with --context-parallel-size={cp} needs "
                     f"--seq-length / {cp} = {args.seq_length // cp} divisible by "
                     f"--tensor-model-parallel-size={tp}")
    if args.reset_attention_mask:
        parser.error(f"--reset-attention-mask (packed documents) with --context-parallel-size="
                     f"{cp} is not supported; allowed: one of them")


def _check_packed_sequences(parser, args) -> None:
    """--reset-attention-mask runs micro-batches as packed sequences: every layer's variant must
    take them (the check runs before anything is built)."""
    from ..variants import packed_sequence_variants  # noqa: PLC0415
    from ..patterns import resolve_layer_variants  # noqa: PLC0415

    pattern = args.layer_pattern
    if pattern is not None and "," in pattern:
        pattern = [v.strip() for v in pattern.split(",") if v.strip()]
    try:
        layers = resolve_layer_variants(pattern, args.attention_variant, args.num_layers,
                                        args.hybrid_override_pattern)
    except ValueError:
        return  # the config's own check names the bad pattern
    supported = packed_sequence_variants()
    unsupported = sorted(set(layers) - set(supported) - {None})
    if unsupported:
        parser.error(f"--reset-attention-mask: the variant(s) {', '.join(unsupported)} do not take "
                     f"packed sequences; allowed with it: {', '.join(supported)}")


def _packed_variants() -> list:
    from ..variants import packed_sequence_variants  # noqa: PLC0415

    return packed_sequence_variants()
