"""End-to-end decode speed: one model, several context lengths, the attention slots' variant
swapped per arm; chunked prefill tokens/s, then decode tokens/s through ``DecodeSession.step``
(docs/inference.md, "Decode speed").

    python tools/bench_decode.py --contexts 65536,262144,1048576 \
        --variants superlinear,ext=superlinear:superlinear_backward_factor=4:superlinear_forward_factor=2,standard \
        --prefill-chunk 16384 --decode-steps 32 --batch-size 1 --json decode.json -- \
        --hybrid-override-pattern MEMEM*EMEM*E --num-layers 12 --hidden-size 2688 ...

The model is built from Megatron-LM-style shape flags (everything after ``--``, or any flag this
tool does not know: the trainer's own parser and checks, ``examples/pretrain_gpt.py`` /
``pretrain_hybrid.py``'s flags; a hybrid with ``--hybrid-override-pattern``), with random weights,
or from a checkpoint (``--load``; an arm whose variant differs from the checkpoint's keeps the
weights whose names match and random ones for the rest). bf16 on a GPU (``--bf16`` is added unless
``--fp16`` is given), fp32 on the CPU (tiny shapes: the test).

An arm is ``[LABEL=]VARIANT[:KNOB=VALUE...]``: the variant in the attention slots (``--attention-
variant``: the hybrid's '*' slots, every GPT layer) and knobs as config fields or trainer flags
(``superlinear_backward_factor=4`` = ``--superlinear-backward-factor 4``). For each context and
arm: a random prompt of that length is prefilled ``--prefill-chunk`` tokens per forward (timed
chunk by chunk: prefill tokens/s), ``--warmup-steps`` untimed steps, then ``--decode-steps``
timed ``DecodeSession.step`` calls at ``--batch-size`` (the greedy token fed back): decode
tokens/s and ms per step, the host's enqueue time per step, every attention layer's and its
core's time per step (a few more steps with CUDA events around those modules), peak memory;
with ``--profile`` the top CUDA kernels of a few steps. Before an arm's first context, a throwaway
session prefills two chunks and takes two steps, so kernel compilation and autotuning stay out
of the timings. Ratios are against the baseline arm
(``--baseline``, default the first arm of variant ``standard``). Each arm's model is freed
before the next. The whole-model step is eager (no CUDA graph): host overhead is included.

``--decode-cuda-graph on`` runs the superlinear arms' one-token attention steps through the
captured plan (the config's ``superlinear_decode_graph``: a ``SuperlinearDecodePlan`` in a CUDA
graph per layer and capacity bucket; only the attention core's step, the rest stays eager);
``both`` runs each superlinear arm twice, eager as LABEL and captured as LABEL-graph (an arm
can also set it itself: ``superlinear_decode_graph=true``). The rows record the switch
(``decode_cuda_graph``), the steps that went through the plan and the graphs captured, in all
and during the timed steps (0 unless a timed step entered a new capacity bucket). On the CPU
the plan runs uncaptured with ``subq_impl=kernel`` (Triton's interpreter), else the eager step.

Every argument is checked before anything is allocated; a bad one is an error naming its flag.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

INT32_MAX = 2**31 - 1
PROFILE_STEPS = 4
SIZE_SUFFIX = {"k": 1024, "m": 1024**2}


# ------------------------------------------------------------------------------------------------
# arguments
# ------------------------------------------------------------------------------------------------
class BenchError(ValueError):
    """A bad argument, with the flag it came from in the message."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        epilog="Model flags: the trainer's (examples/pretrain_gpt.py --help), after -- or "
               "mixed in.")
    p.add_argument("--contexts", default="65536,262144,1048576",
                   help="prompt lengths, comma separated (suffix K/M: x1024 / x1024^2)")
    p.add_argument("--variants", default="superlinear,standard",
                   help="arms, comma separated: [LABEL=]VARIANT[:KNOB=VALUE...]")
    p.add_argument("--baseline", default=None,
                   help="the arm the ratios divide by (default: the first 'standard' arm)")
    p.add_argument("--prefill-chunk", default="16384",
                   help="prompt tokens per prefill forward ('none': the whole prompt at once)")
    p.add_argument("--decode-steps", default="32", help="timed decode steps (>= 1)")
    p.add_argument("--warmup-steps", default="4", help="untimed decode steps before them")
    p.add_argument("--layer-steps", default="8",
                   help="extra steps timed per attention layer with CUDA events (0: off)")
    p.add_argument("--batch-size", default="1", help="sequences decoded together")
    p.add_argument("--device", default="auto", help="auto, cuda or cpu (cpu: fp32 only)")
    p.add_argument("--load", default=None, help="a checkpoint (load_for_inference's) instead "
                   "of random weights from the model flags")
    p.add_argument("--ckpt-step", default=None, help="with --load: this step (default latest)")
    p.add_argument("--seed", default="1234", help="weights and prompts")
    p.add_argument("--verify-upto", default="0",
                   help="for contexts up to this length, check the greedy token after the "
                   "prefill against the argmax of scoring.full_logits on the same prompt")
    p.add_argument("--decode-cuda-graph", default="off",
                   help="superlinear arms' one-token steps through the captured plan "
                   "(superlinear_decode_graph): off (default), on, or both (each superlinear "
                   "arm twice: LABEL eager, LABEL-graph captured)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over a few decode steps: the top kernels per arm")
    p.add_argument("--json", default=None, help="write the results here (rewritten after "
                   "every arm, so a run cut short keeps what it measured)")
    return p


