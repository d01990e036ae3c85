#!/usr/bin/env python
"""A context-length curriculum, end to end: HF import with attention surgery -> stages -> NIAH
evaluation -> HF export (recipes/nemotron-3-nano-superlinear/, its README.md).

    python tools/curriculum.py check recipes/nemotron-3-nano-superlinear/curriculum.yaml \
        [--overlay recipes/nemotron-3-nano-superlinear/extended.yaml]
    python tools/curriculum.py plan  CURRICULUM [--overlay F]            # the layout table
    python tools/curriculum.py run   CURRICULUM [--overlay F] [--launcher local|slurm]
        [--nproc-per-node N] [--steps import,train,eval,export]

A curriculum file names the HF folder (``hf``), the output folder (``out``), the import
(``import: {save, seed, init-method-std}``), the stages in order (``stages``: each ``config``, a
complete trainer YAML beside the curriculum file, its ``nodes`` and its NIAH training data
``niah: {lengths, samples-per-cell, seed}``), the NIAH options shared by the stages (``niah``:
depths, needles, corpus, skip-documents, workers: processes making and tokenizing them, and
``format``: ``train``, every token of a sample in the loss, the default, or ``train-answer``,
the loss on the answer tokens only through a loss-mask sidecar, which every stage then reads with
``subq-loss-mask-data: true``: docs/results.md, session 19, the base learned retrieval only so), the
evaluation grid (``eval``; ``input``: samples made beforehand) and the export (``export:
{hf-out}``).

Contract:
- **Every stage config is checked before anything runs** (``check`` does only that): the keys a
  stage needs, sequence lengths strictly increasing, stage 1 loading the import's save and stage
  k the save of stage k-1 with ``finetune: true``, one model (shape, variant, knobs) in every
  stage, the stage's NIAH data in its ``data-path``, NIAH lengths below its ``seq-length``, and
  the planner's verdict on the layout and memory (megatron_subq/training/plan.py, at the stage's
  ``nodes``). A problem stops the run with exit status 2 and a message naming the stage file and
  the key; nothing is written (no import, no data, no checkpoint).
- ``run`` is resumable: the import, each stage's NIAH data, each stage (its save's tracker at
  ``train-iters``), the evaluation (its JSON) and the export (its config.json) are skipped when
  done; a stage interrupted midway resumes from its own last checkpoint
  (recipes/slurm/load_flags.py, the launcher's rule).
- Each stage starts from the previous stage's **weights only** (``--finetune``): its own data
  iterator (a new blend: other NIAH lengths, another sequence length), its own optimizer and LR
  schedule (warm-up and decay sized to the stage). Why: the previous stage's consumed-samples
  counter and iteration number index another data set and another schedule; restarting both at 0
  keeps every stage a self-contained run that ``train-iters`` describes and a requeue resumes.
- The effective stage configs (stage file + ``--overlay``) are written to ``OUT/configs/`` and
  are what runs (``--launcher slurm``: ``sbatch recipes/slurm/train.sbatch OUT/configs/stageK.yaml``
  chained with ``--dependency afterok``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS = ("import", "train", "eval", "export")
STAGE_KEYS = ("seq-length", "global-batch-size", "micro-batch-size", "train-iters", "lr",
              "save", "load", "finetune", "data-path", "tokenizer-type", "tokenizer-model",
              "attention-variant", "hybrid-override-pattern")
# keys that define the model: equal in every stage (the trainer refuses a --load otherwise)
MODEL_KEYS = ("is-hybrid-model", "hybrid-override-pattern", "num-layers", "hidden-size",
              "num-attention-heads", "num-query-groups", "kv-channels", "ffn-hidden-size",
              "normalization", "norm-epsilon", "position-embedding-type",
              "untie-embeddings-and-output-weights", "squared-relu", "mamba-num-heads",
              "mamba-head-dim", "mamba-state-dim", "mamba-num-groups", "num-experts",
              "moe-ffn-hidden-size", "moe-shared-expert-intermediate-size", "moe-router-topk",
              "attention-variant", "layer-pattern", "tokenizer-type", "tokenizer-model")
NANO_VOCAB = 131072  # the planner's vocabulary before the import wrote the tokenizer files


class CurriculumError(ValueError):
    """Every problem found, each naming the file and the key."""

    def __init__(self, problems: List[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass
class Stage:
    index: int          # 1-based
    source: str         # the stage YAML as given
    config: dict        # effective (stage + overlay)
    nodes: int
    niah: dict
    path: str = ""      # the effective config's file (OUT/configs/stageK.yaml)

    @property
    def save(self) -> str:
        return self.config["save"]


@dataclass
class Curriculum:
    path: str
    spec: dict
    stages: List[Stage] = field(default_factory=list)

    @property
    def out(self) -> str:
        return self.spec["out"]

    @property
    def import_save(self) -> str:
        return self.spec["import"]["save"]

    def niah_prefix(self, stage: Stage) -> str:
        """The indexed-dataset prefix of a stage's NIAH training data."""
        return os.path.join(self.out, "niah", f"stage{stage.index}_text_document")


