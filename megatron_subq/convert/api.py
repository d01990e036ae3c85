"""Hugging Face <-> torch_dist checkpoint conversion: ``import_hf`` and ``export_hf``.

**Import** reads config.json (its family, ``families/``, turns it into the trainer's flags and
refuses what the project cannot represent, naming the field), checks every tensor the model
needs is present with the shape config.json implies (headers only), and only then builds the
host model at TP=1/PP=1 in this process with the trainer's own builders (``--attention-variant``
/ ``--layer-pattern`` / knobs choose each layer's attention, initialised as the variant defines),
overwrites every tensor that has a place with the HF one (bitwise when the dtypes agree), and
saves it with the trainer's checkpoint writer (iteration 0, no optimizer or RNG state). torch_dist
tensors are global, so the trainer loads the result at any TP/PP with ``--load``; the import's
TP/PP are checked (heads, groups, widths, vocabulary, layers divide) and written into
``model.yaml``. Everything is written into a temporary folder beside ``save`` and renamed at the
end: a failure leaves nothing in ``save``.

**Export** loads a checkpoint (``--ckpt-step`` or the tracker's) at TP=1/PP=1 and writes HF
safetensors shards + index + config.json that ``transformers`` loads without custom code; a
NemotronH model with Superlinear '*' slots is written for the remote code the project ships
(``convert/remote/``: its files copied in, ``auto_map``, ``trust_remote_code=True``); models with
any other non-``standard`` attention layer are refused, naming the layers.

Memory: HF tensors are read one at a time (memory-mapped); the host model is materialised once,
in the checkpoint's dtype, so the peak is about one model plus one tensor (import) or one model
plus one output shard (export).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from . import hf_io
from .families import Family, family_for_args, family_for_config

MODEL_YAML = "model.yaml"
HF_CONFIG = "hf_config.json"  # the imported config.json, kept for export
HF_FILES = "hf_files"  # the imported folder's tokenizer/generation files, kept for export


@dataclass
class ConversionSummary:
    """What a conversion did. Names are the target's (megatron names on import, HF names on
    export); ``flags`` are the trainer flags of the model (import)."""

    direction: str
    folder: str
    family: str
    copied: List[str] = field(default_factory=list)
    created: List[str] = field(default_factory=list)
    dropped: List[str] = field(default_factory=list)
    flags: Dict[str, object] = field(default_factory=dict)
    seconds: float = 0.0
    nbytes: int = 0

    def text(self) -> str:
        lines = [f"{self.direction} ({self.family}) -> {self.folder}: {len(self.copied)} "
                 f"tensors copied, {len(self.created)} created new, {len(self.dropped)} dropped; "
                 f"{self.nbytes / 1e9:.3f} GB in {self.seconds:.1f} s"]
        for what, names in (("copied", self.copied), ("created", self.created),
                            ("dropped", self.dropped)):
            for pattern in collapse(names):
                lines.append(f"  {what:8s} {pattern}")
        return "\n".join(lines)


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def collapse(names: List[str]) -> List[str]:
    """Names with their layer index folded: ``decoder.layers.{0-31}.mlp.linear_fc1.weight``."""
    groups: Dict[str, List[int]] = {}
    for name in names:
        m = _LAYER.search(name)
        key = _LAYER.sub(".layers.{}.", name) if m else name
        groups.setdefault(key, []).append(int(m.group(1)) if m else -1)
    out = []
    for key, layers in groups.items():
        if "{}" not in key:
            out.append(key)
            continue
        layers = sorted(layers)
        spans, start = [], layers[0]
        for a, b in zip(layers, layers[1:] + [None]):
            if b != a + 1:
                spans.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        out.append(key.replace("{}", "{" + ",".join(spans) + "}"))
    return out


def _progress(enabled: bool, desc: str):
    from tqdm.auto import tqdm  # noqa: PLC0415

    return lambda total: tqdm(total=total, desc=desc, unit="tensor", disable=not enabled)


# ------------------------------------------------------------------------------------------------
# the trainer's arguments and a one-process megatron
# ------------------------------------------------------------------------------------------------
def _parse_trainer(data: dict, vocab: int, world_size: int) -> argparse.Namespace:
    """The trainer's validated arguments for the model flags ``data`` (the trainer's own checks:
    a bad flag is a ValueError with the trainer's message, naming the flag)."""
    from ..training import arguments  # noqa: PLC0415

    parser = arguments.build_parser()
    seq = str(data.get("tensor_model_parallel_size", 1))  # divisible by TP (sequence parallel)
    scaffold = ["--seq-length", seq, "--micro-batch-size", "1", "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
                "--train-iters", "1", "--lr", "0"]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            argv = arguments.config_to_argv(parser, data, "the converted model's flags")
            return arguments.parse_args(argv + scaffold, world_size=world_size)
    except SystemExit as e:
        message = err.getvalue().strip().splitlines()
        raise ValueError(message[-1].split("error: ", 1)[-1] if message else str(e)) from None