def _int(value, flag: str, minimum: int) -> int:
    text = str(value).strip()
    try:
        mult = SIZE_SUFFIX.get(text[-1:].lower(), 1)
        n = int(text[:-1] if mult > 1 else text) * mult
    except ValueError:
        n = None
    if n is None or n < minimum:
        raise BenchError(f"{flag} {value!r} is invalid: allowed an integer >= {minimum}"
                         + (" (K/M suffixes allowed)" if flag == "--contexts" else ""))
    return n


@dataclasses.dataclass
class Arm:
    label: str
    variant: str
    knobs: Dict[str, str]
    args: object = None  # the trainer's arguments of this arm
    config: object = None
    vocab: int = 0


def parse_arms(text: str) -> List[Arm]:
    from megatron_subq.variants import VARIANTS  # noqa: PLC0415

    decoding = sorted(n for n, v in VARIANTS.items() if v.decode_cache != "none")
    arms: List[Arm] = []
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        head = item.split(":", 1)[0]
        label, spec = ("", item) if "=" not in head else (head.split("=", 1)[0],
                                                          item[len(head.split("=", 1)[0]) + 1:])
        name, *knob_items = spec.split(":")
        name = name.strip()
        if name not in VARIANTS:
            raise BenchError(f"--variants: unknown variant {name!r} in {item!r}; allowed: "
                             + ", ".join(sorted(VARIANTS)))
        if VARIANTS[name].decode_cache == "none":
            raise BenchError(f"--variants: {name!r} cannot decode (Variant.decode_cache='none': "
                             f"no decode cache keeps its Q/K streams); allowed: "
                             + ", ".join(decoding))
        knobs = {}
        for k in knob_items:
            key, eq, value = k.partition("=")
            if not eq or not key.strip():
                raise BenchError(f"--variants: knob {k!r} of {item!r} is not KNOB=VALUE")
            knobs[key.strip().lstrip("-").replace("-", "_")] = value.strip()
        label = label.strip() or (name if not knobs else name + ":" + ":".join(
            f"{k}={v}" for k, v in knobs.items()))
        if any(a.label == label for a in arms):
            raise BenchError(f"--variants: two arms labelled {label!r}; name them LABEL=VARIANT")
        arms.append(Arm(label, name, knobs))
    if not arms:
        raise BenchError("--variants is empty: allowed one or more arms "
                         "[LABEL=]VARIANT[:KNOB=VALUE...]")
    return arms


def _knob_flags(arm: Arm) -> List[str]:
    out = []
    for key, value in arm.knobs.items():
        flag = "--" + key.replace("_", "-")
        if value.lower() in ("true", "false"):
            out.append(flag if value.lower() == "true" else "--no-" + flag[2:])
        else:
            out += [flag, value]
    return out


def _raising_parser():
    from megatron_subq.training import arguments  # noqa: PLC0415

    parser = arguments.build_parser()

    def error(message):
        raise BenchError(message)

    parser.error = error
    return parser