def _norm(p) -> str:
    return os.path.normpath(str(p))


def _data_prefixes(value) -> List[str]:
    items = value if isinstance(value, list) else str(value).split()
    out = []
    for item in items:
        try:
            float(item)
        except (TypeError, ValueError):
            out.append(str(item))
    return out


def read_curriculum(path: str, overlay: Optional[str] = None) -> Curriculum:
    """The curriculum file and its stages' effective configs (stage YAML, then ``overlay``);
    structural problems raise CurriculumError (file and key named)."""
    problems: List[str] = []
    with open(path, encoding="utf-8") as f:
        spec = yaml.safe_load(f) or {}
    for key in ("hf", "out", "import", "stages"):
        if key not in spec:
            problems.append(f"{path}: missing key '{key}'")
    if problems:
        raise CurriculumError(problems)
    if not isinstance(spec["import"], dict) or "save" not in spec["import"]:
        raise CurriculumError([f"{path}: 'import' must be a mapping with 'save'"])
    extra = {}
    if overlay:
        with open(overlay, encoding="utf-8") as f:
            extra = yaml.safe_load(f) or {}
        if not isinstance(extra, dict):
            raise CurriculumError([f"{overlay}: an overlay is a mapping of trainer flags"])
    if not isinstance(spec["stages"], list) or not spec["stages"]:
        raise CurriculumError([f"{path}: 'stages' must be a non-empty list"])
    cur = Curriculum(path, spec)
    here = os.path.dirname(os.path.abspath(path))
    for k, entry in enumerate(spec["stages"], start=1):
        where = f"{path}: stages[{k - 1}]"
        if not isinstance(entry, dict) or "config" not in entry:
            problems.append(f"{where}: missing key 'config' (the stage's trainer YAML)")
            continue
        source = entry["config"] if os.path.isabs(entry["config"]) else os.path.join(
            here, entry["config"])
        if not os.path.isfile(source):
            problems.append(f"{where}: config {entry['config']}: no such file")
            continue
        with open(source, encoding="utf-8") as f:
            cfg = yaml.safe_load(f) or {}
        if not isinstance(cfg, dict):
            problems.append(f"{source}: a stage config is a mapping of trainer flags")
            continue
        cfg.update(extra)
        niah = entry.get("niah") or {}
        for key in ("lengths", "samples-per-cell", "seed"):
            if key not in niah:
                problems.append(f"{where}: missing key 'niah.{key}' (the stage's NIAH data)")
        if "nodes" not in entry:
            problems.append(f"{where}: missing key 'nodes' (the planner's node count)")
        cur.stages.append(Stage(k, source, cfg, int(entry.get("nodes", 1)), niah))
    if problems:
        raise CurriculumError(problems)
    return cur


