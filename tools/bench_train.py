"""Tokens/s and MFU of N training steps: the project's trainer against megatron-core's own GPT.

    python tools/bench_train.py --recipe transformer-pp-1.3b-100b --warmup 3 --steps 10 \\
        --json bench.json --profile prof/                                  # one GPU, bf16
    python tools/bench_train.py --recipe transformer-pp-1.3b-100b --attention-variant asa ...
    python tools/bench_train.py --recipe tiny-cpu --vocab-size 256 --steps 2 --warmup 2  # CPU, fp32
    python tools/bench_train.py --recipe transformer-pp-1.3b-100b \\
        --arm base=ours --arm fused=ours:"--some-fused-flag" --arm anchor=anchor   # A/B of a flag

Arms (``--arm NAME=KIND[:TRAINER FLAGS]``, repeatable; default ``ours=ours anchor=anchor``):

* ``ours``: the project's trainer (``megatron_subq.training.trainer``: ``build_model`` =
  ``build_gpt_model`` + Float16Module + megatron's DDP, ``build_optimizer`` =
  ``get_megatron_optimizer`` + ``OptimizerParamScheduler``, ``train_step`` = one
  ``get_forward_backward_func`` step + the optimizer step), the layers of ``--attention-variant``.
* ``anchor``: megatron-core's own ``GPTModel`` with its local spec (``get_gpt_layer_local_spec``:
  megatron's unfused ``DotProductAttention``, its local linear layers and norms), the same shape,
  wrapped and stepped the same way with megatron-core's optimizer (the distributed optimizer when
  the recipe asks for it), the same LR settings, micro-batch and sequence, and a REAL optimizer step
  (the earlier anchor was timed fwd+bwd only; the JSON says which this is). Its attention keeps
  the [mb, heads, seq, seq] probabilities of every layer for backward (fp32 softmax output and
  its bf16 copy: 3 GiB per layer at mb 8 x 16 heads x 2048, 72 GiB over the 1.3B's 24 layers),
  which did not fit beside the rest of the 1.3B step even on a 139 GiB H200; Megatron-LM's
  remedy is ``--recompute-granularity selective`` (core attention recomputed in backward,
  megatron-core's default ``recompute_modules``), given as the arm's flag
  (``--arm "anchor=anchor:--recompute-granularity selective"``, what gpu_train_bench.sh runs).
  Before running, each anchor arm's line gives this estimate (``anchor_attention_memory``: from
  megatron-core 0.16.1's code, not measured); the JSON has it and each arm's ``recompute`` (the
  config's granularity and how many attention layers the built model checkpoints). The anchor
  refuses ``--subq-fused-norm``/``--subq-fused-rope`` (its spec is megatron's: they would be
  ignored); megatron-core's own fusions and ``--subq-fused-adam`` (the optimizer) apply to it.

Every arm gets the same trainer flags: the recipe (``recipes/NAME.yaml`` or a path; its data,
checkpoint, logging and schedule-length keys dropped), then ``--`` flags given after ``--`` (any
trainer flag: a shape without a recipe, ``--use-distributed-optimizer``, ...), then the arm's own
flags. Data are the trainer's mock data (megatron's MockGPTDataset) unless ``--data-path``.
Global batch = micro-batch x data-parallel size (one micro-batch per GPU per step) unless
``--global-batch-size``.

Each arm runs in its own process (``torchrun --nproc-per-node N`` when ``--nproc`` > 1):
``--warmup`` untimed steps, then ``--steps`` timed steps (each between two device syncs, the max
over ranks); then, with ``--profile DIR``, one more step under ``torch.profiler`` (chrome trace
``DIR/ARM.trace.json.gz`` and ``DIR/ARM.top30.txt``: the 30 ops/kernels with the most self CUDA
time, self CPU time on the CPU), for the arms ``--profile-arms`` names (default: all). Per arm:
step time mean/stdev/min, tokens/s (total and per GPU), model FLOPs per step from
``megatron_subq.training.flops`` (the anchor counted as standard attention, so a
standard-attention ``ours`` counts exactly the anchor's FLOPs; recomputation adds none), TFLOP/s
per GPU, MFU against ``--peak-tflops`` or the GPU's bf16 dense peak (``flops.PEAK_TFLOPS``:
H100/H200 989; none on the CPU unless given), peak memory; then each arm's ratios against the
first anchor arm. A table goes to stdout and everything to ``--json``. An arm that fails is
reported with its error (an out-of-memory as ``out of memory at mb N``, the allocation that
failed in the JSON's ``oom_detail``); the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

KINDS = ("ours", "anchor")
# recipe keys a benchmark does not want: data sources (mock data or --data-path replace them),
# checkpoints, logs, the run's length and its warm-up (the run is --warmup + --steps steps)
DROPPED_KEYS = (
    "data-path", "data-args-path", "per-split-data-args-path", "train-data-path", "valid-data-path",
    "test-data-path", "save", "load", "save-interval", "tensorboard-dir", "wandb-project",
    "metrics-file", "train-iters", "train-samples", "lr-warmup-samples", "lr-warmup-iters",
    "lr-decay-samples", "lr-decay-iters", "lr-warmup-fraction", "lr-wsd-decay-samples",
    "lr-wsd-decay-iters", "exit-duration-in-mins", "exit-signal-handler", "exit-interval",
    "eval-interval", "eval-iters", "log-interval", "mock-data")
TOP = 30
# the trainer's fusion flags that run without TE/apex (docs/training.md, "Fused kernels"): each
# arm's JSON lists those it has on
FUSION_FLAGS = ("subq-fused-norm", "subq-fused-rope", "bias-swiglu-fusion", "bias-dropout-fusion",
                "cross-entropy-loss-fusion", "subq-fused-adam")


# ------------------------------------------------------------------------------------------------
# the command line (parent)
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        usage="%(prog)s [options] [-- TRAINER FLAGS...]",
        epilog="Flags after -- go to every arm's trainer (megatron_subq.training.arguments).")
    p.add_argument("--recipe", default=None,
                   help="recipes/NAME.yaml (or a path to a trainer config file)")
    p.add_argument("--arm", action="append", default=None, metavar="NAME=KIND[:FLAGS]",
                   help="an arm: KIND ours|anchor, FLAGS extra trainer flags (one shell-quoted "
                        "string); repeatable; default: ours=ours anchor=anchor")
    p.add_argument("--attention-variant", default=None,
                   help="the variant of the ours arms (default: the recipe's)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per arm (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per arm (default 10)")
    p.add_argument("--micro-batch-size", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=None,
                   help="sequence length (also sets --max-position-embeddings)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro-batch x data-parallel size")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="mock data's tokenizer size, EOD included (default: the recipe's "
                        "--vocab-size, else 32000)")
    p.add_argument("--data-path", default=None,
                   help="a preprocessed prefix instead of mock data (tokenizer from the recipe)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="default bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per arm; > 1: torchrun")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s per GPU for MFU (default: the GPU's bf16 dense peak)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="trace one more step per arm: DIR/ARM.trace.json.gz, DIR/ARM.top30.txt")
    p.add_argument("--profile-arms", default=None, metavar="NAME,...",
                   help="with --profile: trace only these arms (comma-separated names; default: "
                        "every arm)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--logs", default=None, metavar="DIR",
                   help="each arm's log, trainer config and JSON here (default: a temp folder)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per arm (default 1800)")
    p.add_argument("--dry-run", action="store_true",
                   help="check every arm's flags, print them, run nothing")
    p.add_argument("--in-process", action="store_true",
                   help="run the arms one after another in this process instead of one process "
                        "each (--nproc 1 only; quicker start, for tests: the CPU's peak memory is "
                        "then the process's, over all arms so far)")
    # internal: one arm in this process (the parent starts it)
    p.add_argument("--worker", choices=KINDS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-name", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    return p


def split_argv(argv):
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def parse_arm(parser, text: str):
    name, eq, rest = text.partition("=")
    kind, _, flags = rest.partition(":")
    if not eq or not name or not kind:
        parser.error(f"--arm {text!r}: expected NAME=KIND[:FLAGS] with KIND ours or anchor")
    if kind not in KINDS:
        parser.error(f"--arm {text!r}: KIND {kind!r} is not one of {', '.join(KINDS)}")
    if not name.replace("-", "").replace("_", "").isalnum():
        parser.error(f"--arm {text!r}: NAME {name!r} may hold letters, digits, - and _ only")
    try:
        extra = shlex.split(flags)
    except ValueError as e:
        parser.error(f"--arm {text!r}: FLAGS: {e}")
    return {"name": name, "kind": kind, "flags": extra}


def recipe_path(parser, recipe: str) -> str:
    for path in (recipe, os.path.join(ROOT, "recipes", recipe),
                 os.path.join(ROOT, "recipes", recipe + ".yaml")):
        if os.path.isfile(path):
            return path
    names = sorted(f[:-5] for f in os.listdir(os.path.join(ROOT, "recipes")) if f.endswith(".yaml"))
    parser.error(f"--recipe {recipe!r}: no such file, nor recipes/{recipe}.yaml; recipes: "
                 + ", ".join(names))


def bench_config(path: str, out_path: str, vocab_size, mock: bool) -> dict:
    """The recipe without DROPPED_KEYS (and without its tokenizer under mock data), written to
    ``out_path``; returns it."""
    import yaml  # noqa: PLC0415

    with open(path, encoding="utf-8") as f:
        c = yaml.safe_load(f) or {}
    c = {str(k).lstrip("-").replace("_", "-"): v for k, v in c.items()}
    for k in DROPPED_KEYS:
        c.pop(k, None)
    if mock:
        for k in ("tokenizer-model", "split"):
            c.pop(k, None)
        c["tokenizer-type"] = "NullTokenizer"
        c["vocab-size"] = null_vocab(vocab_size or c.get("vocab-size"))
    with open(out_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(c, f, sort_keys=False)
    return c


def null_vocab(tokens) -> int:
    """NullTokenizer's --vocab-size for a tokenizer of ``tokens`` tokens (32000 if None): it adds
    an EOD token, so the mock run's (padded) vocabulary is the real tokenizer's (the recipes'
    1,364,297,728 parameters of Transformer++ 1.3B, not 0.5M more)."""
    return int(tokens or 32000) - 1


def trainer_argv(opts, config_file, common, arm) -> list:
    """The trainer flags of one arm (the same for every arm but the arm's own)."""
    iters = opts.warmup + opts.steps + (1 if opts.profile else 0)
    argv = ["--config", config_file] if config_file else []
    argv += ["--train-iters", str(iters), "--eval-iters", "0", "--eval-interval", str(iters + 1),
             "--log-interval", str(iters + 1)]
    if opts.data_path:
        argv += ["--data-path", opts.data_path]
    else:
        argv += ["--mock-data"]
        if not config_file:
            argv += ["--tokenizer-type", "NullTokenizer",
                     "--vocab-size", str(null_vocab(opts.vocab_size))]
    if opts.micro_batch_size:
        argv += ["--micro-batch-size", str(opts.micro_batch_size)]
    if opts.seq_length:
        argv += ["--seq-length", str(opts.seq_length),
                 "--max-position-embeddings", str(opts.seq_length)]
    argv += ["--bf16"] if opts.dtype == "bf16" else ["--no-bf16", "--no-fp16"]
    argv += common
    if arm["kind"] == "ours" and opts.attention_variant:
        argv += ["--attention-variant", opts.attention_variant]
    argv += arm["flags"]
    return argv


def check_trainer_flags(parser, arm, argv, world):
    """Parse an arm's trainer flags now (files checked), so a bad one stops everything before any
    arm runs; the anchor refuses what megatron-core's GPTModel cannot be (a hybrid, MoE). Returns
    the parsed namespace."""
    from megatron_subq.training import arguments  # noqa: PLC0415

    tp = arguments.build_parser()

    def error(message):
        raise ValueError(message)

    tp.error = error
    try:
        args = arguments.parse_args(argv, world_size=world, parser=tp)
    except ValueError as e:
        parser.error(f"--arm {arm['name']} ({arm['kind']}): the trainer refuses its flags: {e} "
                     f"(flags: {shlex.join(argv)})")
    except SystemExit as e:  # argparse's own exits (unknown flag, bad value) print their message
        parser.error(f"--arm {arm['name']} ({arm['kind']}): the trainer refuses its flags "
                     f"(exit {e.code}; its message is above); flags: {shlex.join(argv)}")
    if arm["kind"] == "anchor":
        if args.hybrid_override_pattern:
            parser.error(f"--arm {arm['name']}: the anchor is megatron-core's GPTModel; a hybrid "
                         "(--hybrid-override-pattern) has no anchor")
        if getattr(args, "num_experts", None):
            parser.error(f"--arm {arm['name']}: the anchor arm takes no MoE (--num-experts)")
        for flag in ("subq_fused_norm", "subq_fused_rope"):
            if getattr(args, flag, False):
                parser.error(f"--arm {arm['name']}: --{flag.replace('_', '-')} replaces a part "
                             "of this package's spec; the anchor is megatron-core's local spec, "
                             "which would ignore it; allowed on the anchor: megatron-core's own "
                             "fusions (--bias-swiglu-fusion, --bias-dropout-fusion, "
                             "--cross-entropy-loss-fusion) and --subq-fused-adam")
    return args


GIB = 2 ** 30


def anchor_attention_memory(args) -> dict:
    """What the anchor's attention (megatron-core 0.16.1's unfused ``DotProductAttention``, its
    ``FusedScaleMaskSoftmax`` on the torch path) needs for its [mb, heads/TP, seq, seq] scores,
    in GiB, read from that code (an estimate, not a measurement):

    * ``held_per_layer``: kept from forward to backward: the fp32 softmax output (what softmax's
      backward reads) and, in bf16/fp16, its half copy (what ``probs @ V`` saves): 6 bytes per
      score (4 in fp32). ``held_all_layers``: that times this stage's layers, unless
      ``--recompute-granularity`` recomputes core attention (``selective`` with megatron-core's
      default ``recompute_modules``, or ``full``): then nothing is kept across layers.
    * ``one_layer_peak``: while one layer's attention runs forward or backward (recomputed or
      not): scores, their fp32 copy, the softmax output and the gradients, about 14 bytes per
      score in bf16/fp16 (12 in fp32), plus megatron's persistent score buffer
      (``global_memory_buffer``, 2 or 4 bytes).
    """
    half = bool(args.bf16 or args.fp16)
    heads = args.num_attention_heads // args.tensor_model_parallel_size
    scores = args.micro_batch_size * heads * args.seq_length ** 2
    layers = math.ceil(args.num_layers / args.pipeline_model_parallel_size)
    recomputed = args.recompute_granularity in ("selective", "full")
    held = scores * (6 if half else 4) / GIB
    return {
        "scores_per_layer": scores, "layers": layers,
        "recompute_granularity": args.recompute_granularity,
        "held_per_layer_gib": held, "held_all_layers_gib": 0.0 if recomputed else held * layers,
        "held_without_recompute_gib": held * layers,
        "one_layer_peak_gib": scores * ((14 + 2) if half else (12 + 4)) / GIB,
        "source": "estimate from megatron-core 0.16.1's DotProductAttention code, not measured"}


def _size(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.2f} MiB"


def describe_anchor_memory(name: str, args, est: dict) -> str:
    """One line for an anchor arm: the estimate, and what this arm's recompute does to it."""
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    head = (f"arm {name} (anchor): megatron's unfused DotProductAttention, mb "
            f"{args.micro_batch_size} x "
            f"{args.num_attention_heads // args.tensor_model_parallel_size} heads x "
            f"{args.seq_length}^2 scores ({dtype}): keeps {_size(est['held_per_layer_gib'])} per "
            f"layer for backward, {_size(est['held_without_recompute_gib'])} over "
            f"{est['layers']} layers")
    if est["recompute_granularity"]:
        return (head + f"; this arm recomputes it (--recompute-granularity "
                f"{est['recompute_granularity']}): none kept, about "
                f"{_size(est['one_layer_peak_gib'])} while one layer runs (estimate)")
    return (head + f" (estimate); if that does not fit, give the arm --recompute-granularity "
            f"selective (none kept, about {_size(est['one_layer_peak_gib'])} while one layer "
            "runs)")


def parse(argv):
    parser = build_parser()
    own, common = split_argv(argv)
    opts = parser.parse_args(own)
    if opts.worker:
        return opts, common
    for name in ("warmup", "steps", "nproc", "micro_batch_size", "seq_length",
                 "global_batch_size", "vocab_size"):
        value = getattr(opts, name)
        low = {"warmup": 0, "vocab_size": 2}.get(name, 1)
        if value is not None and value < low:
            parser.error(f"--{name.replace('_', '-')} {value}: must be >= {low}")
    peak = opts.peak_tflops
    if peak is not None and not (peak > 0 and math.isfinite(peak)):
        parser.error(f"--peak-tflops {opts.peak_tflops}: must be a positive number")
    if opts.in_process and opts.nproc > 1:
        parser.error(f"--in-process runs one process: not with --nproc {opts.nproc}")
    if opts.timeout <= 0:
        parser.error(f"--timeout {opts.timeout}: must be > 0")
    if opts.data_path and not (os.path.isfile(opts.data_path + ".bin")
                               and os.path.isfile(opts.data_path + ".idx")):
        parser.error(f"--data-path {opts.data_path}: no {opts.data_path}.bin/.idx")
    if opts.data_path and opts.vocab_size:
        parser.error("--vocab-size is for mock data; with --data-path the tokenizer sets it")
    if not opts.recipe and "--num-layers" not in common:
        parser.error("give --recipe NAME, or a model shape after -- (--num-layers ... "
                     "--hidden-size ... --num-attention-heads ...)")
    for flag, path in (("--json", opts.json), ("--profile", opts.profile), ("--logs", opts.logs)):
        if path:
            folder = path if flag != "--json" else (os.path.dirname(os.path.abspath(path)))
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as e:
                parser.error(f"{flag} {path}: cannot create {folder}: {e}")
            if not os.access(folder, os.W_OK):
                parser.error(f"{flag} {path}: {folder} is not writable")
    arms = [parse_arm(parser, a) for a in (opts.arm or ["ours=ours", "anchor=anchor"])]
    names = [a["name"] for a in arms]
    if len(set(names)) != len(names):
        parser.error(f"--arm: arm names must differ ({', '.join(names)})")
    opts.profiled = set(names)
    if opts.profile_arms is not None:
        if not opts.profile:
            parser.error(f"--profile-arms {opts.profile_arms}: needs --profile DIR")
        wanted = [n.strip() for n in opts.profile_arms.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown or not wanted:
            parser.error(f"--profile-arms {opts.profile_arms!r}: {', '.join(unknown) or 'no name'}"
                         f" is not an arm; allowed: comma-separated names of {', '.join(names)}")
        opts.profiled = set(wanted)
    import torch  # noqa: PLC0415

    cuda = torch.cuda.is_available()
    if opts.nproc > 1 and cuda and torch.cuda.device_count() < opts.nproc:
        parser.error(f"--nproc {opts.nproc}: this machine has {torch.cuda.device_count()} GPU(s)")
    opts.dtype = opts.dtype or ("bf16" if cuda else "fp32")
    opts.recipe_file = recipe_path(parser, opts.recipe) if opts.recipe else None
    return opts, common, arms, parser


# ------------------------------------------------------------------------------------------------
# one arm (worker process)
# ------------------------------------------------------------------------------------------------
def anchor_model(args, config_kwargs, vocab: int):
    """megatron-core's GPTModel with its local layer spec, from the same config fields."""
    import dataclasses  # noqa: PLC0415

    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.transformer import TransformerConfig  # noqa: PLC0415

    names = {f.name for f in dataclasses.fields(TransformerConfig) if f.init}
    config = TransformerConfig(**{k: v for k, v in config_kwargs.items() if k in names})
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm,
                                    normalization=config.normalization)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor)
    return config, model