def _given(argv: List[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _trainer_args(model_argv: List[str], arm: Arm, need_positions: int, cuda: bool):
    """The trainer's validated arguments for the model flags plus this arm (its errors name the
    trainer's flags)."""
    from megatron_subq.training import arguments  # noqa: PLC0415

    argv = list(model_argv) + ["--attention-variant", arm.variant] + _knob_flags(arm)
    scaffold = ["--micro-batch-size", "1", "--mock-data", "--train-iters", "1", "--lr", "0"]
    if not _given(argv, "--seq-length"):
        scaffold += ["--seq-length", "16"]
    if not _given(argv, "--tokenizer-type"):
        scaffold += ["--tokenizer-type", "NullTokenizer"]
        if not _given(argv, "--vocab-size"):
            scaffold += ["--vocab-size", "131072"]
    if _given(argv, "--hybrid-override-pattern") and not _given(argv, "--mamba-impl"):
        # megatron's MambaMixer cannot continue a chunked prefill (see _check_fits)
        scaffold += ["--mamba-impl", "pytorch"]
    if not _given(argv, "--max-position-embeddings"):
        scaffold += ["--max-position-embeddings", str(need_positions)]
    if cuda and not (_given(argv, "--fp16") or _given(argv, "--bf16")):
        scaffold += ["--bf16"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        args = arguments.parse_args(argv + scaffold, world_size=1, check_files=False,
                                    parser=_raising_parser())
    if args.tokenizer_type != "NullTokenizer":
        raise BenchError("--tokenizer-type: random-weight runs take the NullTokenizer "
                         "(--vocab-size sets the vocabulary); give --load for a trained model")
    return args


def _load_args(load: str, ckpt_step, arm: Arm, cuda: bool):
    """A checkpoint's trainer arguments with this arm's variant and knobs (one process, TP=1)."""
    from megatron_subq.convert.api import checkpoint_namespace  # noqa: PLC0415
    from megatron_subq.training.checkpointing import checkpoint_folder, saved_args  # noqa: PLC0415

    folder = checkpoint_folder(load, ckpt_step)
    if folder is None or not os.path.isdir(folder):
        raise BenchError(f"--load {load!r}: no checkpoint folder there (--ckpt-step "
                         f"{ckpt_step}; a checkpoint root holds latest_checkpointed_iteration.txt)")
    args, vocab = checkpoint_namespace(saved_args(folder), folder)
    saved_variant = args.attention_variant
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.context_parallel_size = args.expert_model_parallel_size = 1
    args.expert_tensor_parallel_size = None
    args.sequence_parallel = False
    args.use_cpu_initialization = not cuda
    args.recompute_granularity = args.recompute_method = args.recompute_num_layers = None
    args.attention_variant = arm.variant
    if getattr(args, "hybrid_override_pattern", None):
        args.mamba_impl = "pytorch"  # the same weights; megatron's cannot chunk a prefill
    fields = {f.name for f in _config_fields()}
    for key, value in arm.knobs.items():
        if key not in fields or not hasattr(args, key):
            raise BenchError(f"--variants {arm.label}: unknown knob {key!r}")
        old = getattr(args, key)
        try:
            setattr(args, key, value.lower() == "true" if isinstance(old, bool)
                    else type(old)(value) if old is not None else value)
        except ValueError:
            raise BenchError(f"--variants {arm.label}: knob {key}={value!r} is invalid: allowed "
                             f"a {type(old).__name__}") from None
    if cuda and not args.fp16:
        args.bf16 = True
    if not cuda:
        args.bf16 = args.fp16 = False
    from megatron_subq.training.checkpointing import NON_MODEL_KNOBS  # noqa: PLC0415

    args._changed = saved_variant != arm.variant or any(k not in NON_MODEL_KNOBS
                                                        for k in arm.knobs)
    return args, vocab


def _config_fields():
    from megatron_subq.config import SubqTransformerConfig  # noqa: PLC0415

    return dataclasses.fields(SubqTransformerConfig)


def _build_config(args):
    from megatron_subq.training.trainer import build_config  # noqa: PLC0415

    args._parser = _raising_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_config(args)
    except SystemExit:
        raise BenchError(err.getvalue().strip().splitlines()[-1]) from None


@dataclasses.dataclass
class Plan:
    contexts: List[int]
    arms: List[Arm]
    baseline: Optional[str]
    chunk: Optional[int]
    steps: int
    warmup: int
    layer_steps: int
    batch: int
    cuda: bool
    seed: int
    verify_upto: int
    profile: bool
    json: Optional[str]
    load: Optional[str]
    ckpt_step: Optional[int]
    decode_graph: str = "off"


def plan(argv: Optional[List[str]] = None) -> Plan:
    """Every argument checked, every arm's trainer arguments and config built; nothing on the
    device yet. Raises BenchError naming the flag."""
    import torch  # noqa: PLC0415

    from megatron_subq.training.tokenizer import padded_vocab_size  # noqa: PLC0415

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        own, model_argv = argv[:i], argv[i + 1:]
    else:
        own, model_argv = argv, []
    ns, rest = _parser().parse_known_args(own)
    model_argv = rest + model_argv
    contexts = [_int(c, "--contexts", 1) for c in str(ns.contexts).split(",") if c.strip()]
    if not contexts:
        raise BenchError("--contexts is empty: allowed positive integers, comma separated")
    chunk = None if str(ns.prefill_chunk).lower() == "none" else _int(ns.prefill_chunk,
                                                                          "--prefill-chunk", 1)
    steps = _int(ns.decode_steps, "--decode-steps", 1)
    warmup = _int(ns.warmup_steps, "--warmup-steps", 0)
    layer_steps = _int(ns.layer_steps, "--layer-steps", 0)
    batch = _int(ns.batch_size, "--batch-size", 1)
    seed = _int(ns.seed, "--seed", 0)
    verify_upto = _int(ns.verify_upto, "--verify-upto", 0)
    ckpt_step = None if ns.ckpt_step is None else _int(ns.ckpt_step, "--ckpt-step", 0)
    if ns.device not in ("auto", "cuda", "cpu"):
        raise BenchError(f"--device {ns.device!r} is invalid: allowed auto, cuda, cpu")
    has_cuda = torch.cuda.is_available()
    if ns.device == "cuda" and not has_cuda:
        raise BenchError("--device cuda: no CUDA device here; allowed on this machine: auto, cpu "
                         "(fp32, tiny shapes)")
    if ns.device == "cpu" and has_cuda:
        raise BenchError("--device cpu: this machine has CUDA and megatron would place the "
                         "model on it; allowed here: auto, cuda")
    cuda = has_cuda
    if not cuda:
        for flag in ("--bf16", "--fp16", "--moe-grouped-gemm"):
            if _given(model_argv, flag):
                raise BenchError(f"{flag}: needs a GPU (this machine has no CUDA); on the CPU the "
                                 "model runs in fp32")
        if ns.load is None and "--mamba-impl" in model_argv and \
                model_argv[model_argv.index("--mamba-impl") + 1:][:1] == ["megatron"]:
            raise BenchError("--mamba-impl megatron: needs a GPU (mamba_ssm's Triton kernels); "
                             "allowed on the CPU: auto, pytorch")
    if ns.load is not None and model_argv:
        raise BenchError(f"--load: the model comes from the checkpoint; model flags "
                         f"{' '.join(model_argv[:4])} ... are not allowed with it (knobs go in "
                         "--variants)")
    arms = apply_decode_graph(parse_arms(ns.variants), ns.decode_cuda_graph)
    labels = [a.label for a in arms]
    baseline = ns.baseline
    if baseline is not None and baseline not in labels:
        raise BenchError(f"--baseline {baseline!r}: no such arm; allowed: {', '.join(labels)}")
    if baseline is None:
        baseline = next((a.label for a in arms if a.variant == "standard" and not a.knobs), None)
    if ns.profile and not cuda:
        raise BenchError("--profile: times CUDA kernels and needs a GPU (this machine has none)")
    need = max(contexts) + warmup + steps + layer_steps + PROFILE_STEPS * ns.profile + 1
    for arm in arms:
        if ns.load is not None:
            arm.args, arm.vocab = _load_args(ns.load, ckpt_step, arm, cuda)
        else:
            try:
                arm.args = _trainer_args(model_argv, arm, need, cuda)
            except BenchError as e:
                raise BenchError(f"--variants {arm.label}: {e}" if arm.knobs else str(e)) \
                    from None
            arm.vocab = padded_vocab_size(arm.args.vocab_size,
                                          arm.args.make_vocab_size_divisible_by or 1,
                                          arm.args.tensor_model_parallel_size)
        arm.config = _build_config(arm.args)
        if arm.variant not in arm.config.layer_variants:
            raise BenchError(f"--variants {arm.label}: no layer of the model takes {arm.variant!r} "
                             f"(its --layer-pattern {arm.args.layer_pattern!r} names the layers' "
                             "variants itself)")
        _check_fits(arm, contexts, need, batch, chunk, cuda)
    if ns.json:
        folder = os.path.dirname(os.path.abspath(ns.json))
        if not os.path.isdir(folder):
            raise BenchError(f"--json {ns.json}: folder {folder} does not exist")
    return Plan(contexts, arms, baseline, chunk, steps, warmup, layer_steps, batch, cuda, seed,
                verify_upto, ns.profile, ns.json, ns.load, ckpt_step, ns.decode_cuda_graph)


GRAPH_KNOB = "superlinear_decode_graph"
DECODE_GRAPH_MODES = ("off", "on", "both")


def apply_decode_graph(arms: List[Arm], mode: str) -> List[Arm]:
    """``--decode-cuda-graph``: 'off' leaves the arms; 'on' sets ``superlinear_decode_graph``
    on every superlinear arm that does not set it itself; 'both' adds, after each such arm, its
    captured twin labelled LABEL-graph."""
    if mode not in DECODE_GRAPH_MODES:
        raise BenchError(f"--decode-cuda-graph {mode!r} is invalid: allowed "
                         + ", ".join(DECODE_GRAPH_MODES))
    if mode == "off":
        return arms
    targets = {id(a) for a in arms if a.variant == "superlinear" and GRAPH_KNOB not in a.knobs}
    if not targets:
        raise BenchError(f"--decode-cuda-graph {mode}: no arm of variant 'superlinear' without "
                         f"its own {GRAPH_KNOB} knob (the captured step is superlinear's); "
                         "allowed: off, or a superlinear arm in --variants")
    out: List[Arm] = []
    labels = {a.label for a in arms}
    for arm in arms:
        if id(arm) not in targets:
            out.append(arm)
        elif mode == "on":
            out.append(dataclasses.replace(arm, knobs={**arm.knobs, GRAPH_KNOB: "true"}))
        else:
            twin = arm.label + "-graph"
            if twin in labels:
                raise BenchError(f"--decode-cuda-graph both: the captured twin of arm "
                                 f"{arm.label!r} would be labelled {twin!r}, which --variants "
                                 "already uses; rename that arm")
            out += [arm, dataclasses.replace(arm, label=twin,
                                             knobs={**arm.knobs, GRAPH_KNOB: "true"})]
    return out


def _check_fits(arm: Arm, contexts: List[int], need: int, batch: int, chunk, cuda: bool):
    """The longest context (plus the decode steps) against the model's positions and the
    variant's cache/kernels."""
    from megatron_subq.variants import VARIANTS  # noqa: PLC0415

    args, config = arm.args, arm.config
    longest = max(contexts)
    if args.position_embedding_type == "learned_absolute" and \
            need > args.max_position_embeddings:
        raise BenchError(f"--contexts {longest}: with the decode steps {need} positions, more "
                         f"than the model's learned position table (--max-position-embeddings "
                         f"{args.max_position_embeddings}); allowed contexts up to "
                         f"{args.max_position_embeddings - (need - longest)}")
    if config.is_hybrid and "M" in (config.hybrid_override_pattern or ""):
        from megatron_subq.ssm import SubqMambaMixer, mamba_mixer_class  # noqa: PLC0415

        mixer = mamba_mixer_class(config, getattr(config, "mamba_impl", None))
        if mixer is not SubqMambaMixer and chunk is not None and longest > chunk:
            raise BenchError(
                f"--mamba-impl {getattr(config, 'mamba_impl', None)}: megatron's MambaMixer "
                "cannot continue a chunked prefill under megatron's static inference context "
                "(a chunk after the first goes to its one-token decode path, which asserts "
                "on more tokens); allowed: "
                "--mamba-impl pytorch (SubqMambaMixer, the default here), or --prefill-chunk "
                "none")
    for name in sorted({n for n in config.layer_variants if n is not None}):
        variant = VARIANTS[name]
        if variant.decode_cache != "kv" or name in ("standard", "sas"):
            continue  # SDPA (int64 offsets) or a constant-size state
        kernels = cuda and config.subq_impl != "reference"
        kv = batch * need * config.num_query_groups * config.kv_channels
        if kernels and kv > INT32_MAX:
            raise BenchError(
                f"--contexts {longest} / --batch-size {batch}: {name}'s KV cache of {need} "
                f"positions holds {kv:,} elements per tensor, more than its Triton kernels' "
                f"32-bit offsets address ({INT32_MAX:,}); allowed: a shorter context or a "
                "smaller batch")
        q_rows = batch * (chunk or longest) * config.num_attention_heads * config.kv_channels
        if kernels and q_rows > INT32_MAX:
            raise BenchError(f"--prefill-chunk {chunk or longest}: {name}'s prefill queries of "
                             f"one chunk hold {q_rows:,} elements, more than its kernels' 32-bit "
                             "offsets address; allowed: a smaller chunk")


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
class Clock:
    """CUDA events on a GPU (the device's time), perf_counter on the CPU."""

    def __init__(self, cuda: bool):
        import torch  # noqa: PLC0415

        self.torch, self.cuda = torch, cuda

    def mark(self):
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b)
        return (b - a) * 1e3

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()


def _superlinear_cores(model) -> list:
    from megatron_subq.variants.superlinear import SuperlinearCoreAttention  # noqa: PLC0415

    return [m for m in model.modules() if isinstance(m, SuperlinearCoreAttention)]


def _graph_counts(cores) -> tuple:
    """(one-token steps through a plan, CUDA graphs captured), summed over the cores."""
    return (sum(c.decode_plan_steps for c in cores), sum(c.decode_graph_captures for c in cores))


def _attention_modules(model):
    """(layer index, self-attention module, its core) of every attention layer."""
    out = []
    for i, layer in enumerate(model.decoder.layers):
        attn = getattr(layer, "self_attention", None)
        if attn is None or not hasattr(attn, "core_attention"):
            continue
        out.append((i + 1, attn, attn.core_attention))
    return out


@contextlib.contextmanager
def _module_timers(modules, clock: Clock, store: Dict[str, List]):
    """Marks around each module's forward (pre/post hooks), appended to ``store[name]``."""
    handles = []
    for name, module in modules:
        def pre(_m, _a, name=name):
            store.setdefault(name, []).append([clock.mark(), None])

        def post(_m, _a, _o, name=name):
            store[name][-1][1] = clock.mark()

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _build(plan_: Plan, arm: Arm):
    import torch  # noqa: PLC0415
    from megatron.core.tensor_parallel import random as tp_random  # noqa: PLC0415

    from megatron_subq.training.trainer import bare_model  # noqa: PLC0415

    torch.manual_seed(plan_.seed)
    tp_random.model_parallel_cuda_manual_seed(plan_.seed)
    model = bare_model(arm.args, arm.config, arm.vocab)
    if plan_.cuda:
        model = model.cuda()
    if plan_.load is not None:
        from megatron_subq.training.checkpointing import load_checkpoint  # noqa: PLC0415

        load_checkpoint(argparse.Namespace(
            load=plan_.load, ckpt_step=plan_.ckpt_step, exit_on_missing_checkpoint=True,
            finetune=True, load_optim=False, load_rng=False, use_distributed_optimizer=False,
            _model_changed=arm.args._changed), [model], None, None, log=lambda *a: None)
    return model.eval()


def _prompt(plan_: Plan, arm: Arm, length: int):
    import torch  # noqa: PLC0415

    vocab = min(arm.args.vocab_size or arm.vocab, arm.vocab)
    g = torch.Generator().manual_seed(plan_.seed + length)
    return torch.randint(0, vocab, (plan_.batch, length), generator=g)


def warm_up(plan_: Plan, arm: Arm, model) -> float:
    """Compile/autotune before anything is timed: a throwaway session prefills two chunks (the
    first chunk and a later one: kernels may specialise on the start position) of the shortest
    context and takes two steps. Returns its seconds."""
    from megatron_subq.inference import DecodeSession  # noqa: PLC0415

    length = min(min(plan_.contexts), 2 * (plan_.chunk or min(plan_.contexts)))
    t0 = time.perf_counter()
    session = DecodeSession(model, plan_.batch, length + 3)
    prompt = _prompt(plan_, arm, length).to(session.device)
    chunk = plan_.chunk or length
    for a in range(0, length, chunk):
        logits = session.prefill(prompt[:, a:a + chunk])
    token = logits.argmax(dim=-1)
    for _ in range(2):
        token = session.step(token).argmax(dim=-1)
    Clock(plan_.cuda).sync()
    del session
    return time.perf_counter() - t0


def run_arm(plan_: Plan, arm: Arm, model, length: int) -> dict:
    """Prefill ``length`` random tokens, then time the decode steps; one result row."""
    import torch  # noqa: PLC0415

    from megatron_subq.inference import DecodeSession, full_logits  # noqa: PLC0415

    clock = Clock(plan_.cuda)
    if plan_.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_mem = torch.cuda.memory_allocated() if plan_.cuda else 0
    prompt = _prompt(plan_, arm, length)
    total = length + plan_.warmup + plan_.steps + plan_.layer_steps + 1 \
        + PROFILE_STEPS * plan_.profile
    session = DecodeSession(model, plan_.batch, total)
    device_prompt = prompt.to(session.device)
    chunk = plan_.chunk or length
    marks = []
    clock.sync()
    t0 = time.perf_counter()
    logits = None
    for a in range(0, length, chunk):
        m0 = clock.mark()
        logits = session.prefill(device_prompt[:, a:a + chunk])
        marks.append((m0, clock.mark()))
    clock.sync()
    prefill_s = time.perf_counter() - t0
    chunk_ms = [clock.ms(a, b) for a, b in marks]
    first = logits.argmax(dim=-1)
    row = dict(arm=arm.label, variant=arm.variant, knobs=arm.knobs, context=length,
               batch=plan_.batch, prefill_chunk=chunk, prefill_s=prefill_s,
               prefill_tok_s=plan_.batch * length / prefill_s,
               prefill_chunk_ms_first=chunk_ms[0], prefill_chunk_ms_last=chunk_ms[-1],
               prefill_chunk_ms_median=statistics.median(chunk_ms),
               first_tokens=first.tolist())
    if length <= plan_.verify_upto:
        ref = full_logits(model, device_prompt)[:, -1]
        row["verify"] = dict(full_argmax=ref.argmax(dim=-1).tolist(),
                             match=bool(torch.equal(ref.argmax(dim=-1), first)),
                             max_abs_logit_diff=float((ref - logits).abs().max()))
    token = first
    cores = _superlinear_cores(model)
    counts0 = _graph_counts(cores)
    for _ in range(plan_.warmup):
        token = session.step(token).argmax(dim=-1)
    clock.sync()
    counts_timed = _graph_counts(cores)
    step_marks, host_ms = [], []
    t0 = time.perf_counter()
    for _ in range(plan_.steps):
        h0 = time.perf_counter()
        m0 = clock.mark()
        token = session.step(token).argmax(dim=-1)
        step_marks.append((m0, clock.mark()))
        host_ms.append((time.perf_counter() - h0) * 1e3)
    clock.sync()
    decode_s = time.perf_counter() - t0
    step_ms = [clock.ms(a, b) for a, b in step_marks]
    row.update(decode_steps=plan_.steps, decode_s=decode_s,
               decode_tok_s=plan_.batch * plan_.steps / decode_s,
               ms_per_step=decode_s * 1e3 / plan_.steps,
               step_ms_median=statistics.median(step_ms),
               host_enqueue_ms_median=statistics.median(host_ms))
    if plan_.layer_steps:
        store: Dict[str, List] = {}
        mods = []
        for n, attn, core in _attention_modules(model):
            mods += [(f"attention{n}", attn), (f"core{n}", core)]
        with _module_timers(mods, clock, store):
            for _ in range(plan_.layer_steps):
                token = session.step(token).argmax(dim=-1)
        clock.sync()
        per = {name: statistics.median(clock.ms(a, b) for a, b in marks_)
               for name, marks_ in store.items()}
        layers = sorted({int(k[len("attention"):]) for k in per if k.startswith("attention")})
        row["attention_layers"] = [dict(layer=n, layer_ms=per[f"attention{n}"],
                                        core_ms=per.get(f"core{n}")) for n in layers]
        row["attention_ms_per_step"] = sum(per[f"attention{n}"] for n in layers)
    counts = _graph_counts(cores)
    row.update(decode_cuda_graph=bool(getattr(arm.config, GRAPH_KNOB, False)),
               decode_plan_steps=counts[0] - counts0[0],
               decode_graph_captures=counts[1] - counts0[1],
               decode_graph_captures_timed=counts[1] - counts_timed[1])
    if plan_.profile:
        row["profile"] = _profile(session, token)
    if plan_.cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        row["model_gib"] = base_mem / 2**30
    del session, logits
    return row


def _profile(session, token, steps: int = PROFILE_STEPS, top: int = 12) -> List[dict]:
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            token = session.step(token).argmax(dim=-1)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        kind = getattr(e, "device_type", None)
        if kind is not None and "CUDA" not in str(kind):
            continue  # host-side ops: their kernels are listed themselves
        cuda_us = getattr(e, "self_device_time_total", None)
        if cuda_us is None:
            cuda_us = getattr(e, "self_cuda_time_total", 0)
        if cuda_us:
            rows.append(dict(name=e.key[:80], calls=e.count, ms_per_step=cuda_us / 1e3 / steps))
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows[:top]


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def add_ratios(rows: List[dict], baseline: Optional[str]) -> None:
    base = {r["context"]: r for r in rows if r["arm"] == baseline}
    for r in rows:
        b = base.get(r["context"])
        if b is None:
            continue
        r["decode_speedup_vs_baseline"] = r["decode_tok_s"] / b["decode_tok_s"]
        r["prefill_speedup_vs_baseline"] = r["prefill_tok_s"] / b["prefill_tok_s"]
        if r.get("attention_ms_per_step") and b.get("attention_ms_per_step"):
            r["attention_speedup_vs_baseline"] = (b["attention_ms_per_step"]
                                                  / r["attention_ms_per_step"])


def table(rows: List[dict], baseline: Optional[str]) -> str:
    lines = [f"| context | arm | prefill tok/s | decode tok/s | ms/step | host ms/step | "
             f"attention ms/step (layers; cores) | peak GiB | decode vs {baseline or '-'} | "
             f"prefill vs {baseline or '-'} |", "|" + "---|" * 10]
    for r in rows:
        layers = r.get("attention_layers") or []
        cores = [x["core_ms"] for x in layers if x.get("core_ms") is not None]
        attn = (f"{r['attention_ms_per_step']:.3f} ("
                + ", ".join(f"{x['layer_ms']:.3f}" for x in layers)
                + ("; cores " + ", ".join(f"{c:.3f}" for c in cores) if cores else "")
                + ")") if layers else "-"
        d = r.get("decode_speedup_vs_baseline")
        p = r.get("prefill_speedup_vs_baseline")
        cells = [str(r["context"]), r["arm"], f"{r['prefill_tok_s']:,.0f}",
                 f"{r['decode_tok_s']:,.1f}", f"{r['ms_per_step']:.2f}",
                 f"{r['host_enqueue_ms_median']:.2f}", attn,
                 f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-",
                 f"{d:.2f}x" if d is not None else "-", f"{p:.2f}x" if p is not None else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _meta(plan_: Plan) -> dict:
    import torch  # noqa: PLC0415

    a = plan_.arms[0]
    cfg = a.config
    mixer = None
    if cfg.is_hybrid:
        from megatron_subq.ssm import mamba_mixer_class  # noqa: PLC0415

        mixer = mamba_mixer_class(cfg, getattr(cfg, "mamba_impl", None)).__name__
    return dict(
        mamba_mixer=mixer,
        device=torch.cuda.get_device_name() if plan_.cuda else "cpu",
        torch=torch.__version__, dtype=str(cfg.params_dtype).replace("torch.", ""),
        host="hybrid" if cfg.is_hybrid else "gpt",
        pattern=getattr(cfg, "hybrid_override_pattern", None), num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size, heads=cfg.num_attention_heads,
        kv_heads=cfg.num_query_groups, kv_channels=cfg.kv_channels, vocab=a.vocab,
        load=plan_.load, contexts=plan_.contexts, batch=plan_.batch,
        prefill_chunk=plan_.chunk, decode_steps=plan_.steps, warmup_steps=plan_.warmup,
        layer_steps=plan_.layer_steps, baseline=plan_.baseline, cuda_graph=False,
        decode_cuda_graph=plan_.decode_graph,
        arms=[dict(label=x.label, variant=x.variant, knobs=x.knobs,
                   layer_variants=list(x.config.layer_variants)) for x in plan_.arms])


def _write(plan_: Plan, meta: dict, rows: List[dict]) -> None:
    if not plan_.json:
        return
    tmp = plan_.json + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    os.replace(tmp, plan_.json)


def main(argv: Optional[List[str]] = None) -> dict:
    try:
        plan_ = plan(argv)
    except BenchError as e:
        print(f"bench_decode.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import megatron_subq as subq  # noqa: PLC0415

    created = not dist.is_initialized()
    subq.init_single_process(plan_.seed)
    meta = _meta(plan_)
    print(f"bench_decode: {meta['host']} {meta['pattern'] or ''} {meta['num_layers']} layers, "
          f"hidden {meta['hidden_size']}, {meta['dtype']} on {meta['device']}; contexts "
          f"{plan_.contexts}, arms {[a.label for a in plan_.arms]}, batch {plan_.batch}",
          flush=True)
    rows: List[dict] = []
    try:
        for arm in plan_.arms:
            model = _build(plan_, arm)
            params = sum(p.numel() for p in model.parameters())
            with torch.no_grad():
                warm_s = warm_up(plan_, arm, model)
                for length in plan_.contexts:
                    row = run_arm(plan_, arm, model, length)
                    row.update(parameters=params, warmup_s=warm_s)
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "profile"}),
                          flush=True)
                    add_ratios(rows, plan_.baseline)
                    _write(plan_, meta, rows)
            del model
            gc.collect()
            if plan_.cuda:
                torch.cuda.empty_cache()
    finally:
        if created:
            subq.destroy_single_process()
    rows.sort(key=lambda r: (r["context"], [a.label for a in plan_.arms].index(r["arm"])))
    add_ratios(rows, plan_.baseline)
    _write(plan_, meta, rows)
    print()
    print(table(rows, plan_.baseline))
    for r in rows:
        for p in r.get("profile", []):
            print(f"  profile {r['context']} {r['arm']}: {p['ms_per_step']:.3f} ms/step "
                  f"x{p['calls']} {p['name']}")
    return {"meta": meta, "results": rows}


if __name__ == "__main__":
    main()
    sys.exit(0)