NIAH_FORMATS = ("train", "train-answer")


def loss_mask_agrees(fmt: str, masked: bool) -> bool:
    """NIAH training data of format ``fmt`` and a trainer config's ``subq-loss-mask-data``
    (``masked``) go together: ``train-answer``'s sidecar must be read, ``train`` has none."""
    return masked == (fmt == "train-answer")


def niah_format(cur: Curriculum) -> str:
    """The stages' NIAH training format (the curriculum's ``niah.format``, default ``train``)."""
    return str((cur.spec.get("niah") or {}).get("format", "train"))


def check_stages(cur: Curriculum) -> List[str]:
    """The static checks of the contract (keys, order, chain, model, NIAH data); problems named by
    stage file and key."""
    problems: List[str] = []
    first = cur.stages[0].config
    prev_len, prev_save = 0, cur.import_save
    fmt = niah_format(cur)
    if fmt not in NIAH_FORMATS:
        problems.append(f"{cur.path}: niah.format {fmt!r}; allowed {', '.join(NIAH_FORMATS)}")
    for st in cur.stages:
        cfg, src = st.config, st.source
        missing = [k for k in STAGE_KEYS if k not in cfg]
        for key in missing:
            problems.append(f"{src}: missing key '{key}'")
        if missing:
            prev_save = cfg.get("save", prev_save)
            continue
        seq = int(cfg["seq-length"])
        if seq <= prev_len:
            problems.append(f"{src}: seq-length {seq} does not increase on the previous stage's "
                            f"{prev_len} (stages run in order of increasing length)")
        if _norm(cfg["load"]) != _norm(prev_save):
            what = "the import's save" if st.index == 1 else f"stage {st.index - 1}'s save"
            problems.append(f"{src}: load {cfg['load']} is not {what} ({prev_save})")
        if cfg["finetune"] is not True:
            problems.append(f"{src}: finetune must be true (weights only: a fresh data iterator, "
                            "optimizer and schedule per stage)")
        if _norm(cfg["save"]) in (_norm(cur.import_save), _norm(prev_save)):
            problems.append(f"{src}: save {cfg['save']} must be a folder of its own")
        for key in sorted(set(MODEL_KEYS) | {k for k in set(cfg) | set(first)
                                             if k.startswith("superlinear-")}):
            if cfg.get(key) != first.get(key):
                problems.append(f"{src}: {key} {cfg.get(key)!r} differs from stage 1's "
                                f"{first.get(key)!r} (one model in every stage)")
        prefix = cur.niah_prefix(st)
        if _norm(prefix) not in [_norm(p) for p in _data_prefixes(cfg["data-path"])]:
            problems.append(f"{src}: data-path does not include this stage's NIAH data "
                            f"{prefix} (the driver writes it)")
        masked = bool(cfg.get("subq-loss-mask-data", False))
        if fmt in NIAH_FORMATS and not loss_mask_agrees(fmt, masked):
            problems.append(f"{src}: subq-loss-mask-data {str(masked).lower()} disagrees with "
                            f"{cur.path}'s niah.format {fmt!r} (train-answer goes with "
                            "subq-loss-mask-data: true, train without it)")
        lengths = st.niah.get("lengths") or []
        too_long = [n for n in lengths if int(n) >= seq]
        if too_long:
            problems.append(f"{cur.path}: stages[{st.index - 1}].niah.lengths {too_long} are not "
                            f"below the stage's seq-length {seq}")
        prev_len, prev_save = seq, cfg["save"]
    return problems


def write_configs(cur: Curriculum, folder: Optional[str] = None) -> None:
    """Write each stage's effective config (``OUT/configs/stageK.yaml``) and set ``Stage.path``."""
    folder = folder or os.path.join(cur.out, "configs")
    os.makedirs(folder, exist_ok=True)
    for st in cur.stages:
        st.path = os.path.join(folder, f"stage{st.index}.yaml")
        tmp = st.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(f"# effective config of {st.source} (tools/curriculum.py)\n")
            yaml.safe_dump(st.config, f, sort_keys=False)
        os.replace(tmp, st.path)