def _build_config(args):
    from ..training.trainer import build_config  # noqa: PLC0415

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_config(args)
    except SystemExit as e:
        message = err.getvalue().strip().splitlines()
        raise ValueError(message[-1].split("error: ", 1)[-1] if message else str(e)) from None


@contextlib.contextmanager
def one_process(seed: int):
    """A one-process gloo group and megatron's parallel state at TP=1/PP=1 (the CPU fallbacks
    without CUDA), seeded as the trainer seeds a TP=1 run; torn down afterwards if made here."""
    import torch.distributed as dist  # noqa: PLC0415
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.tensor_parallel import random as tp_random  # noqa: PLC0415

    from ..cpu import install_cpu_fallbacks  # noqa: PLC0415

    created_group = made_state = False
    store = None
    if not dist.is_initialized():
        store = tempfile.mkdtemp(prefix="subq-convert-")
        dist.init_process_group("gloo", init_method=f"file://{store}/rendezvous", rank=0,
                                world_size=1)
        created_group = True
    elif dist.get_world_size() != 1:
        raise RuntimeError("checkpoint conversion runs in one process; call it outside a "
                           f"{dist.get_world_size()}-process group")
    if not torch.cuda.is_available():
        install_cpu_fallbacks()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        made_state = True
    torch.manual_seed(seed)
    tp_random.model_parallel_cuda_manual_seed(seed)
    try:
        yield
    finally:
        if made_state:
            parallel_state.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()
            shutil.rmtree(store, ignore_errors=True)


def host_model(args, config, vocab: int):
    """This pipeline stage's bare host model of the trainer arguments ``args``: the one place
    the converter builds a model (the GPT host, or the hybrid host when
    ``--hybrid-override-pattern`` is set)."""
    from ..training.trainer import bare_model  # noqa: PLC0415

    return bare_model(args, config, vocab)