def top_table(prof, cuda: bool, top: int = TOP) -> str:
    """The ``top`` ops/kernels by self device time (self CPU time on the CPU)."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    try:
        return events.table(sort_by=key, row_limit=top)
    except (AttributeError, KeyError):  # older torch: self_cuda_time_total
        return events.table(sort_by="self_cuda_time_total" if cuda else key, row_limit=top)


def run_worker(opts, argv) -> int:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from megatron_subq.training import arguments  # noqa: PLC0415
    from megatron_subq.training import trainer as T  # noqa: PLC0415
    from megatron_subq.training.checkpointing import prepare_load  # noqa: PLC0415
    from megatron_subq.training.flops import flops_per_iteration  # noqa: PLC0415
    from megatron_subq.training.metrics import peak_memory_gb  # noqa: PLC0415
    from megatron_subq.training.tokenizer import build_tokenizer  # noqa: PLC0415

    args = arguments.parse_args(argv)
    created = T.initialize_distributed(args)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        from megatron.core import parallel_state  # noqa: PLC0415

        cuda = torch.cuda.is_available()
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
        vocab = prepare_load(args, tokenizer.vocab_size, log=T.print_rank_0)
        kwargs = T.config_kwargs(args)
        # the model FLOPs: the anchor (softmax attention everywhere) as the standard variant
        count_args = argparse.Namespace(**vars(args))
        if opts.worker == "anchor":
            count_args.attention_variant, count_args.layer_pattern = "standard", None
        count_config = T.build_config(count_args)
        flops = flops_per_iteration(count_config, args.seq_length, vocab, args.global_batch_size,
                                    args.micro_batch_size)
        if opts.worker == "ours":
            config = T.build_config(args)
            model = T.build_model(args, config, vocab)
            layers = T._layers_text(config)
        else:
            config, bare = anchor_model(args, kwargs, vocab)
            model = T.wrap_model(args, config, bare)
            layers = "megatron-core local spec (DotProductAttention)"
        n_params = T.count_parameters(model)
        from megatron.core.transformer.attention import Attention  # noqa: PLC0415

        selective = config.recompute_granularity == "selective"
        recompute = {
            "granularity": config.recompute_granularity,
            "modules": list(config.recompute_modules or []) if selective else None,
            # the attention layers of the built model whose core runs under a checkpoint
            "core_attention_checkpointed_layers": sum(
                1 for chunk in model for m in chunk.modules()
                if isinstance(m, Attention) and m.checkpoint_core_attention)}
        optimizer, scheduler = T.build_optimizer(args, model)
        T.set_step_hooks(args, config, model, optimizer)
        args.eod_token = tokenizer.eod
        train_ds, _, _ = T.build_datasets(args, tokenizer)
        loader = T.make_loader(train_ds, 0, None, args, parallel_state.get_data_parallel_rank(),
                               parallel_state.get_data_parallel_world_size())
        data = iter(loader)
        for chunk in model:
            chunk.train()

        def step():
            T._sync()
            start = time.perf_counter()
            loss, skipped, _ = T.train_step(args, model, optimizer, scheduler, data)
            T._sync()
            return time.perf_counter() - start, loss, skipped

        losses = []
        for _ in range(opts.warmup):
            step()
        times = []
        for _ in range(opts.steps):
            elapsed, loss, skipped = step()
            times.append(elapsed)
            if loss is not None:
                losses.append((loss[0] / loss[1].clamp(min=1)).item())
        # the slowest rank's time of each step, and the largest peak memory
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        t = torch.tensor(times + [peak_memory_gb()], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times, memory = t[:-1].tolist(), t[-1].item()
        # the loss is on the last pipeline stage only; other ranks send -inf
        loss_t = torch.tensor([losses[-1] if losses else -math.inf], dtype=torch.float64,
                              device=device)
        dist.all_reduce(loss_t, op=dist.ReduceOp.MAX)
        profile = None
        if opts.profile:
            from torch.profiler import ProfilerActivity, profile as torch_profile  # noqa: PLC0415

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with torch_profile(activities=activities) as prof:
                elapsed, _, _ = step()
            if dist.get_rank() == 0:
                os.makedirs(opts.profile, exist_ok=True)
                trace = os.path.join(opts.profile, f"{opts.worker_name}.trace.json.gz")
                table = os.path.join(opts.profile, f"{opts.worker_name}.top{TOP}.txt")
                prof.export_chrome_trace(trace)
                with open(table, "w", encoding="utf-8") as f:
                    f.write(f"# {opts.worker_name} ({opts.worker}): one training step "
                            f"({elapsed * 1000:.1f} ms under the profiler), top {TOP} by self "
                            f"{'CUDA' if cuda else 'CPU'} time\n")
                    f.write(top_table(prof, cuda) + "\n")
                profile = {"trace": trace, "table": table, "step_ms_profiled": elapsed * 1000}
        if dist.get_rank() == 0:
            world = dist.get_world_size()
            mean = statistics.mean(times)
            tokens = args.global_batch_size * args.seq_length
            result = {
                "kind": opts.worker, "layers": layers, "parameters": n_params,
                "world_size": world, "tp": args.tensor_model_parallel_size,
                "pp": args.pipeline_model_parallel_size, "dp": args.data_parallel_size,
                "micro_batch_size": args.micro_batch_size,
                "global_batch_size": args.global_batch_size, "seq_length": args.seq_length,
                "dtype": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
                "distributed_optimizer": bool(args.use_distributed_optimizer),
                "optimizer": args.optimizer, "optimizer_step": True,
                "fusions": [f for f in FUSION_FLAGS if getattr(args, f.replace("-", "_"))],
                "recompute": recompute,
                "padded_vocab": vocab, "tokens_per_step": tokens,
                "flops_per_step": flops, "warmup_steps": opts.warmup, "timed_steps": opts.steps,
                "step_times_s": times, "step_time_mean_s": mean,
                "step_time_stdev_s": statistics.stdev(times) if len(times) > 1 else 0.0,
                "step_time_min_s": min(times),
                "tokens_per_s": tokens / mean, "tokens_per_s_per_gpu": tokens / mean / world,
                "tflops_per_gpu": flops / mean / world / 1e12,
                "peak_memory_gb": memory,
                "peak_memory_kind": "max_memory_allocated" if cuda else "CPU peak RSS",
                "last_loss": loss_t.item() if loss_t.item() > -math.inf else None,
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "trainer_flags": argv, "profile": profile,
            }
            with open(opts.worker_out, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
    finally:
        T.teardown(created)
    return 0


# ------------------------------------------------------------------------------------------------
# the parent: every arm, the table, the JSON
# ------------------------------------------------------------------------------------------------
def run_arm(opts, arm, argv, folder, micro_batch=None) -> dict:
    out = os.path.join(folder, arm["name"] + ".json")
    tool = os.path.abspath(__file__)
    own = ["--worker", arm["kind"], "--worker-name", arm["name"], "--worker-out", out,
           "--warmup", str(opts.warmup), "--steps", str(opts.steps)]
    if opts.profile and arm["name"] in opts.profiled:
        own += ["--profile", os.path.abspath(opts.profile)]
    if opts.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={opts.nproc}", tool]
    else:
        cmd = [sys.executable, tool]
    cmd += own + ["--"] + argv
    print(f"== arm {arm['name']} ({arm['kind']}): {shlex.join(argv)}", flush=True)
    started = time.monotonic()
    if opts.in_process:
        worker = build_parser().parse_args(own)
        try:
            rc, log = run_worker(worker, list(argv)), ""
        except (Exception, SystemExit) as e:  # noqa: BLE001 - reported as the arm's error
            rc, log = 1, f"{type(e).__name__}: {e}"
    else:
        rc, log = _subprocess(opts, cmd)
    wall = time.monotonic() - started
    with open(os.path.join(folder, arm["name"] + ".log"), "w", encoding="utf-8") as f:
        f.write(log)
    return _result(arm, out, rc, log, wall, micro_batch)


def _subprocess(opts, cmd):
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=opts.timeout)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        log, rc = log + f"\ntimed out after {opts.timeout} s", "timeout"
    return rc, log


OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUDA error: out of memory")


def _result(arm, out, rc, log, wall, micro_batch=None) -> dict:
    """The arm's JSON, or its error: ``out of memory at mb N`` for an out-of-memory (the line
    saying what failed to allocate kept as ``oom_detail``), else the last error line."""
    if rc == 0 and os.path.isfile(out):
        with open(out, encoding="utf-8") as f:
            result = json.load(f)
    else:
        lines = [ln for ln in log.splitlines() if ln.strip() and "Warning" not in ln
                 and "warnings.warn" not in ln]
        oom = next((ln for ln in reversed(lines) if any(m in ln for m in OOM_MARKERS)), None)
        if oom is not None:
            error = f"out of memory at mb {micro_batch if micro_batch is not None else '?'}"
        else:
            error = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln),
                         lines[-1] if lines else "no output").strip()
        result = {"kind": arm["kind"], "error": error, "returncode": rc,
                  "log_tail": "\n".join(lines[-25:])}
        if oom is not None:
            result.update(oom=True, oom_detail=oom.strip()[:300])
        print(f"   arm {arm['name']} failed (exit {rc}): {error}", flush=True)
    result.update(name=arm["name"], arm_flags=arm["flags"], wall_s=wall)
    return result


def add_mfu(result: dict, peak) -> None:
    if "error" in result:
        return
    peak = peak or _peak_for(result.get("device", "cpu"))
    result["peak_tflops_per_gpu"] = peak
    result["mfu"] = result["tflops_per_gpu"] / peak if peak else None


def _peak_for(device: str):
    from megatron_subq.training.flops import peak_tflops  # noqa: PLC0415

    return None if device == "cpu" else peak_tflops(device)


def ratios(results: list) -> dict:
    """Each arm against the first anchor arm that ran (> 1 tokens/s: faster than the anchor)."""
    base = next((r for r in results if r["kind"] == "anchor" and "error" not in r), None)
    if base is None:
        return {}
    out = {"baseline": base["name"]}
    for r in results:
        if r is base or "error" in r:
            continue
        out[r["name"]] = {
            "tokens_per_s": r["tokens_per_s"] / base["tokens_per_s"],
            "step_time": r["step_time_mean_s"] / base["step_time_mean_s"],
            "mfu": (r["mfu"] / base["mfu"]) if r.get("mfu") and base.get("mfu") else None,
            "peak_memory": (r["peak_memory_gb"] / base["peak_memory_gb"]
                            if base["peak_memory_gb"] else None),
            "flops_per_step": r["flops_per_step"] / base["flops_per_step"]}
    return out


def table(report: dict) -> str:
    rows = [("arm", "kind", "recompute", "params", "step ms (sd)", "tokens/s", "tok/s/GPU",
             "TFLOP/s/GPU", "MFU", "peak GB", "vs anchor")]
    rat = report["ratios"]
    for r in report["arms"]:
        recompute = (r.get("recompute") or {}).get("granularity") or "-"
        if "error" in r:
            rows.append((r["name"], r["kind"], recompute, "-", "failed: " + r["error"][:60], "",
                         "", "", "", "", ""))
            continue
        vs = rat.get(r["name"], {}).get("tokens_per_s")
        rows.append((
            r["name"], r["kind"], recompute, f"{r['parameters'] / 1e6:.1f}M",
            f"{r['step_time_mean_s'] * 1e3:.1f} ({r['step_time_stdev_s'] * 1e3:.1f})",
            f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
            f"{r['tflops_per_gpu']:.3f}", f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-",
            f"{r['peak_memory_gb']:.2f}", f"{vs:.3f}x" if vs else "-"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    head = (f"{report['device']}, {report['dtype']}, {report['nproc']} process(es) per arm, "
            f"{report['warmup']} warm-up + {report['steps']} timed steps; the anchor is "
            "megatron-core's GPTModel (local spec) with a real optimizer step")
    return head + "\n" + "\n".join(lines)


def make_report(opts, argv, folder, results, pending) -> dict:
    import torch  # noqa: PLC0415

    device = next((r["device"] for r in results if "device" in r),
                  torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    return {
        "tool": "tools/bench_train.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "tools/bench_train.py", *argv]),
        "device": device, "dtype": opts.dtype, "nproc": opts.nproc, "recipe": opts.recipe,
        "warmup": opts.warmup, "steps": opts.steps, "data": opts.data_path or "mock",
        "anchor_note": "anchor = megatron-core GPTModel + get_gpt_layer_local_spec, megatron-core "
                       "optimizer with a real optimizer step (the earlier anchor was fwd+bwd only);"
                       " its unfused DotProductAttention keeps every layer's attention "
                       "probabilities unless the arm recomputes core attention: see each arm's "
                       "recompute and attention_memory_estimate",
        "flops_note": "model FLOPs of megatron_subq.training.flops; the anchor counted as the "
                      "standard variant",
        "logs": folder, "arms": results, "ratios": ratios(results),
        "pending_arms": [a["name"] for a in pending]}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parsed = parse(argv)
    if parsed[0].worker:
        return run_worker(*parsed)
    opts, common, arms, parser = parsed
    folder = os.path.abspath(opts.logs) if opts.logs else tempfile.mkdtemp(prefix="bench_train_")
    config_file = None
    if opts.recipe_file:
        config_file = os.path.join(folder, "recipe.yaml")
        try:
            bench_config(opts.recipe_file, config_file, opts.vocab_size, not opts.data_path)
        except Exception as e:  # noqa: BLE001 - an unreadable recipe is a start-up error
            parser.error(f"--recipe {opts.recipe}: {type(e).__name__}: {e}")
    # every arm's flags are checked before any arm runs
    argvs, micro_batches, estimates = {}, {}, {}
    for arm in arms:
        argv_arm = trainer_argv(opts, config_file, common, arm)
        args = check_trainer_flags(parser, arm, argv_arm, opts.nproc)
        micro_batches[arm["name"]] = args.micro_batch_size
        if arm["kind"] == "anchor":
            estimates[arm["name"]] = anchor_attention_memory(args)
            print(describe_anchor_memory(arm["name"], args, estimates[arm["name"]]), flush=True)
        if opts.global_batch_size is None:
            gbs = args.micro_batch_size * args.data_parallel_size
            argv_arm += ["--global-batch-size", str(gbs)]
        elif opts.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
            parser.error(f"--global-batch-size {opts.global_batch_size}: not a multiple of "
                         f"micro-batch {args.micro_batch_size} x data-parallel size "
                         f"{args.data_parallel_size}")
        else:
            argv_arm += ["--global-batch-size", str(opts.global_batch_size)]
        argvs[arm["name"]] = argv_arm
    if opts.dry_run:
        for arm in arms:
            print(f"{arm['name']} ({arm['kind']}): {shlex.join(argvs[arm['name']])}")
        return 0
    results = []
    for i, arm in enumerate(arms):
        result = run_arm(opts, arm, argvs[arm["name"]], folder, micro_batches[arm["name"]])
        if arm["name"] in estimates:
            result["attention_memory_estimate"] = estimates[arm["name"]]
        add_mfu(result, opts.peak_tflops)
        results.append(result)
        report = make_report(opts, argv, folder, results, arms[i + 1:])
        if opts.json:  # after every arm: a run stopped from outside keeps the arms done so far
            with open(opts.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
    print(table(report), flush=True)
    if opts.profile:
        for r in results:
            if r.get("profile"):
                print(f"profile {r['name']}: {r['profile']['table']}", flush=True)
    if opts.json:
        print(f"wrote {opts.json}", flush=True)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