def _planner_extra(cur: Curriculum, st: Stage) -> List[str]:
    extra = []
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available() and st.config.get("moe-token-dispatcher-type") in (
            "alltoall", "flex"):
        extra += ["--moe-token-dispatcher-type", "allgather"]  # CPU-only check; same memory
    tok = str(st.config.get("tokenizer-model", ""))
    if "vocab-size" not in st.config and not os.path.exists(tok):
        vocab = NANO_VOCAB
        cfg_json = os.path.join(str(cur.spec["hf"]), "config.json")
        if os.path.isfile(cfg_json):
            vocab = int(json.load(open(cfg_json, encoding="utf-8"))["vocab_size"])
        extra += ["--vocab-size", str(vocab)]
    return extra


def plan_stages(cur: Curriculum, gpus_per_node: int = 8, gpu: str = "H100"):
    """[(stage, Plan or None, problems)] by the run planner, on effective configs in a temporary
    folder (nothing is written under OUT)."""
    import tempfile  # noqa: PLC0415

    from megatron_subq.training.plan import PlanError, plan_run  # noqa: PLC0415

    plan_opts = cur.spec.get("plan") or {}
    gpus_per_node = int(plan_opts.get("gpus-per-node", gpus_per_node))
    gpu = plan_opts.get("gpu", gpu)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        write_configs(cur, tmp)
        for st in cur.stages:
            try:
                plan = plan_run(st.path, st.nodes, gpus_per_node, gpu,
                                extra=_planner_extra(cur, st))
                out.append((st, plan, [f"{st.source}: {p}" for p in plan.problems]))
            except PlanError as e:
                out.append((st, None, [f"{st.source}: {p}" for p in e.problems]))
            except SystemExit as e:  # argparse inside the trainer's checks
                out.append((st, None, [f"{st.source}: the trainer's arguments refused it "
                                       f"(exit {e.code}; see the message above)"]))
            st.path = ""
    return out


def validate(cur: Curriculum, plan: bool = True) -> list:
    """All checks of the contract; raises CurriculumError with every problem. Returns the plans."""
    problems = check_stages(cur)
    if problems:
        raise CurriculumError(problems)
    plans = plan_stages(cur) if plan else []
    problems = [p for _, _, ps in plans for p in ps]
    if problems:
        raise CurriculumError(problems)
    return plans