def _one_rank_copy(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` for building the whole model in one process (TP=1, PP=1, CPU init)."""
    one = argparse.Namespace(**vars(args))
    one.tensor_model_parallel_size = one.pipeline_model_parallel_size = 1
    one.sequence_parallel = False
    one.decoder_first_pipeline_num_layers = one.decoder_last_pipeline_num_layers = None
    one.use_cpu_initialization = True
    one.recompute_granularity = one.recompute_method = one.recompute_num_layers = None
    return one


def _check_target(path: str, flag: str) -> None:
    """FileExistsError unless ``path`` is new or an empty folder."""
    path = os.path.abspath(path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise FileExistsError(f"{flag} {path} exists and is not empty; allowed: a new or empty "
                              "folder (nothing is overwritten)")


def _fresh_target(path: str, flag: str) -> str:
    """A temporary folder beside ``path`` (refused when ``path`` holds anything)."""
    _check_target(path, flag)
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.partial-", dir=parent)


def _commit(tmp: str, path: str) -> None:
    path = os.path.abspath(path)
    if os.path.isdir(path):
        os.rmdir(path)  # empty (checked before)
    os.rename(tmp, path)


# ------------------------------------------------------------------------------------------------
# import
# ------------------------------------------------------------------------------------------------
def model_flags(hf_config: dict, family: Optional[Family] = None) -> dict:
    """The trainer flags ({dest: value}) of the model an HF config.json describes."""
    family = family or family_for_config(hf_config)
    return family.trainer_flags(hf_config)


def _hf_param_maps(args, config, layers: List[Optional[str]], reader,
                   prefix: str = "model.layers.{i}.") -> List:
    """The variants' own ``hf_param_map`` entries the HF folder holds: names relative to layer
    i's attention slot (``decoder.layers.i.self_attention.``) and to the HF layer (the family's
    ``hf_layer_prefix``); layers without an attention slot (None: a hybrid's M/-/E) have none.
    Every variant's entries are looked up at every attention layer: those of a variant the layer
    does not use have no target there and are dropped by the import (e.g. the ``qs_proj`` of a
    Superlinear folder imported as standard), not refused as tensors without a place."""
    from ..variants import VARIANTS  # noqa: PLC0415
    from .families.base import TensorMap  # noqa: PLC0415

    entries = {}
    for variant in VARIANTS.values():
        for meg, hf in (variant.hf_param_map(config) or {}).items():
            entries.setdefault(hf, meg)
    maps = []
    for i, name in enumerate(layers):
        if name is None:
            continue
        for hf, meg in entries.items():
            hf_name = prefix.format(i=i) + hf
            if hf_name in reader.weight_map:
                maps.append(TensorMap(f"decoder.layers.{i}.self_attention.{meg}", (hf_name,),
                                      (reader.shape(hf_name),), layer=i, part="attention"))
    return maps


# tensors an HF folder may hold that carry no weights of the model
_IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def import_hf(hf: str, save: str, *, tensor_model_parallel_size: int = 1,
              pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
              attention_variant: Optional[str] = None, layer_pattern=None,
              knobs: Optional[dict] = None, seed: int = 1234, progress: bool = True,
              log=print) -> ConversionSummary:
    """Convert the HF folder ``hf`` into a torch_dist checkpoint in ``save`` (new or empty).

    ``attention_variant`` / ``layer_pattern`` / ``knobs`` ({config field: value}) choose the
    attention of each layer (default: standard everywhere, an exact copy); tensors that keep a
    place are copied, the variant's own parameters keep the variant's initialisation (seeded by
    ``seed`` as the trainer seeds a run), the HF tensors that lose their place are dropped. The
    parallel sizes are checked and written into ``save/model.yaml`` (the checkpoint itself loads
    at any). Raises ValueError / FileNotFoundError naming the field, flag or file, before
    anything is written."""
    start = time.perf_counter()
    _check_target(save, "--save")
    cfg = hf_io.read_config(hf)
    family = family_for_config(cfg, os.path.join(hf, "config.json"))
    flags = dict(family.trainer_flags(cfg))
    ep = expert_model_parallel_size
    if ep != 1 and not flags.get("num_experts"):
        raise ValueError(f"--expert-model-parallel-size={ep} is invalid for a {family.name} "
                         "model without experts: allowed 1")
    vocab = cfg["vocab_size"]
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    flags.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if ep != 1:
        flags["expert_model_parallel_size"] = ep
    if tp > 1 and flags.get("num_experts"):  # megatron's MoE layer needs it under TP
        flags["sequence_parallel"] = True
    if attention_variant is not None:
        flags["attention_variant"] = attention_variant
    if layer_pattern is not None:
        flags["layer_pattern"] = (",".join(layer_pattern) if isinstance(layer_pattern, list)
                                  else layer_pattern)
    flags.update(knobs or {})
    args = _parse_trainer(flags, vocab, world_size=tp * pp * ep)
    for what, size in (("config.json vocab_size", vocab),
                       ("config.json intermediate_size", args.ffn_hidden_size)):
        if size % tp:
            raise ValueError(f"--tensor-model-parallel-size={tp} does not divide {what}={size}; "
                             f"allowed: a TP size that divides it")
    one = _one_rank_copy(args)
    config = _build_config(one)  # the variants' own checks, before reading any tensor
    layers = list(config.layer_variants)
    from ..slots import attention_slot_spec  # noqa: PLC0415

    for n in range(1, config.num_layers + 1):  # what the slots refuse (q/k norms), up front
        if layers[n - 1] is not None:  # a hybrid's M/-/E layers have no attention slot
            attention_slot_spec(config, n)

    reader = hf_io.HFReader(hf)
    try:
        maps = family.tensor_maps(one, vocab) + _hf_param_maps(
            one, config, layers, reader, family.hf_layer_prefix)
        _check_hf_tensors(reader, maps, hf, family)
        tmp = _fresh_target(save, "--save")
        try:
            summary = _import_into(tmp, reader, maps, family, one, config, vocab, seed,
                                   progress, log)
            saved_flags = _write_model_yaml(tmp, flags, args, save, family.script)
            shutil.copyfile(os.path.join(hf, "config.json"), os.path.join(tmp, HF_CONFIG))
            side = [n for n in hf_io.SIDE_FILES if os.path.isfile(os.path.join(hf, n))]
            if side:
                os.makedirs(os.path.join(tmp, HF_FILES))
                for n in side:
                    shutil.copyfile(os.path.join(hf, n), os.path.join(tmp, HF_FILES, n))
            _commit(tmp, save)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        summary.nbytes = reader.nbytes()
    finally:
        reader.close()
    summary.folder, summary.flags = os.path.abspath(save), saved_flags
    summary.seconds = time.perf_counter() - start
    log(summary.text())
    log(f"trainer flags of this model (in {os.path.join(save, MODEL_YAML)}): "
        + " ".join(_as_cli(saved_flags)))
    log(f"train it with: {family.script} --config {os.path.join(save, MODEL_YAML)} "
        f"--load {os.path.abspath(save)} --save NEW_FOLDER [data, tokenizer, schedule flags]")
    return summary


def _check_hf_tensors(reader, maps, hf: str, family: Family) -> None:
    """Every HF tensor the maps need is there with the shape config.json implies; no tensor is
    left without a place unless it is known to carry nothing (errors name file and tensor)."""
    needed = set()
    for tm in maps:
        for name, shape in zip(tm.hf, tm.hf_shapes):
            needed.add(name)
            if name not in reader.weight_map:
                raise ValueError(f"--hf {hf}: tensor {name} is missing (a {family.name} model "
                                 f"of this config.json needs it for {tm.megatron})")
            have = reader.shape(name)
            if tuple(have) != tuple(shape):
                raise ValueError(
                    f"{reader.file_of(name)}: tensor {name} has shape {list(have)}, but "
                    f"config.json (hidden_size, intermediate_size, num_attention_heads, "
                    f"num_key_value_heads, head_dim, vocab_size) implies {list(shape)}")
    extra = [n for n in reader.keys() if n not in needed and not _IGNORED_HF.search(n)
             and n != "lm_head.weight"]
    if extra:
        raise ValueError(f"--hf {hf}: tensors with no place in a {family.name} model of this "
                         f"config.json: {', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")


def _import_into(tmp, reader, maps, family, args, config, vocab, seed, progress, log):
    from ..training.checkpointing import save_checkpoint  # noqa: PLC0415

    summary = ConversionSummary("import", tmp, family.name)
    with one_process(seed):
        model = host_model(args, config, vocab)
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())  # e.g. the MoE router's expert bias
        used = set()
        bar = _progress(progress, "import")(len(maps))
        for tm in maps:
            bar.update(1)
            target = params.get(tm.megatron, buffers.get(tm.megatron))
            if target is None:  # the variant's slot has no such tensor
                summary.dropped.extend(tm.hf)
                continue
            value = tm.to_megatron([reader.get(n) for n in tm.hf])
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"{tm.megatron}: the HF tensors {', '.join(tm.hf)} make shape "
                                 f"{list(value.shape)}, the model built with these flags has "
                                 f"{list(target.shape)}")
            with torch.no_grad():
                target.copy_(value)
            used.add(tm.megatron)
            summary.copied.append(tm.megatron)
        bar.close()
        summary.created = [n for n in params if n not in used]
        tied = not args.untie_embeddings_and_output_weights
        if "lm_head.weight" in reader.weight_map and tied:
            summary.dropped.append("lm_head.weight")
        summary.dropped += [n for n in reader.keys() if _IGNORED_HF.search(n)]
        save_args = _checkpoint_args(args, vocab, tmp)
        save_checkpoint(save_args, 0, [model], None, None, 0, log=lambda *a: None)
    return summary


def _checkpoint_args(args, vocab: int, root: str) -> argparse.Namespace:
    """What the checkpoint stores as its arguments: the model-defining ones (the trainer compares
    them on ``--load``), the padded vocabulary, and the layout it was written at (TP=1, PP=1).
    The tokenizer's size is not stored: any tokenizer with at most ``vocab`` tokens fits."""
    from ..training.checkpointing import layer_variants, model_args  # noqa: PLC0415

    keep = set(model_args(layer_variants(args))) | {
        "attention_variant", "layer_pattern", "group_query_attention",
        "make_vocab_size_divisible_by", "bf16", "fp16", "seed", "use_distributed_optimizer",
        # the hybrid host's layout and router dtype (the trainer stores every argument)
        "hybrid_override_pattern", "is_hybrid_model", "moe_router_dtype"}
    keep.discard("tokenizer_vocab_size")
    values = {k: getattr(args, k) for k in keep if hasattr(args, k)}
    values.update(padded_vocab_size=vocab, tensor_model_parallel_size=1,
                  pipeline_model_parallel_size=1, save=root, save_optim=False, save_rng=False,
                  ckpt_format="torch_dist", dist_ckpt_optim_fully_reshardable=True)
    return argparse.Namespace(**values)


def _write_model_yaml(tmp: str, flags: dict, args, save: str,
                      script: str = "examples/pretrain_gpt.py") -> dict:
    """``model.yaml``: the trainer flags that rebuild this model (``--config`` reads it)."""
    import yaml  # noqa: PLC0415

    out = {}
    for key, value in flags.items():
        out[key.replace("_", "-")] = value
    out["attention-variant"] = args.attention_variant
    if args.layer_pattern is not None:
        out["layer-pattern"] = args.layer_pattern
    with open(os.path.join(tmp, MODEL_YAML), "w", encoding="utf-8") as f:
        f.write(f"# trainer flags of the model converted into {os.path.abspath(save)}\n"
                f"# {script} --config {MODEL_YAML} --load "
                f"{os.path.abspath(save)} ...\n")
        yaml.safe_dump(out, f, sort_keys=False)
    return out


def _as_cli(flags: dict) -> List[str]:
    out = []
    for key, value in flags.items():
        if isinstance(value, bool):
            out.append(f"--{key}" if value else f"--no-{key}")
        else:
            out += [f"--{key}", str(value)]
    return out


# ------------------------------------------------------------------------------------------------
# export
# ------------------------------------------------------------------------------------------------
def export_hf(load: str, hf_out: str, *, ckpt_step: Optional[int] = None,
              hf_config: Optional[str] = None, max_shard_size="5GB", progress: bool = True,
              log=print) -> ConversionSummary:
    """Write the checkpoint in ``load`` (the tracker's iteration, or ``ckpt_step``) as an HF
    folder ``hf_out`` (new or empty): safetensors shards of at most ``max_shard_size`` (+ index),
    config.json, and the tokenizer files an import kept (in ``load``, else in the import folder
    ``hf_config`` names). The architecture is the one of
    ``hf_config`` (a config.json; default: the one an import stored in ``load``), else inferred
    from the model's flags. A NemotronH model with Superlinear '*' slots is written for the
    remote code the project ships (``convert/remote``: files copied in, ``auto_map``; load with
    ``trust_remote_code=True``); a layer of any variant its family cannot write (``Family.
    hf_variants``) is refused, naming the layers. Errors name the flag, file or field, before
    anything is written."""
    from ..training.checkpointing import (  # noqa: PLC0415
        checkpoint_folder,
        layer_variants,
        saved_args,
    )

    start = time.perf_counter()
    max_bytes = hf_io.parse_size(max_shard_size)
    _check_target(hf_out, "--hf-out")
    folder = checkpoint_folder(load, ckpt_step)
    if folder is None or not os.path.isdir(folder):
        flag = "--ckpt-step" if ckpt_step is not None else "--load"
        raise FileNotFoundError(f"{flag}: no checkpoint folder "
                                f"{folder or os.path.join(load, '<tracker>')} (--load names the "
                                "folder holding latest_checkpointed_iteration.txt and iter_*)")
    saved = saved_args(folder)
    layers = layer_variants(saved) or []
    if not layers:
        raise ValueError(f"--load {load}: the checkpoint's attention layers do not resolve "
                         "(--attention-variant / --layer-pattern / --num-layers)")
    args, vocab = checkpoint_namespace(saved, folder)
    args = _one_rank_copy(args)
    cfg_path = hf_config or os.path.join(load, HF_CONFIG)
    if os.path.isdir(cfg_path):  # an HF folder, or a folder an import wrote
        names = [n for n in ("config.json", HF_CONFIG)
                 if os.path.isfile(os.path.join(cfg_path, n))]
        cfg_path = os.path.join(cfg_path, names[0] if names else "config.json")
    base = None
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            base = json.load(f)
    elif hf_config is not None:
        raise FileNotFoundError(f"--hf-config {hf_config}: no such file")
    family = family_for_config(base, cfg_path) if base else family_for_args(args)
    if family is None:
        raise ValueError(f"--load {load}: no Hugging Face family has --add-qkv-bias "
                         f"{args.add_qkv_bias} with --qk-layernorm {args.qk_layernorm}; give "
                         "--hf-config")
    odd = [f"{i + 1} ({v})" for i, v in enumerate(layers)
           if v is not None and v not in family.hf_variants]
    if odd:
        allowed = " or ".join(repr(v) for v in family.hf_variants)
        raise ValueError(f"--load {load}: only models whose every attention layer is {allowed} "
                         f"export to Hugging Face as {family.name}; layer(s) " + ", ".join(odd)
                         + " are not")
    cfg = family.hf_config(args, vocab, base)
    maps = family.tensor_maps(args, vocab)
    config = _build_config(args)
    tmp = _fresh_target(hf_out, "--hf-out")
    try:
        with one_process(int(saved.get("seed", 1234))):
            model = host_model(args, config, vocab)
            _load_weights(model, load, ckpt_step)
            state = {k: v for k, v in model.state_dict().items()
                     if not k.endswith("_extra_state")}
            maps = maps + _variant_maps(config, layers, state, family.hf_layer_prefix)
            known = {tm.megatron for tm in maps}
            unknown = sorted(set(state) - known)
            if unknown:
                raise ValueError(f"--load {load}: tensors with no Hugging Face name in a "
                                 f"{family.name} model: {', '.join(unknown[:8])}")
            planned = []
            for tm in maps:
                t = state[tm.megatron]
                for j, (name, shape) in enumerate(zip(tm.hf, tm.hf_shapes)):
                    planned.append(hf_io.PlannedTensor(
                        name, tuple(shape), t.dtype,
                        (lambda tm=tm, t=t, j=j: tm.to_hf(t)[j])))
            files = hf_io.write_safetensors(planned, tmp, max_bytes,
                                            progress=_progress(progress, "export"))
        code = _write_hf_config(tmp, cfg, family)
        side = os.path.join(load, HF_FILES)
        if not os.path.isdir(side) and hf_config is not None:
            # a run that trained from an import keeps no tokenizer: take the import's
            ref = hf_config if os.path.isdir(hf_config) else os.path.dirname(hf_config)
            side = os.path.join(ref, HF_FILES)
        if os.path.isdir(side):
            for n in os.listdir(side):
                shutil.copyfile(os.path.join(side, n), os.path.join(tmp, n))
        _commit(tmp, hf_out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    summary = ConversionSummary("export", os.path.abspath(hf_out), family.name,
                                copied=[p.name for p in planned])
    summary.nbytes = sum(p.nbytes for p in planned)
    summary.seconds = time.perf_counter() - start
    log(summary.text())
    log(f"wrote {', '.join(files + code)} and config.json to {os.path.abspath(hf_out)}")
    return summary


def _variant_maps(config, layers: List[Optional[str]], state: dict, prefix: str) -> List:
    """Export maps of the variants' own tensors (``Variant.hf_param_map``: e.g. Superlinear's
    ``linear_qs`` -> ``mixer.qs_proj``), copied as they are, for the tensors the model has."""
    from ..variants import VARIANTS  # noqa: PLC0415
    from .families.base import copy  # noqa: PLC0415

    maps = []
    for i, name in enumerate(layers):
        if name is None:
            continue
        for meg, hf in (VARIANTS[name].hf_param_map(config) or {}).items():
            full = f"decoder.layers.{i}.self_attention.{meg}"
            if full in state:
                maps.append(copy(full, prefix.format(i=i) + hf, tuple(state[full].shape), i,
                                 "attention"))
    return maps


def _write_hf_config(folder: str, cfg: dict, family: Family) -> List[str]:
    """config.json through transformers' own config class when installed (so the file is what
    that version writes and reads), else as given. A ``model_type`` the project ships remote
    code for (``convert/remote``: NemotronH with Superlinear layers) is written through that
    config class, and its modeling files are copied beside it; returns their names."""
    from .remote import REMOTE_CODE, config_class, copy_code  # noqa: PLC0415

    model_type = cfg.get("model_type", family.model_type)
    try:
        from transformers import AutoConfig  # noqa: PLC0415
    except ImportError:
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
    else:
        values = {k: _json_floats(v) for k, v in cfg.items() if k != "model_type"}
        if model_type in REMOTE_CODE:
            config_class(model_type)(**values).save_pretrained(folder)
        else:
            AutoConfig.for_model(model_type, **values).save_pretrained(folder)
    return copy_code(model_type, folder) if model_type in REMOTE_CODE else []


def _json_floats(value):
    """``value`` with transformers' JSON encoding of non-finite floats (``{"__float__":
    "Infinity"}``, e.g. NemotronH's ``time_step_limit``) decoded, so the config class accepts it."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _json_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_floats(v) for v in value]
    return value


def checkpoint_namespace(saved: dict, folder: str = "the checkpoint"):
    """(trainer arguments, padded vocabulary) of a checkpoint's stored arguments ``saved``: the
    trainer's defaults overlaid with them (flags a checkpoint predates keep their defaults)."""
    from ..training import arguments  # noqa: PLC0415

    if "padded_vocab_size" not in saved:
        raise ValueError(f"{folder}: the checkpoint stores no padded_vocab_size (saved by an "
                         "older trainer); its vocabulary cannot be known")
    args = arguments.build_parser().parse_args([])
    for k, v in saved.items():
        setattr(args, k, v)
    if args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads
    return args, int(saved["padded_vocab_size"])


def _load_weights(model, load: str, ckpt_step: Optional[int]) -> None:
    from ..training.checkpointing import load_checkpoint  # noqa: PLC0415

    load_args = argparse.Namespace(
        load=load, ckpt_step=ckpt_step, exit_on_missing_checkpoint=True, finetune=True,
        load_optim=False, load_rng=False, use_distributed_optimizer=False, _model_changed=False)
    load_checkpoint(load_args, [model], None, None, log=lambda *a: None)


def load_converted_model(load: str, ckpt_step: Optional[int] = None, **overrides):
    """This pipeline stage's host model of the checkpoint in ``load``, built under the current
    parallel state (any TP/PP: torch_dist reshards) with its weights loaded; ``overrides`` set
    trainer arguments (e.g. ``bf16=True``). Returns (model, args). For checks and evaluation
    scripts; megatron's parallel state must be initialised."""
    from megatron.core import parallel_state  # noqa: PLC0415

    from ..training.checkpointing import checkpoint_folder, saved_args  # noqa: PLC0415

    folder = checkpoint_folder(load, ckpt_step)
    if folder is None or not os.path.isdir(folder):
        raise FileNotFoundError(f"--load {load}: no checkpoint folder (ckpt_step={ckpt_step})")
    args, vocab = checkpoint_namespace(saved_args(folder), folder)
    args.tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    args.pipeline_model_parallel_size = parallel_state.get_pipeline_model_parallel_world_size()
    args.use_cpu_initialization = args.use_cpu_initialization or not torch.cuda.is_available()
    args.sequence_parallel = False
    for k, v in overrides.items():
        setattr(args, k, v)
    model = host_model(args, _build_config(args), vocab)
    if torch.cuda.is_available() and not args.use_cpu_initialization:
        model = model.cuda()
    _load_weights(model, load, ckpt_step)
    return model, args