def layout_table(plans) -> str:
    """The README's table: stage, sequence, layout, planner memory per GPU, nodes, tokens."""
    rows = ["| stage | seq | layout (TP x PP x CP x DP, EP) | recompute | memory/GPU (planner) "
            "| nodes x GPUs | tokens |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for st, p, _ in plans:
        a = p.args
        rows.append(
            f"| {os.path.basename(st.source)} | {a.seq_length} | TP {a.tensor_model_parallel_size}"
            f" x PP {a.pipeline_model_parallel_size} x CP {a.context_parallel_size} x DP "
            f"{a.data_parallel_size}, EP {a.expert_model_parallel_size}"
            f"{' + SP' if a.sequence_parallel else ''} | {a.recompute_granularity or 'none'} | "
            f"{p.total_memory_gib:.1f} of {p.gpu.memory_gib} GiB | {p.nodes} x "
            f"{p.gpus_per_node} | {a.train_iters * a.global_batch_size * a.seq_length / 1e6:.0f}M |")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------
# the steps
# ------------------------------------------------------------------------------------------------
def saved_iteration(save: str) -> Optional[int]:
    """The iteration the checkpoint tracker in ``save`` names, or None (no tracker, or not a
    number): what a stage (or tools/nano_evidence.py) has finished."""
    path = os.path.join(save, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    return int(text) if text.isdigit() else None


def import_step(cur: Curriculum, log=print) -> None:
    """HF -> torch_dist with the stages' variant and knobs. Q_s (``linear_qs``) is drawn by the
    variant's init, ``config.init_method`` = normal(0, ``init-method-std``), the scheme of the
    other query weights; ``init-method-std`` defaults to config.json's ``initializer_range`` (HF
    NemotronH draws q_proj from normal(0, initializer_range)), so Q_s starts as the paper says."""
    save = cur.import_save
    if saved_iteration(save) is not None:
        log(f"== import: done ({save})")
        return
    from megatron_subq.convert import import_hf  # noqa: PLC0415

    first = cur.stages[0].config
    hf = str(cur.spec["hf"])
    opts = cur.spec["import"]
    std = opts.get("init-method-std")
    if std is None:
        std = json.load(open(os.path.join(hf, "config.json"), encoding="utf-8")).get(
            "initializer_range", 0.02)
    knobs = {k.replace("-", "_"): v for k, v in first.items() if k.startswith("superlinear-")}
    knobs["init_method_std"] = float(std)
    log(f"== import: {hf} -> {save} ({first['attention-variant']}, {knobs})")
    import_hf(hf, save, attention_variant=first["attention-variant"],
              layer_pattern=first.get("layer-pattern"), knobs=knobs,
              seed=int(opts.get("seed", 1234)), progress=bool(opts.get("progress", True)),
              log=log)


def niah_data_step(cur: Curriculum, st: Stage, log=print) -> None:
    """The stage's NIAH training data in ``OUT/niah/stageK_text_document`` (skipped when there):
    ``tools/niah.py generate --format train`` then ``tools/preprocess_data.py``, or with
    ``niah.format: train-answer`` ``tools/niah.py generate --format train-answer``, which writes
    the indexed dataset and its loss-mask sidecar (``PREFIX_lossmask``) itself."""
    prefix = cur.niah_prefix(st)
    fmt = niah_format(cur)
    files = [prefix + ".idx", prefix + ".bin"]
    if fmt == "train-answer":
        from megatron_subq.training.loss_mask_data import sidecar_files  # noqa: PLC0415
        files += list(sidecar_files(prefix))
    if all(os.path.isfile(f) for f in files):
        log(f"== stage {st.index} NIAH data: done ({prefix})")
        return
    from tools import niah as niah_tool  # noqa: PLC0415
    from tools import preprocess_data  # noqa: PLC0415

    shared = cur.spec.get("niah") or {}
    folder = os.path.dirname(prefix)
    os.makedirs(folder, exist_ok=True)
    jsonl = os.path.join(folder, f"stage{st.index}.jsonl")
    tok = ["--tokenizer-type", str(st.config["tokenizer-type"]), "--tokenizer-model",
           str(st.config["tokenizer-model"])]
    argv = ["generate", *tok, "--lengths", ",".join(str(n) for n in st.niah["lengths"]),
            "--depths", str(shared.get("depths", "0,5,...,100")),
            "--samples-per-cell", str(st.niah["samples-per-cell"]),
            "--needles", str(shared.get("needles", 1)), "--seed", str(st.niah["seed"]),
            "--format", fmt, "--output",
            prefix[:-len("_text_document")] if fmt == "train-answer" else jsonl, "--no-progress",
            "--workers", str(shared.get("workers", 1))]
    if shared.get("corpus"):
        argv += ["--corpus", str(shared["corpus"])]
    if shared.get("skip-documents"):
        argv += ["--skip-documents", str(shared["skip-documents"])]
    log(f"== stage {st.index} NIAH data: tools/niah.py {' '.join(argv)}")
    niah_tool.main(argv)
    if fmt == "train-answer":
        return
    preprocess_data.main(["--input", jsonl, "--output-prefix", prefix[:-len("_text_document")],
                          *tok, "--workers", str(shared.get("workers", 1)), "--no-progress"])


def _trainer_cmd(nproc: int) -> List[str]:
    entry = os.path.join(ROOT, "examples", "pretrain_hybrid.py")
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                entry]
    return [sys.executable, entry]


def train_step(cur: Curriculum, st: Stage, nproc: int = 1, log=print) -> str:
    """Train one stage locally (this machine's GPUs, or the CPU); 'done' when its save's tracker
    is at ``train-iters``, else the trainer runs (resuming its own checkpoint when there is
    one). Returns 'done' or 'trained'; raises RuntimeError when the trainer fails."""
    sys.path.insert(0, os.path.join(ROOT, "recipes", "slurm"))
    from load_flags import load_flags  # noqa: PLC0415

    iters = int(st.config["train-iters"])
    at = saved_iteration(st.save)
    if at is not None and at >= iters:
        log(f"== stage {st.index}: done ({st.save} at iteration {at})")
        return "done"
    flags = load_flags(st.path)
    cmd = _trainer_cmd(nproc) + ["--config", st.path, *flags]
    log(f"== stage {st.index}: {' '.join(cmd)}")
    os.makedirs(st.save, exist_ok=True)
    with open(os.path.join(st.save, f"stage{st.index}.log"), "a", encoding="utf-8") as out:
        rc = subprocess.call(cmd, cwd=os.getcwd(), stdout=out, stderr=subprocess.STDOUT)
    if rc != 0 or (saved_iteration(st.save) or 0) < iters:
        raise RuntimeError(f"stage {st.index} ({st.source}) failed (exit {rc}); log: "
                           f"{os.path.join(st.save, f'stage{st.index}.log')}")
    return "trained"


def submit_slurm(cur: Curriculum, log=print) -> List[str]:
    """Submit the unfinished stages as a chain of train.sbatch jobs (``--dependency afterok``)."""
    job, ids = None, []
    for st in cur.stages:
        if (saved_iteration(st.save) or 0) >= int(st.config["train-iters"]):
            continue
        cmd = ["sbatch", "--parsable", "--nodes", str(st.nodes), "--job-name",
               f"subq-stage{st.index}"] + (["--dependency", f"afterok:{job}"] if job else []) + [
               os.path.join(ROOT, "recipes", "slurm", "train.sbatch"), st.path]
        log(" ".join(cmd))
        job = subprocess.check_output(cmd, text=True).strip().split(";")[0]
        ids.append(job)
    return ids


def eval_step(cur: Curriculum, nproc: int = 1, log=print) -> Optional[dict]:
    """``tools/niah.py eval`` of the last stage over the curriculum's grid: JSON + heatmap in
    ``OUT/eval/`` (skipped when the JSON is there)."""
    spec = cur.spec.get("eval") or {}
    folder = os.path.join(cur.out, "eval")
    result = os.path.join(folder, "niah.json")
    if os.path.isfile(result):
        log(f"== eval: done ({result})")
        return json.load(open(result, encoding="utf-8"))
    os.makedirs(folder, exist_ok=True)
    tool = os.path.join(ROOT, "tools", "niah.py")
    cmd = (_trainer_cmd(nproc)[:-1] + [tool]) + [
        "eval", "--load", cur.stages[-1].save,
        "--lengths", str(spec.get("lengths", "4096,...,262144")),
        "--depths", str(spec.get("depths", "0,10,...,100")),
        "--samples-per-cell", str(spec.get("samples-per-cell", 5)),
        "--seed", str(spec.get("seed", 9001)), "--output", result, "--no-progress"]
    for key in ("corpus", "skip-documents", "tensor-model-parallel-size", "max-batch-tokens",
                "needles", "input"):  # input: samples made beforehand (generate --format eval)
        if spec.get(key) is not None:
            cmd += [f"--{key}", str(spec[key])]
    if spec.get("plot", True):
        cmd += ["--plot", os.path.join(folder, "niah.png")]
    log(f"== eval: {' '.join(cmd)}")
    with open(os.path.join(folder, "eval.log"), "a", encoding="utf-8") as out:
        rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"NIAH evaluation failed (exit {rc}); log: {folder}/eval.log")
    return json.load(open(result, encoding="utf-8"))


def export_step(cur: Curriculum, log=print):
    """``megatron_subq.convert.export_hf`` of the last stage into ``export.hf-out`` with the
    import's config.json (``hf_config``). Today export refuses non-standard attention layers
    (ValueError '... only models whose every attention layer is standard ...'); the error is
    left to the caller."""
    out = (cur.spec.get("export") or {}).get("hf-out") or os.path.join(cur.out, "hf")
    if os.path.isfile(os.path.join(out, "config.json")):
        log(f"== export: done ({out})")
        return None
    from megatron_subq.convert import export_hf  # noqa: PLC0415

    log(f"== export: {cur.stages[-1].save} -> {out}")
    return export_hf(cur.stages[-1].save, out, hf_config=cur.import_save,
                     progress=bool((cur.spec.get("export") or {}).get("progress", True)),
                     log=log)


def run(cur: Curriculum, steps=STEPS, launcher: str = "local", nproc: int = 1,
        log=print) -> dict:
    """Validate every stage, then run the asked steps in order (each skipped when done)."""
    validate(cur)
    write_configs(cur)
    done: Dict[str, object] = {}
    if "import" in steps:
        import_step(cur, log)
    if "train" in steps:
        lm = [p for st in cur.stages for p in _data_prefixes(st.config["data-path"])
              if _norm(p) != _norm(cur.niah_prefix(st))]
        missing = sorted({p for p in lm if not os.path.isfile(p + ".idx")})
        if missing:
            raise CurriculumError([f"data-path: no indexed dataset {p}(.bin/.idx): make it "
                                   "with tools/preprocess_data.py (README.md)" for p in missing])
        for st in cur.stages:
            niah_data_step(cur, st, log)
        if launcher == "slurm":
            done["jobs"] = submit_slurm(cur, log)
            log("submitted; run this command again once the jobs finish (eval, export)")
            return done
        done["stages"] = [train_step(cur, st, nproc, log) for st in cur.stages]
    if "eval" in steps:
        done["eval"] = eval_step(cur, nproc, log)
    if "export" in steps:
        done["export"] = export_step(cur, log)
    return done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/curriculum.py", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("command", choices=("check", "plan", "run"))
    p.add_argument("curriculum", help="a curriculum YAML (recipes/*/curriculum.yaml)")
    p.add_argument("--overlay", default=None,
                   help="a YAML of trainer flags set in every stage (e.g. extended.yaml)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local")
    p.add_argument("--nproc-per-node", type=int, default=1,
                   help="local launcher: processes (GPUs) per stage and for the evaluation")
    p.add_argument("--steps", default=",".join(STEPS),
                   help=f"comma list of {', '.join(STEPS)} (default all)")
    args = p.parse_args(argv)
    steps = args.steps.split(",")
    bad = [s for s in steps if s not in STEPS]
    if bad:
        p.error(f"--steps: unknown {bad}; allowed {', '.join(STEPS)}")
    try:
        cur = read_curriculum(args.curriculum, args.overlay)
        if args.command == "check":
            plans = validate(cur)
            for st, plan, _ in plans:
                print(f"{st.source}: ok (seq {st.config['seq-length']}, "
                      f"{plan.total_memory_gib:.1f} GiB per GPU on {st.nodes} node(s))")
            return 0
        if args.command == "plan":
            print(layout_table(validate(cur)))
            return 0
        run(cur, steps, args.launcher, args.nproc_per_node)
    except CurriculumError as e:
        for problem in e.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # the trainer's checkpoint writer spawns helpers: keep the guard
    sys.exit(main())
