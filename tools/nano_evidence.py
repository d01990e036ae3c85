#!/usr/bin/env python
"""Evidence on one GPU (issue 23): a Nano-shaped hybrid through the Superlinear recipe at
4K -> 8K -> 16K, next to the same model kept dense (recipes/nemotron-3-nano-superlinear/README.md,
"Evidence on one GPU"; settings in recipes/nemotron-3-nano-superlinear/one-gpu/).
tools/gpu_nano_evidence.sh runs it in one device call, or in two (``--stage base`` then
``--stage arms``, the base carried between them as tar.gz parts: its header has the commands),
with ``--stage base-more`` calls between them that train the carried base further.

    python tools/nano_evidence.py check [--arms superlinear,standard]
    python tools/nano_evidence.py run [--arms A,B] [--work runs/nano-evidence] [--dry]
        [--stage all|base|base-more|arms] [--t0 EPOCH] [--deadline EPOCH] [--base-iters N]
        [--stage-iters A,B,C] [--fixed-iters]
    python tools/nano_evidence.py pack [--work W] [--tarball F] [--summary F]
    python tools/nano_evidence.py pack-base --work W --out PREFIX [--max-parts 2]
    python tools/nano_evidence.py unpack-base --work W --parts PART [PART ...] [--stage S]

``--stage`` (default ``all``: the steps below in one call): ``base`` runs 1-2 only, the base's
training sized to the whole call less ``export-s`` and ``base-eval-s``, and evaluates the base's
NIAH at short lengths (evidence.yaml ``base.eval``) beside its export, writing WORK/base/base.json
(model, iterations, tokens/s, that NIAH); ``pack-base`` then splits WORK/base's HF folder and
small files (BASE_MEMBERS) into 15 MiB parts, at most ``--max-parts`` (exit 1 past it).
``arms`` expects them unpacked into WORK/base (``unpack-base``) and runs 3-5 from there: no
tokenizer training, no random model, no base training; the data uses the carried tokenizer, the
stages are sized from the carried tokens/s and get the whole call. ``base-more`` expects them
unpacked into WORK/carried (``unpack-base --stage base-more``) and runs 2 as ``base`` does, but
from the carried HF folder (no tokenizer training, no random model; the carried tokenizer) with
the base NIAH seed + round - 1 (the carried round + 1), so each round trains on new samples;
base.json then counts the rounds and their cumulative iterations and tokens.

``run``, in order (each step's start and end, in seconds from ``--t0``, in WORK/timings.json):

1. **prep**: a byte-level BPE of the docs corpus and the NIAH template and a random NemotronH of
   evidence.yaml's ``model`` saved with transformers, both in WORK/hf-random (a stand-in for
   Nano's HF folder); in the background: the LM text, the NIAH training data of the base and of
   each stage, the evaluation samples (``tools/niah.py generate --workers``,
   ``tools/preprocess_data.py``);
2. **base**: hf-random imported through the converter (standard slots), trained briefly
   (base.yaml) on LM text + NIAH so that it retrieves before the surgery, exported to HF
   (WORK/base/hf): the folder every arm's curriculum imports;
3. **arms**: per arm its curriculum (curriculum.yaml and the stage files with the arm's paths and
   variant; train-iters sized to the clock from the base's measured tokens/s) and its import
   (``tools/curriculum.py run --steps import``: the superlinear arm with surgery); the stage NIAH
   data, made once, linked into each arm's folder;
4. **train** (``tools/curriculum.py run --steps train`` per arm, side by side on the GPU) with
   **before** beside it (``tools/niah.py eval`` of each import on the evaluation samples);
5. **after**: ``tools/curriculum.py run --steps eval,export`` per arm, or, when the clock stopped
   a stage, ``tools/niah.py eval`` of the last checkpoint written (the summary says which).

The clock: ``--deadline`` (epoch seconds; gpu_nano_evidence.sh passes CALL_T0 + CALL_LIMIT less a
reserve for packing) bounds everything. The base stops at its share of the time (the trainer's
``--exit-duration-in-mins``); the stages are stopped ``after-s`` before the deadline (SIGTERM to
the trainers: ``--exit-signal-handler`` saves, then the after step evaluates what was saved);
the after step is killed at the deadline. ``pack`` then writes WORK/summary.md (NIAH accuracy
before -> after per arm and length, tokens/s per stage, the steps' times) and one tarball of
everything but checkpoints, weights and data. Unknown arm names are refused (exit 2) before
anything is written.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from typing import Dict, List, Optional, Tuple

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tools.curriculum import (  # noqa: E402 (no torch: the pack step stays light)
    NIAH_FORMATS,
    loss_mask_agrees,
    saved_iteration,
)
from tools.plot_losses import read_records  # noqa: E402 (no torch either)
RECIPE = os.path.join(ROOT, "recipes", "nemotron-3-nano-superlinear", "one-gpu")
PY = sys.executable
SYMBOL_BLOCK = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# model.yaml keys of an import that are no shape (the stage or base file decides them)
NOT_SHAPE = ("attention-variant", "layer-pattern", "bf16", "fp16")


class EvidenceError(ValueError):
    pass


# the stages that train a base and end with its short NIAH and parts (base: from a random model;
# base-more: from the carried base's HF folder, one more round)
BASE_STAGES = ("base", "base-more")


def base_rounds(base: dict) -> dict:
    """The rounds of a base.json's ``base`` entry: {"round", "cumulative_iters",
    "cumulative_tokens", "stage"}. An entry written before rounds were counted (the GPU base of
    2026-11-27) is round 1 of STAGE=base, its ``done`` iterations x ``tokens_per_iter`` the
    cumulative ones."""
    done = int(base.get("done") or 0)
    return {"round": int(base.get("round", 1)),
            "cumulative_iters": int(base.get("cumulative_iters", done)),
            "cumulative_tokens": int(base.get("cumulative_tokens",
                                              done * int(base.get("tokens_per_iter") or 0))),
            "stage": base.get("stage", "base")}


def rounds_label(base: dict) -> str:
    """'round N, cumulative X iterations / Y tokens' of a base.json's ``base`` entry."""
    r = base_rounds(base)
    return (f"round {r['round']}, cumulative {r['cumulative_iters']:,} iterations / "
            f"{_count(r['cumulative_tokens'])} tokens")


# ------------------------------------------------------------------------------------------------
# settings
# ------------------------------------------------------------------------------------------------
def read_settings(recipe: str = RECIPE, dry: bool = False) -> dict:
    """evidence.yaml, with its ``dry`` block laid over it when ``dry``."""
    with open(os.path.join(recipe, "evidence.yaml"), encoding="utf-8") as f:
        s = yaml.safe_load(f)
    d = s.pop("dry", {}) or {}
    s["dry"] = bool(dry)
    if dry:
        for key in ("model", "tokenizer", "lm", "timing"):
            s[key] = {**s.get(key, {}), **(d.get(key) or {})}
        db = d.get("base") or {}
        s["base"] = {**s["base"], "niah": {**s["base"]["niah"], **(db.get("niah") or {})},
                     "eval": {**s["base"].get("eval", {}), **(db.get("eval") or {})}}
        s["dry-flags"] = d.get("flags") or {}
        s["dry-base-flags"] = (d.get("base") or {}).get("flags") or {}
        s["dry-stages"] = d.get("stages") or []
        s["dry-niah-depths"] = d.get("niah-depths")
        s["dry-eval"] = d.get("eval") or {}
    return s


def parse_arms(text: str, settings: dict) -> List[str]:
    """The arms asked for (comma list), checked against evidence.yaml's ``arms``."""
    allowed = list(settings["arms"])
    names = [a.strip() for a in str(text).split(",") if a.strip()]
    if not names:
        raise EvidenceError(f"--arms {text!r}: empty; allowed a comma list of "
                            f"{', '.join(allowed)}")
    for name in names:
        if name not in allowed:
            raise EvidenceError(f"--arms: unknown arm {name!r}; allowed {', '.join(allowed)} "
                                "(recipes/nemotron-3-nano-superlinear/one-gpu/evidence.yaml)")
    if len(set(names)) != len(names):
        raise EvidenceError(f"--arms {text!r}: an arm named twice")
    return names


def check_base_niah(settings: dict, recipe: str = RECIPE) -> None:
    """evidence.yaml's ``base.niah.format`` and base.yaml's ``subq-loss-mask-data`` agree:
    ``train-answer`` (the loss on the answers only: the sidecar tools/niah.py writes) needs the
    flag, ``train`` (the plain LM loss) must not have it."""
    fmt = settings["base"]["niah"].get("format", "train")
    if fmt not in NIAH_FORMATS:
        raise EvidenceError(f"evidence.yaml base.niah.format {fmt!r}: allowed "
                            f"{', '.join(NIAH_FORMATS)}")
    masked = bool(_yaml(os.path.join(recipe, "base.yaml")).get("subq-loss-mask-data", False))
    if not loss_mask_agrees(fmt, masked):
        raise EvidenceError(f"evidence.yaml base.niah.format {fmt!r} and base.yaml "
                            f"subq-loss-mask-data {str(masked).lower()} disagree: "
                            "train-answer goes with subq-loss-mask-data: true, train without it")


def find_corpus() -> str:
    for path in (os.environ.get("SUBQ_CORPUS"), os.path.join(ROOT, "data", "docs-corpus.jsonl.xz"),
                 os.path.join(ROOT, "..", "shared", "data", "docs-corpus.jsonl.xz")):
        if path and os.path.isfile(path):
            return os.path.abspath(path)
    raise EvidenceError("no docs corpus: data/docs-corpus.jsonl.xz (carried), "
                        "../shared/data/docs-corpus.jsonl.xz or $SUBQ_CORPUS")


def _yaml(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def _write_yaml(path: str, data: dict, header: str = "") -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        if header:
            f.write(header)
        yaml.safe_dump(data, f, sort_keys=False)


def metrics_rows(path: str) -> List[dict]:
    """The training records of a metrics file in iteration order (a resumed run appends: the
    last record of each iteration); [] when there is none."""
    if not os.path.isfile(path):
        return []
    last = read_records(path, lambda rec: "tokens_per_sec_per_gpu" in rec)
    return [last[i] for i in sorted(last)]


# iterations averaged at each end of a run's loss (the one-GPU recipe's log-interval: its
# trainer logs the mean "lm loss" of 10 iterations)
LOSS_WINDOW = 10


def loss_first_last(rows: List[dict], window: int = LOSS_WINDOW) -> Optional[tuple]:
    """(mean lm loss of the first ``window`` iterations, of the last ``window``, the number
    averaged: ``window``, or all of them when fewer), or None when no row has a loss. One
    iteration's loss is too noisy to compare (the base's round 3 on an H200: iteration 859 was
    4.21, 860 0.74, while the 10-iteration means fell from 2.80 to 2.39)."""
    losses = [r["lm_loss"] for r in rows if r.get("lm_loss") is not None]
    if not losses:
        return None
    k = min(window, len(losses))
    return sum(losses[:k]) / k, sum(losses[-k:]) / k, k


def throughput(rows: List[dict], tokens_per_iter: int) -> Optional[float]:
    """Tokens/s over the iterations after the first tenth (compilation, warm-up)."""
    if not rows:
        return None
    keep = rows[max(1, len(rows) // 10):] if len(rows) > 2 else rows
    seconds = sum(r["time_s"] for r in keep)
    return len(keep) * tokens_per_iter / seconds if seconds > 0 else None


# ------------------------------------------------------------------------------------------------
# processes
# ------------------------------------------------------------------------------------------------
def _proc_table() -> Dict[int, tuple]:
    """{pid: (ppid, cmdline)} of this machine's processes (Linux /proc)."""
    out = {}
    for d in glob.glob("/proc/[0-9]*"):
        try:
            pid = int(os.path.basename(d))
            stat = open(os.path.join(d, "stat"), encoding="utf-8", errors="replace").read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmd = open(os.path.join(d, "cmdline"), "rb").read().replace(b"\0", b" ").decode(
                "utf-8", "replace")
            out[pid] = (ppid, cmd)
        except (OSError, ValueError, IndexError):
            continue
    return out


def trainer_pids(root: int) -> List[int]:
    """The trainer processes at or below ``root``: examples/pretrain_hybrid.py whose parent is
    not one (its data-loader workers and checkpoint writers are)."""
    table = _proc_table()
    below, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for pid, (ppid, _) in table.items():
            if ppid == p and pid not in below:
                below.add(pid)
                frontier.append(pid)
    return [p for p in below if p in table and "pretrain_hybrid.py" in table[p][1]
            and "pretrain_hybrid.py" not in table.get(table[p][0], (0, ""))[1]]


class Job:
    """One command in its own process group, its output in ``log``."""

    def __init__(self, name: str, cmd: List[str], log: str, env: Optional[dict] = None,
                 nice: int = 0):
        self.name, self.cmd, self.log = name, cmd, log
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        self._f = open(log, "a", encoding="utf-8")
        self._f.write(f"$ {shlex.join(cmd)}\n")
        self._f.flush()
        full = (["nice", "-n", str(nice)] if nice and shutil.which("nice") else []) + cmd
        self.p = subprocess.Popen(full, stdout=self._f, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env=env, start_new_session=True)
        self.rc: Optional[int] = None
        self.stopped = ""

    def poll(self) -> Optional[int]:
        if self.rc is None:
            self.rc = self.p.poll()
            if self.rc is not None:
                self._f.write(f"exit {self.rc}\n")
                self._f.close()
        return self.rc

    def stop(self, grace: float, log) -> None:
        """SIGTERM the trainers below (their exit handler saves a checkpoint), wait up to
        ``grace`` s, then SIGKILL the whole group."""
        if self.poll() is not None:
            return
        pids = trainer_pids(self.p.pid)
        self.stopped = f"stopped by the clock ({len(pids)} trainer(s) sent SIGTERM)"
        log(f"clock: stopping {self.name}: SIGTERM to trainer(s) {pids}")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
        end = time.time() + (grace if pids else 0)
        while time.time() < end and self.poll() is None:
            time.sleep(0.5)
        if self.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except OSError:
                pass
            self.p.wait()
            self.poll()


def wait_all(jobs: List[Job], until: float, grace: float, log) -> None:
    """Wait for ``jobs``; at ``until`` (epoch s) stop those still running."""
    while any(j.poll() is None for j in jobs):
        if time.time() >= until:
            for j in jobs:
                j.stop(grace, log)
            return
        time.sleep(1.0)


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
class Run:
    def __init__(self, args, settings: dict, arms: List[str]):
        self.args, self.s, self.arms = args, settings, arms
        self.warm_jobs: List[Job] = []
        self.dry = settings["dry"]
        self.work = os.path.abspath(args.work)
        self.t0 = args.t0 or time.time()
        self.deadline = args.deadline or (self.t0 + 3600)
        self.timing = settings["timing"]
        self.workers = int(self.timing.get("workers", 8))
        self.corpus = find_corpus()
        self.data = os.path.join(self.work, "data")
        self.hf_random = os.path.join(self.work, "hf-random")
        self.base = os.path.join(self.work, "base")
        # STAGE=base-more: the carried base (unpack-base --stage base-more), apart from WORK/base
        # where this round's import, training and export go
        self.carried = os.path.join(self.work, "carried")
        self.logs = os.path.join(self.work, "logs")
        self.stage = getattr(args, "stage", None) or "all"
        # the HF folder the base's import reads: the random model, or the carried base's export
        self.base_src = (os.path.join(self.carried, "hf") if self.stage == "base-more"
                         else self.hf_random)
        # the tokenizer every data job uses: the one trained here, or (STAGE=arms, base-more)
        # the carried base's, which is the same file
        self.tok = {"arms": os.path.join(self.base, "hf"),
                    "base-more": self.base_src}.get(self.stage, self.hf_random)
        # the base's rounds before this call's (base-more: the carried base.json's), and the
        # round this call trains (1 for all and base)
        self.prev_base: dict = {}
        self.round = 1
        self.timings: List[dict] = []
        self.info: dict = {"mode": "DRY (CPU)" if self.dry else "GPU", "stage": self.stage,
                           "arms": [] if self.stage in BASE_STAGES else arms,
                           "corpus": self.corpus, "deadline_s": round(self.deadline - self.t0),
                           "iterations": {}, "notes": []}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.data_jobs: Dict[str, Job] = {}

    # -- bookkeeping ----------------------------------------------------------------------------
    def log(self, *msg) -> None:
        print(f"[+{time.time() - self.t0:6.1f}s] " + " ".join(str(m) for m in msg), flush=True)

    def left(self) -> float:
        return self.deadline - time.time()

    def step(self, name: str, start: float, status: str) -> None:
        self.timings.append({"step": name, "start_s": round(start - self.t0, 1),
                             "end_s": round(time.time() - self.t0, 1), "status": status})
        self.save_info()

    def save_info(self) -> None:
        os.makedirs(self.work, exist_ok=True)
        with open(os.path.join(self.work, "timings.json"), "w", encoding="utf-8") as f:
            json.dump({"timings": self.timings, **self.info}, f, indent=1)

    def job(self, name, cmd, log=None, nice=0) -> Job:
        return Job(name, cmd, log or os.path.join(self.logs, f"{name}.log"), self.env, nice)

    def need(self, jobs: List[Job], what: str) -> None:
        bad = [f"{j.name} (exit {j.rc}, log {j.log})" for j in jobs if j.poll() != 0]
        if bad:
            raise RuntimeError(f"{what}: {', '.join(bad)}")

    # -- configs --------------------------------------------------------------------------------
    def _shape(self) -> dict:
        """The model's trainer flags as the base's import wrote them (model.yaml)."""
        flags = _yaml(os.path.join(self.base, "import", "model.yaml"))
        return {k: v for k, v in flags.items()
                if k not in NOT_SHAPE and not k.startswith("superlinear-")}

    def _trainer_config(self, source: str, extra: dict) -> dict:
        cfg = _yaml(source)
        cfg.update(self._shape())
        if self.dry:
            cfg.update(self.s["dry-flags"])
        cfg.update(extra)
        return cfg

    @staticmethod
    def _weights(cfg: dict) -> List[float]:
        items = cfg["data-path"]
        return [float(x) for x in items[0::2]]

    # -- 1. prep --------------------------------------------------------------------------------
    def niah_cmd(self, tok: str, out_prefix: str, lengths, depths, per_cell, seed, fmt="train",
                 skip=0) -> List[str]:
        # train-answer writes OUT_PREFIX_text_document and its loss-mask sidecar itself
        out = out_prefix if fmt == "train-answer" else out_prefix + ".jsonl"
        gen = [PY, "tools/niah.py", "generate", "--tokenizer-type", "HuggingFaceTokenizer",
               "--tokenizer-model", tok, "--lengths", ",".join(str(n) for n in lengths),
               "--depths", str(depths), "--samples-per-cell", str(per_cell), "--seed", str(seed),
               "--needles", "1", "--format", fmt, "--output", out, "--corpus", self.corpus,
               "--workers", str(self.workers), "--no-progress"]
        if skip:
            gen += ["--skip-documents", str(skip)]
        if fmt != "train":
            return gen
        prep = [PY, "tools/preprocess_data.py", "--input", out, "--output-prefix", out_prefix,
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok,
                "--workers", str(self.workers), "--no-progress"]
        return ["bash", "-c", f"{shlex.join(gen)} && {shlex.join(prep)}"]

    def prep(self) -> Dict[str, Job]:
        start = time.time()
        os.makedirs(self.data, exist_ok=True)
        if self.stage == "arms":
            return self._prep_carried()
        if self.stage == "base-more":
            return self._prep_more()
        from megatron_subq.testing.tokenizers import train_niah_bpe  # noqa: PLC0415

        tok = self.s["tokenizer"]
        os.makedirs(self.hf_random, exist_ok=True)
        train_niah_bpe(self.corpus, self.hf_random, documents=int(tok["documents"]),
                       vocab_size=int(tok["vocab-size"]),
                       template_repeats=int(tok.get("template-repeats", 1)))
        self.log(f"prep: tokenizer ({tok['vocab-size']} tokens) in {self.hf_random}")
        jobs = self.data_jobs  # filled as they start: stopped at the end whatever happens
        if not getattr(self.args, "warm_only", False):
            self._start_data(jobs)
        self._random_model()
        self.step("prep (tokenizer, random NemotronH)", start, "ok")
        return jobs

    def _read_carried(self, hf: str, folder: str, unpack: str) -> dict:
        """The carried base of STAGE=arms / base-more: its HF folder ``hf`` must hold
        config.json (else an EvidenceError naming the ``unpack`` command that puts it there);
        ``folder``/base.json (empty when missing) is returned, its model description kept."""
        if not os.path.isfile(os.path.join(hf, "config.json")):
            raise EvidenceError(f"STAGE={self.stage}: no carried base in {hf} (config.json "
                                f"missing): unpack the .nano-base.tgz.a* parts first ({unpack})")
        meta = os.path.join(folder, "base.json")
        carried = json.load(open(meta, encoding="utf-8")) if os.path.isfile(meta) else {}
        self.info["model"] = carried.get("model", {})
        return carried

    def _prep_carried(self) -> Dict[str, Job]:
        """STAGE=arms: the base carried from a STAGE=base or base-more call (unpacked into
        WORK/base by ``unpack-base``) stands for the random model and the base training: its HF
        folder is what the arms import, its tokenizer the data's, its base.json the model, its
        rounds and the measured tokens/s the stages are sized from."""
        start = time.time()
        hf = os.path.join(self.base, "hf")
        carried = self._read_carried(hf, self.base, "unpack-base")
        self.info["iterations"]["base"] = {**carried.get("base", {}), "carried": True}
        self.info["base_niah"] = carried.get("niah")
        self.log(f"prep: the carried base in {hf} ({rounds_label(carried.get('base', {}))})")
        self._start_data(self.data_jobs)
        if not self.dry:  # the arms' kernels compile during the data preparation, in turn
            cmds = [shlex.join([PY, "examples/pretrain_hybrid.py", "--config",
                                self._warm_config(v)]) for v in self.variants()]
            self.warm_jobs = [self.job("warm-arms", ["bash", "-c", "; ".join(cmds)])]
        self.step("prep (the carried base)", start, "ok")
        return self.data_jobs

    def _prep_more(self) -> Dict[str, Job]:
        """STAGE=base-more: the base carried from a STAGE=base or base-more call (unpacked into
        WORK/carried) stands for the random model: its HF folder is what the base imports, its
        tokenizer the data's, its base.json the rounds so far (this call trains the next one,
        its NIAH samples from the base NIAH seed + round - 1: new ones each round)."""
        start = time.time()
        carried = self._read_carried(self.base_src, self.carried, "unpack-base --stage base-more")
        self.prev_base = carried.get("base", {})
        self.round = base_rounds(self.prev_base)["round"] + 1
        self.log(f"prep: the carried base in {self.base_src} ({rounds_label(self.prev_base)}); "
                 f"this call trains round {self.round}")
        if not getattr(self.args, "warm_only", False):
            self._start_data(self.data_jobs)
        self.step(f"prep (the carried base, round {self.round})", start, "ok")
        return self.data_jobs

    def niah_base_seed(self) -> int:
        """The base NIAH training data's seed: evidence.yaml's base.niah.seed + round - 1, so
        that round 1 (STAGE=base, one call) keeps the seed it always had and each base-more
        round trains on samples the earlier rounds did not see."""
        return int(self.s["base"]["niah"]["seed"]) + self.round - 1

    def _start_data(self, jobs: Dict[str, Job]) -> None:
        """The background jobs (``jobs``, by name) of what this stage needs: the LM text (all);
        the base's NIAH training data (all, base) and its short evaluation samples (base);
        the stages' NIAH data and the evaluation samples (all, arms)."""
        lm = [PY, "tools/preprocess_data.py", "--input", self.corpus, "--output-prefix",
              os.path.join(self.data, "lm"), "--tokenizer-type", "HuggingFaceTokenizer",
              "--tokenizer-model", self.tok, "--workers", str(self.workers),
              "--no-progress"]
        if self.s["lm"].get("max-documents"):
            lm += ["--max-documents", str(self.s["lm"]["max-documents"])]
        jobs["lm"] = self.job("prep-lm", lm)
        if self.stage != "arms":
            b = self.s["base"]["niah"]
            jobs["niah-base"] = self.job("prep-niah-base", self.niah_cmd(
                self.tok, os.path.join(self.data, "niah-base"), b["lengths"], b["depths"],
                b["samples-per-cell"], self.niah_base_seed(), fmt=b.get("format", "train")))
        if self.stage in BASE_STAGES:
            e = self.s["base"]["eval"]
            jobs["niah-base-eval"] = self.job("prep-niah-base-eval", self.niah_cmd(
                self.tok, os.path.join(self.data, "niah-base-eval"), e["lengths"], e["depths"],
                e["samples-per-cell"], e["seed"], fmt="eval", skip=e.get("skip-documents", 0)),
                nice=10)
            return
        # the stages' data and the evaluation samples are needed later: at a lower priority
        cur = _yaml(os.path.join(RECIPE, "curriculum.yaml"))
        depths = self.s.get("dry-niah-depths") or cur["niah"]["depths"]
        for k, entry in enumerate(cur["stages"], start=1):
            niah = dict(entry["niah"])
            if self.dry:
                niah.update((self.s["dry-stages"][k - 1].get("niah") or {}))
            jobs[f"niah-stage{k}"] = self.job(f"prep-niah-stage{k}", self.niah_cmd(
                self.tok, os.path.join(self.data, f"niah-stage{k}"), niah["lengths"],
                depths, niah["samples-per-cell"], niah["seed"]), nice=10)
        ev = {**cur["eval"], **(self.s.get("dry-eval") or {})}
        from megatron_subq.evaluation.niah import parse_numbers  # noqa: PLC0415

        lengths = [int(x) for x in parse_numbers(ev["lengths"], "--lengths", doubling=True)]
        jobs["niah-eval"] = self.job("prep-niah-eval", self.niah_cmd(
            self.tok, os.path.join(self.data, "niah-eval"), lengths, ev["depths"],
            ev["samples-per-cell"], ev["seed"], fmt="eval", skip=ev.get("skip-documents", 0)),
            nice=10)

    def _random_model(self) -> None:
        """The random NemotronH (transformers), with the tokenizer's vocabulary."""
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415

        m = dict(self.s["model"])
        pattern, seed = m.pop("pattern"), int(m.pop("seed", 1234))
        m["layers_block_type"] = [SYMBOL_BLOCK[c] for c in pattern]
        from tokenizers import Tokenizer  # noqa: PLC0415

        m["vocab_size"] = Tokenizer.from_file(
            os.path.join(self.hf_random, "tokenizer.json")).get_vocab_size()
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(transformers.NemotronHConfig(**m))
        model.save_pretrained(self.hf_random)
        params = sum(p.numel() for p in model.parameters())
        del model
        self.info["model"] = {"pattern": pattern, "parameters": params,
                              "vocab": m["vocab_size"]}
        self.log(f"prep: random NemotronH {pattern}, {params / 1e6:.1f}M parameters, saved")

    # -- 2. base --------------------------------------------------------------------------------
    # keys of base.yaml a warm-up run drops: it trains on mock data and keeps nothing
    WARM_DROP = ("data-path", "load", "finetune", "save", "metrics-file", "save-interval",
                 "exit-signal-handler", "split", "num-workers", "exit-duration-in-mins",
                 "subq-loss-mask-data")

    def variants(self) -> List[str]:
        """The attention variants the run compiles: 'standard' (the base's) first, then every
        other arm's, sorted."""
        return ["standard"] + sorted({self.s["arms"][a]["attention-variant"]
                                      for a in self.arms} - {"standard"})

    def warm_up(self, variant: str) -> Optional[Job]:
        """Triton's compiles of ``variant``'s model, ahead of the runs that need them: the
        base's model (evidence.yaml's shape, base.yaml's flags) with ``variant`` in the '*'
        slots, 2 iterations of one 4K micro-batch on mock data, nothing saved. Compiled kernels land
        in TRITON_CACHE_DIR, where the later trainers find them: the first base step compiled
        for 99 s on an H200 (2026-11-27), half the base's time, while the GPU idled through the
        data preparation. None on the CPU (DRY: the interpreter compiles nothing)."""
        if self.dry:
            return None
        path = self._warm_config(variant)
        return self.job(f"warm-{variant}", [PY, "examples/pretrain_hybrid.py", "--config", path])

    def _warm_config(self, variant: str) -> str:
        """warm_up's trainer config for ``variant`` (WORK/warm/VARIANT.yaml); its path."""
        cfg = {k: v for k, v in _yaml(os.path.join(RECIPE, "base.yaml")).items()
               if k not in self.WARM_DROP}
        # the base's micro-batch (Triton specialises integer arguments equal to 1 or divisible
        # by 16: a warm-up at micro-batch 1 would compile other variants than the runs use)
        cfg.update({"mock-data": True, "train-iters": 2, "lr-warmup-iters": 1,
                    "global-batch-size": int(cfg["micro-batch-size"]),
                    "tokenizer-model": self.tok, "attention-variant": variant,
                    "log-interval": 1})
        path = os.path.join(self.work, "warm", f"{variant}.yaml")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_yaml(path, cfg, "# compile warm-up (tools/nano_evidence.py warm_up)\n")
        return path

    def base_run(self, data_jobs: Dict[str, Job]) -> None:
        start = time.time()
        # the base's kernels compile while the import and the data run (CPU work)
        warm = self.warm_up("standard")
        imp = self.job("base-import", [PY, "tools/convert_checkpoint.py", "import", "--hf",
                                       self.base_src, "--save",
                                       os.path.join(self.base, "import"),
                                       "--attention-variant", "standard", "--no-progress"])
        needed = [imp, data_jobs["lm"], data_jobs["niah-base"]]
        wait_all(needed, self.deadline, 5, self.log)
        self.need(needed, "base inputs")
        if warm is not None:  # compiling in two processes at once would only duplicate it
            wait_all([warm], time.time() + float(self.timing["warm-wait-s"]), 5, self.log)
            if warm.poll() != 0:
                self.info["notes"].append(f"compile warm-up (standard): exit {warm.rc} or "
                                          f"stopped; log {warm.log}")
        self.step("base: import + LM/NIAH data (+ compile warm-up)", start, "ok")

        start = time.time()
        src = os.path.join(RECIPE, "base.yaml")
        w = self._weights(_yaml(src))
        extra = {"data-path": [w[0], os.path.join(self.data, "lm_text_document"), w[1],
                               os.path.join(self.data, "niah-base_text_document")],
                 "tokenizer-model": self.tok, "load": os.path.join(self.base, "import"),
                 "save": os.path.join(self.base, "train"),
                 "metrics-file": os.path.join(self.base, "train", "metrics.jsonl")}
        if self.dry:
            extra.update(self.s["dry-base-flags"])
        cfg = self._trainer_config(src, extra)
        # the base's share of what is left, less the arms' imports, their stages' start-ups and
        # the after step; its iterations from the guessed rate, and the trainer's own clock
        t = self.timing
        if self.stage in BASE_STAGES:  # the whole call, less the export and the short NIAH
            until = self.deadline - float(t["export-s"]) - float(t["base-eval-s"])
            budget = max(60.0, until - time.time() - float(t["startup-s"]))
        else:
            n_stages = 3
            free = self.left() - float(t["after-s"]) - float(t["import-s"])
            budget = max(60.0, float(t["base-share"]) * (free - n_stages * float(t["startup-s"])))
            until = start + budget + 60
        tokens = int(cfg["global-batch-size"]) * int(cfg["seq-length"])
        # base-more: the carried base's measured tokens/s (the same model on the same kind of
        # GPU), so that the cosine schedule ends near where the clock stops it
        rate_guess = float(self.prev_base.get("rate") or t["rate-guess"])
        if self.args.base_iters:
            cfg["train-iters"] = int(self.args.base_iters)
        elif not self.dry and not self.args.fixed_iters:
            cfg["train-iters"] = max(int(t["min-iters"]), int(
                (budget - float(t["startup-s"])) * rate_guess / tokens))
        cfg["lr-warmup-iters"] = min(int(cfg["lr-warmup-iters"]),
                                     max(1, int(cfg["train-iters"]) // 10))
        if not self.dry:
            cfg["exit-duration-in-mins"] = round(budget / 60.0, 3)
        path = os.path.join(self.base, "base.yaml")
        _write_yaml(path, cfg, f"# effective config of {os.path.relpath(src, ROOT)} "
                               "(tools/nano_evidence.py)\n")
        self.info["iterations"]["base"] = {"planned": cfg["train-iters"],
                                           "tokens_per_iter": tokens,
                                           "seq": cfg["seq-length"],
                                           "budget_s": round(budget)}
        self.log(f"base: round {self.round}, {cfg['train-iters']} iterations of {tokens} "
                 f"tokens, budget {budget:.0f} s")
        train = self.job("base-train", [PY, "examples/pretrain_hybrid.py", "--config", path],
                         os.path.join(self.base, "train.log"))
        # the other arms' kernels compile meanwhile (one sequence: a little GPU time)
        self.warm_jobs = [j for j in map(self.warm_up, self.variants()[1:]) if j is not None]
        wait_all([train], until, 30, self.log)
        if saved_iteration(os.path.join(self.base, "train")) is None:
            raise RuntimeError(f"base training wrote no checkpoint (exit {train.rc}; log "
                               f"{train.log})")
        rate = throughput(metrics_rows(cfg["metrics-file"]), tokens)
        done = saved_iteration(os.path.join(self.base, "train"))
        self.info["iterations"]["base"].update(done=done, rate=rate, **self._rounds(done, tokens))
        self.step("base: training", start, train.stopped or f"exit {train.rc}")

        start = time.time()
        exp = self.job("base-export", [PY, "tools/convert_checkpoint.py", "export", "--load",
                                       os.path.join(self.base, "train"), "--hf-out",
                                       os.path.join(self.base, "hf"), "--hf-config",
                                       os.path.join(self.base, "import"), "--no-progress"])
        jobs = [exp]
        if self.stage in BASE_STAGES:  # the base's short NIAH beside the export (GPU and CPU)
            out = os.path.join(self.base, "niah")
            os.makedirs(out, exist_ok=True)
            data = self.data_jobs["niah-base-eval"]
            wait_all([data], self.deadline, 5, self.log)  # its samples (the export runs on)
            e = self.s["base"]["eval"]
            cmd = [PY, "tools/niah.py", "eval", "--load", os.path.join(self.base, "train"),
                   "--input", os.path.join(self.data, "niah-base-eval.jsonl"), "--output",
                   os.path.join(out, "niah.json"), "--plot", os.path.join(out, "niah.png"),
                   "--max-batch-tokens", str(e.get("max-batch-tokens", 16384)), "--no-progress"]
            if data.poll() == 0:
                jobs.append(self.job("base-niah", cmd, os.path.join(out, "eval.log")))
            else:
                self.info["notes"].append(f"base NIAH: no samples (exit {data.rc}; log "
                                          f"{data.log}); not evaluated")
        wait_all(jobs, self.deadline, 5, self.log)
        self.need([exp], "base export")
        self.step("base: export to HF" + (" + short NIAH" if len(jobs) > 1 else ""), start,
                  "; ".join(f"{j.name} {j.stopped or f'exit {j.rc}'}" for j in jobs))
        if self.stage in BASE_STAGES:
            self._base_meta()

    def _rounds(self, done: int, tokens_per_iter: int) -> dict:
        """base.json's round keys after this call trained ``done`` iterations: its round, the
        stage that trained it, the NIAH seed, the cumulative iterations and tokens of all rounds
        (the carried ones plus this one's) and one entry per round."""
        prev = base_rounds(self.prev_base) if self.prev_base else None
        rounds = list(self.prev_base.get("rounds") or ([] if prev is None else [
            {"round": prev["round"], "stage": prev["stage"], "iterations":
             prev["cumulative_iters"], "tokens": prev["cumulative_tokens"], "niah_seed": None}]))
        rounds.append({"round": self.round, "stage": self.stage, "iterations": done,
                       "tokens": done * tokens_per_iter, "niah_seed": self.niah_base_seed()})
        return {"round": self.round, "stage": self.stage, "niah_seed": self.niah_base_seed(),
                "cumulative_iters": (prev["cumulative_iters"] if prev else 0) + done,
                "cumulative_tokens": ((prev["cumulative_tokens"] if prev else 0)
                                      + done * tokens_per_iter),
                "rounds": rounds}

    def _base_meta(self) -> None:
        """WORK/base/base.json: what STAGE=arms (or the next base-more) needs of this call
        besides the HF folder (the model's description; the base's iterations, tokens/s, round
        and cumulative iterations/tokens, base_run's keys; its short NIAH)."""
        r = niah_by_length(os.path.join(self.base, "niah", "niah.json"))
        niah = None if r is None else {"accuracy": r["accuracy"], "logprob": r["logprob"],
                                       "lengths": {str(n): v[0] for n, v in r["lengths"].items()}}
        self.info["base_niah"] = niah
        with open(os.path.join(self.base, "base.json"), "w", encoding="utf-8") as f:
            json.dump({"model": self.info.get("model", {}),
                       "base": self.info["iterations"].get("base", {}), "niah": niah}, f,
                      indent=1)

    # -- 3. arms --------------------------------------------------------------------------------
    def stage_iters(self, cur: dict) -> List[int]:
        """Each stage's train-iters: fixed (the files, or --stage-iters), or sized to the time
        left from the base's measured tokens/s."""
        files = [_yaml(os.path.join(RECIPE, e["config"])) for e in cur["stages"]]
        if self.args.stage_iters:
            return [int(x) for x in self.args.stage_iters.split(",")]
        if self.dry:
            return [int(st["flags"]["train-iters"]) for st in self.s["dry-stages"]]
        if self.args.fixed_iters:
            return [int(f["train-iters"]) for f in files]
        t = self.timing
        base = self.info["iterations"].get("base", {})
        rate = base.get("rate") or float(t["rate-guess"])
        share = float(t["parallel-share"]) if len(self.arms) > 1 else 1.0
        free = (self.left() - float(t["after-s"]) - float(t["import-s"])
                - len(files) * float(t["startup-s"]))
        split = [float(x) for x in t["stage-split"]]
        out = []
        for f, part in zip(files, split):
            seq = int(f["seq-length"])
            factor = float({int(k): v for k, v in t["length-factor"].items()}.get(seq, 0.7))
            seconds = max(0.0, free) * part / sum(split)
            out.append(max(int(t["min-iters"]), int(seconds * rate * share * factor
                                                    / (int(f["global-batch-size"]) * seq))))
        self.info["sizing"] = {"rate": rate, "share": share, "free_s": round(free)}
        return out

    def arm_files(self, arm: str, iters: List[int]) -> str:
        """The arm's curriculum and stage files in WORK/arms/ARM; returns the curriculum."""
        folder = os.path.join(self.work, "arms", arm)
        run = os.path.join(folder, "run")
        cur = _yaml(os.path.join(RECIPE, "curriculum.yaml"))
        variant = self.s["arms"][arm]
        entries = []
        for k, entry in enumerate(cur["stages"], start=1):
            src = os.path.join(RECIPE, entry["config"])
            w = self._weights(_yaml(src))
            extra = {"data-path": [w[0], os.path.join(self.data, "lm_text_document"), w[1],
                                   os.path.join(run, "niah", f"stage{k}_text_document")],
                     "tokenizer-model": os.path.join(run, "import", "hf_files"),
                     "load": os.path.join(run, "import" if k == 1 else f"stage{k - 1}"),
                     "save": os.path.join(run, f"stage{k}"),
                     "metrics-file": os.path.join(run, f"stage{k}", "metrics.jsonl")}
            if self.dry:
                extra.update(self.s["dry-stages"][k - 1].get("flags") or {})
            cfg = self._trainer_config(src, extra)
            cfg.update(variant)
            if cfg["attention-variant"] != "superlinear":
                cfg = {k2: v for k2, v in cfg.items() if not k2.startswith("superlinear-")}
            cfg["train-iters"] = iters[k - 1]
            cfg["lr-warmup-iters"] = min(int(cfg["lr-warmup-iters"]),
                                         max(1, iters[k - 1] // 5))
            name = f"stage{k}.yaml"
            _write_yaml(os.path.join(folder, name), cfg,
                        f"# {arm} arm: {os.path.relpath(src, ROOT)} (tools/nano_evidence.py)\n")
            niah = dict(entry["niah"])
            if self.dry:
                niah.update(self.s["dry-stages"][k - 1].get("niah") or {})
            entries.append({"config": name, "nodes": 1, "niah": niah})
        spec = copy.deepcopy(cur)
        spec.update(hf=os.path.join(self.base, "hf"), out=run, stages=entries)
        spec["import"] = {**cur["import"], "save": os.path.join(run, "import")}
        spec["niah"] = {**cur["niah"], "corpus": self.corpus, "workers": self.workers}
        if self.dry:
            spec["niah"]["depths"] = self.s["dry-niah-depths"]
        spec["eval"] = {**cur["eval"], **(self.s.get("dry-eval") or {}), "corpus": self.corpus,
                        "input": os.path.join(self.data, "niah-eval.jsonl")}
        spec["export"] = {**cur["export"], "hf-out": os.path.join(run, "hf")}
        path = os.path.join(folder, "curriculum.yaml")
        _write_yaml(path, spec, f"# {arm} arm of {os.path.relpath(RECIPE, ROOT)}/curriculum.yaml "
                                "(tools/nano_evidence.py)\n")
        return path

    def arms_setup(self, data_jobs: Dict[str, Job]) -> Dict[str, str]:
        start = time.time()
        cur = _yaml(os.path.join(RECIPE, "curriculum.yaml"))
        iters = self.stage_iters(cur)
        self.info["iterations"]["stages"] = iters
        self.log(f"arms: stage iterations {iters}")
        curricula = {arm: self.arm_files(arm, iters) for arm in self.arms}
        jobs = [self.job(f"{arm}-import", [PY, "tools/curriculum.py", "run", path, "--steps",
                                           "import"],
                         os.path.join(self.work, "arms", arm, "curriculum.log"))
                for arm, path in curricula.items()]
        stage_data = [data_jobs[f"niah-stage{k}"] for k in range(1, len(cur["stages"]) + 1)]
        wait_all(jobs + stage_data + [data_jobs["niah-eval"]], self.deadline, 5, self.log)
        self.need(jobs + stage_data + [data_jobs["niah-eval"]], "arms' imports and NIAH data")
        for arm in self.arms:  # the stages' NIAH data, made once, in every arm's folder
            niah = os.path.join(self.work, "arms", arm, "run", "niah")
            os.makedirs(niah, exist_ok=True)
            for k in range(1, len(cur["stages"]) + 1):
                for ext in (".bin", ".idx"):
                    src = os.path.join(self.data, f"niah-stage{k}_text_document{ext}")
                    dst = os.path.join(niah, f"stage{k}_text_document{ext}")
                    if not os.path.exists(dst):
                        try:
                            os.link(src, dst)
                        except OSError:
                            shutil.copyfile(src, dst)
        self.step("arms: curricula, imports (surgery), stage data", start, "ok")
        return curricula

    # -- 4./5. train, before, after ---------------------------------------------------------------
    def eval_cmd(self, load: str, out: str) -> List[str]:
        ev = _yaml(self.curricula[self.arms[0]])["eval"]
        return [PY, "tools/niah.py", "eval", "--load", load, "--input", ev["input"],
                "--output", os.path.join(out, "niah.json"), "--plot",
                os.path.join(out, "niah.png"), "--max-batch-tokens",
                str(ev.get("max-batch-tokens", 16384)), "--no-progress"]

    def train_and_before(self) -> None:
        start = time.time()
        # the stages' first steps find the arms' kernels compiled (or compile what is left)
        wait_all(self.warm_jobs, start + float(self.timing["warm-wait-s"]) / 3, 5, self.log)
        for j in self.warm_jobs:
            if j.poll() != 0:
                self.info["notes"].append(f"compile warm-up ({j.name}): exit {j.rc} or "
                                          f"stopped; log {j.log}")
        jobs = []
        for arm, path in self.curricula.items():
            jobs.append(self.job(f"{arm}-train", [PY, "tools/curriculum.py", "run", path,
                                                  "--steps", "train"],
                                 os.path.join(self.work, "arms", arm, "curriculum.log")))
            before = os.path.join(self.work, "arms", arm, "before")
            os.makedirs(before, exist_ok=True)
            jobs.append(self.job(f"{arm}-before", self.eval_cmd(
                os.path.join(self.work, "arms", arm, "run", "import"), before),
                os.path.join(before, "eval.log")))
        until = self.deadline - float(self.timing["after-s"])
        wait_all(jobs, until, 45 if not self.dry else 20, self.log)
        self.step("arms: stages (train) + NIAH before", start,
                  "; ".join(f"{j.name} {j.stopped or f'exit {j.rc}'}" for j in jobs))

    def after(self) -> None:
        start = time.time()
        jobs = []
        self.info["after"] = {}
        for arm, path in self.curricula.items():
            cur = _yaml(path)
            run = cur["out"]
            folder = os.path.join(self.work, "arms", arm)
            stages = [_yaml(os.path.join(folder, e["config"])) for e in cur["stages"]]
            done = [(saved_iteration(s["save"]) or 0) >= int(s["train-iters"]) for s in stages]
            if all(done):
                steps = "eval,export" if self.left() > 0.6 * float(self.timing["after-s"]) \
                    else "eval"
                jobs.append(self.job(f"{arm}-after", [PY, "tools/curriculum.py", "run", path,
                                                      "--steps", steps],
                                     os.path.join(folder, "curriculum.log")))
                self.info["after"][arm] = {"checkpoint": f"stage{len(stages)}",
                                           "iteration": saved_iteration(stages[-1]["save"]),
                                           "complete": True, "steps": steps}
                continue
            # the clock stopped a stage: the last checkpoint written
            load, label = os.path.join(run, "import"), "import"
            for k, s in enumerate(stages, start=1):
                if saved_iteration(s["save"]):
                    load, label = s["save"], f"stage{k}"
            self.info["after"][arm] = {"checkpoint": label, "iteration": saved_iteration(load),
                                       "complete": False, "steps": "eval"}
            if label == "import":
                self.info["notes"].append(f"{arm}: no stage saved a checkpoint; no after eval")
                continue
            out = os.path.join(run, "eval")
            os.makedirs(out, exist_ok=True)
            jobs.append(self.job(f"{arm}-after", self.eval_cmd(load, out),
                                 os.path.join(out, "eval.log")))
        wait_all(jobs, self.deadline, 5, self.log)
        self.step("arms: NIAH after (+ export)", start,
                  "; ".join(f"{j.name} {j.stopped or f'exit {j.rc}'}" for j in jobs) or "none")

    def warm_only(self) -> int:
        """``--warm-only``: the compile warm-ups of every variant the run needs, one after
        another (two at once would compile the shared kernels twice), nothing else. A device
        call of its own, or a job beside others, whose Triton cache is carried into the
        evidence call (tools/gpu_nano_evidence.sh WARM_ONLY=1): that call's steps then start
        without ~100 s of compiles each. 0 when every warm-up exited 0."""
        start = time.time()
        variants = self.variants()
        rcs = []
        for v in variants:
            job = self.warm_up(v)
            if job is None:  # DRY: nothing compiles
                continue
            self.warm_jobs.append(job)
            wait_all([job], self.deadline, 5, self.log)
            rcs.append(job.poll())
            stopped = f" ({job.stopped})" if job.stopped else ""
            self.log(f"warm-up {v}: exit {job.rc}{stopped}")
        self.step("compile warm-ups only (" + ", ".join(variants) + ")", start,
                  "ok" if all(rc == 0 for rc in rcs) else f"exits {rcs}")
        return 0 if all(rc == 0 for rc in rcs) else 1

    def run(self) -> int:
        self.log(f"nano_evidence: {self.info['mode']}, arms {','.join(self.arms)}, "
                 f"{self.left():.0f} s to the deadline, work {self.work}")
        self.save_info()
        try:
            self.prep()
            if getattr(self.args, "warm_only", False):
                return self.warm_only()
            if self.stage != "arms":
                self.base_run(self.data_jobs)
            if self.stage in BASE_STAGES:
                return 0
            self.curricula = self.arms_setup(self.data_jobs)
            self.train_and_before()
            self.after()
        except Exception as e:  # noqa: BLE001 - the summary says what stopped the run
            import traceback  # noqa: PLC0415

            traceback.print_exc()
            self.info["notes"].append(f"stopped: {type(e).__name__}: {e}")
            self.log(f"error: {e}")
            return 1
        finally:
            for j in list(self.data_jobs.values()) + self.warm_jobs:
                j.stop(0, self.log)
            self.save_info()
        return 0


# ------------------------------------------------------------------------------------------------
# summary and tarball
# ------------------------------------------------------------------------------------------------
def _len_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _count(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else f"{n:.0f}"


def niah_by_length(path: str) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    r = json.load(open(path, encoding="utf-8"))
    out: Dict[int, list] = {}
    for c in r.get("cells", []):
        out.setdefault(int(c["length"]), []).append(c)
    rows = {n: (sum(c["accuracy"] * c["n"] for c in cs) / sum(c["n"] for c in cs),
                sum(c["mean_answer_logprob"] * c["n"] for c in cs) / sum(c["n"] for c in cs))
            for n, cs in out.items()}
    return {"lengths": rows, "accuracy": r.get("accuracy"),
            "logprob": r.get("mean_answer_logprob"), "iteration": r.get("iteration"),
            "samples": len(r.get("samples", [])), "variant": r.get("attention_variant")}


def niah_files(work: str, arm: str) -> Tuple[Tuple[str, str], ...]:
    """An arm's two NIAH evaluations: ("before", the import's), ("after", the last stage's)."""
    arm_dir = os.path.join(work, "arms", arm)
    return (("before", os.path.join(arm_dir, "before", "niah.json")),
            ("after", os.path.join(arm_dir, "run", "eval", "niah.json")))


def superlinear_window_of(work: str, arms: List[str]) -> Optional[int]:
    """The sliding window (tokens) of the first Superlinear arm's imported model, from its
    ``model.yaml`` (``superlinear-search-power``, ``superlinear-sw-index``); None without one."""
    from megatron_subq.ops.superlinear import superlinear_window  # noqa: PLC0415

    for arm in arms:
        path = os.path.join(work, "arms", arm, "run", "import", "model.yaml")
        if os.path.isfile(path):
            flags = _yaml(path)
            if flags.get("attention-variant") == "superlinear":
                return superlinear_window(float(flags.get("superlinear-search-power", 0.5)),
                                          int(flags.get("superlinear-sw-index", 0)))
    return None


def niah_by_window(result: dict, window: int) -> dict:
    """A NIAH result's samples (``result``: its JSON, loaded) split by the needle's distance
    from the prompt's end (prompt tokens - needle position): "in" (<= window: the sliding window
    alone can reach it) and "out" (farther: only the search path can), per length and in all.
    Each entry: (correct, samples, mean answer log-prob)."""
    groups: Dict[tuple, list] = {}
    for smp in result.get("samples", []):
        side = "in" if smp["prompt_tokens"] - smp["needle_position"] <= window else "out"
        for key in ((side, None), (side, int(smp["length"]))):
            g = groups.setdefault(key, [0, 0, 0.0])
            g[0] += bool(smp["correct"])
            g[1] += 1
            g[2] += smp["answer_logprob"]
    return {k: (g[0], g[1], g[2] / g[1]) for k, g in groups.items()}


def heatmaps(work: str, arms: List[str], path: str) -> bool:
    """One PNG: a row per arm, before | after, accuracy over length x depth."""
    panels = []
    for arm in arms:
        for when, f in niah_files(work, arm):
            panels.append((arm, when, json.load(open(f)) if os.path.isfile(f) else None))
    if not any(p[2] for p in panels):
        return False
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    fig, axes = plt.subplots(len(arms), 2, figsize=(10, 3.6 * len(arms)), squeeze=False)
    for ax, (arm, when, r) in zip(axes.flat, panels):
        ax.set_title(f"{arm}: {when}" + (f" (iteration {r.get('iteration')})" if r else
                                         " (not run)"))
        if not r:
            ax.axis("off")
            continue
        cells = r["cells"]
        lengths = sorted({c["length"] for c in cells})
        depths = sorted({c["depth"] for c in cells})
        grid = np.full((len(depths), len(lengths)), np.nan)
        for c in cells:
            grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["accuracy"]
        ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(lengths)), [_len_label(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth (%)")
        for y in range(len(depths)):
            for x in range(len(lengths)):
                if not np.isnan(grid[y, x]):
                    dark = grid[y, x] < 0.2 or grid[y, x] > 0.85  # the ends of RdYlGn
                    ax.text(x, y, f"{grid[y, x]:.1f}", ha="center", va="center", fontsize=7,
                            color="white" if dark else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def window_table(work: str, arms: List[str], window: int, after: dict) -> List[str]:
    """The summary's split of every arm's NIAH by the Superlinear window: found / samples
    (answer log-prob) inside it and outside it, per length. Outside is what the search path
    must reach; the dense arm is split by the same distance for comparison."""
    rows = []
    for arm in arms:
        for when, f in niah_files(work, arm):
            if os.path.isfile(f):
                result = json.load(open(f, encoding="utf-8"))
                what = "import" if when == "before" else after.get(arm, {}).get("checkpoint",
                                                                                 "?")
                rows.append((arm, when, f"{what} ({result.get('iteration')})",
                             niah_by_window(result, window)))
    lengths = sorted({n for *_, split in rows for side, n in split if n is not None})
    head = ["arm", "when", "checkpoint (iteration)", f"inside (≤ {window:,} tokens)",
            *[f"outside, {_len_label(n)}" for n in lengths], "outside, all"]
    out = [f"### Inside and outside the Superlinear window ({window:,} tokens)", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(split, key):
        g = split.get(key)
        return f"{g[0]}/{g[1]} ({g[2]:.2f})" if g else ""

    for arm, when, what, split in rows:
        out.append("| " + " | ".join([arm, when, what, cell(split, ("in", None)),
                                      *[cell(split, ("out", n)) for n in lengths],
                                      cell(split, ("out", None))]) + " |")
    return out + ["", "Needles counted by their distance from the prompt's end; found / samples "
                  "and, in brackets, the mean answer log-prob.", ""]


def summary(work: str) -> str:
    info_path = os.path.join(work, "timings.json")
    info = json.load(open(info_path)) if os.path.isfile(info_path) else {}
    arms = info.get("arms") or []
    gpu = ""
    if os.path.isfile(os.path.join(work, "gpu.txt")):
        lines = [x.strip() for x in open(os.path.join(work, "gpu.txt")) if x.strip()]
        gpu = lines[1] if len(lines) > 1 else (lines[0] if lines else "")
    timings = info.get("timings", [])
    end = max([t["end_s"] for t in timings] or [0])
    m = info.get("model", {})
    out = ["# Evidence on one GPU: a Nano-shaped hybrid through the Superlinear recipe, "
           "4K → 8K → 16K", "",
           f"- mode: {info.get('mode', '?')}{f' on {gpu}' if gpu else ''}, "
           f"STAGE={info.get('stage', 'all')}; "
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; steps ended at "
           f"{end:.0f} s of the call (deadline {info.get('deadline_s', '?')} s)",
           f"- model: random NemotronH `{m.get('pattern', '?')}`, "
           f"{m.get('parameters', 0) / 1e6:.1f}M parameters, vocabulary {m.get('vocab', '?')}; "
           "imported (standard), base-trained on docs text + NIAH, exported to HF, imported "
           "again per arm (superlinear: surgery)", ""]
    # NIAH (STAGE=base has no arms: the base's own table below)
    after = info.get("after", {})
    if arms:
        out += ["## NIAH accuracy, before → after (greedy answer = the needle's value)", ""]
        table, lengths = [], set()
        for arm in arms:
            for when, f in niah_files(work, arm):
                r = niah_by_length(f)
                if r:
                    lengths |= set(r["lengths"])
                table.append((arm, when, r))
        lengths = sorted(lengths)
        head = ["arm", "when", "checkpoint (iteration)", *[_len_label(n) for n in lengths], "all",
                "answer log-prob"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for arm, when, r in table:
            if r is None:
                out.append(f"| {arm} | {when} | not run |" + " |" * (len(lengths) + 2))
                continue
            what = "import" if when == "before" else after.get(arm, {}).get("checkpoint", "?")
            cells = [f"{r['lengths'][n][0]:.2f}" if n in r["lengths"] else "" for n in lengths]
            out.append("| " + " | ".join([arm, when, f"{what} ({r['iteration']})", *cells,
                                          f"{r['accuracy']:.2f}", f"{r['logprob']:.2f}"]) + " |")
        out += ["", "Accuracy per length over every depth (0–100 %); cells per depth in the "
                "heatmaps (`niah-heatmaps.png`, and each eval's `niah.png`). The answer log-prob "
                "is the mean over the answer's tokens (the 7-digit value), a finer signal than "
                "accuracy.", ""]
        window = superlinear_window_of(work, arms)
        if window:
            out += window_table(work, arms, window, after)
    base_niah = niah_by_length(os.path.join(work, "base", "niah", "niah.json"))
    its = info.get("iterations", {})
    base_its = its.get("base", {})
    if base_niah:
        ls = sorted(base_niah["lengths"])
        out += [f"## The base's NIAH at short lengths (end of the "
                f"STAGE={base_rounds(base_its)['stage']} call: {rounds_label(base_its)})", "",
                "| " + " | ".join(["checkpoint (iteration)", *[_len_label(n) for n in ls],
                                   "all", "answer log-prob"]) + " |",
                "|" + "---|" * (len(ls) + 3),
                "| " + " | ".join([f"base ({base_niah['iteration']})",
                                   *[f"{base_niah['lengths'][n][0]:.2f}" for n in ls],
                                   f"{base_niah['accuracy']:.2f}",
                                   f"{base_niah['logprob']:.2f}"]) + " |", "",
                f"At {', '.join(_len_label(n) for n in ls)} the base "
                + ("retrieves." if base_niah["accuracy"] > 0 else
                   "does not retrieve (accuracy 0.00): its arms can show no recovery."), ""]
    # throughput
    out += ["## Training: tokens/s per stage", "",
            "| run | seq | iterations (planned) | tokens | train s | tokens/s "
            f"| loss, mean of first {LOSS_WINDOW} → last {LOSS_WINDOW} iterations |",
            "|---|---|---|---|---|---|---|"]

    def row(name, cfg_path, planned):
        if not os.path.isfile(cfg_path):
            return None
        cfg = _yaml(cfg_path)
        tokens = int(cfg["global-batch-size"]) * int(cfg["seq-length"])
        rows = metrics_rows(_local(cfg.get("metrics-file", ""), work))
        rate = throughput(rows, tokens)
        secs = sum(r["time_s"] for r in rows)
        fl = loss_first_last(rows)
        loss = "" if fl is None else (f"{fl[0]:.2f} → {fl[1]:.2f}"
                                      + (f" (means of {fl[2]})" if fl[2] < LOSS_WINDOW else ""))
        done = saved_iteration(_local(cfg["save"], work)) or 0
        return (f"| {name} | {cfg['seq-length']} | {done} ({planned}) | "
                f"{_count(len(rows) * tokens)} | {secs:.0f} | "
                f"{f'{rate:,.0f}' if rate else '—'} | {loss} |")

    carried = (f" (STAGE={base_rounds(base_its)['stage']} call, carried)"
               if base_its.get("carried") else "")
    r = row(f"base (dense, alone){carried}; {rounds_label(base_its)}",
            os.path.join(work, "base", "base.yaml"), base_its.get("planned", "?"))
    if r:
        out.append(r)
    for arm in arms:
        for k in (1, 2, 3):
            planned = (its.get("stages") or ["?"] * 3)[k - 1]
            r = row(f"{arm} stage {k}", os.path.join(work, "arms", arm, f"stage{k}.yaml"),
                    planned)
            if r:
                out.append(r)
    out += ["", "tokens/s: after the first tenth of the iterations (compilation), from the "
            "metrics files; " + ("the arms trained side by side on the one GPU, so each "
                                 "stage's tokens/s is its share, not the speed alone."
                                 if len(arms) > 1 else "one arm alone on the GPU."
                                 if arms else "the base alone on the GPU."), ""]
    if info.get("sizing"):
        s = info["sizing"]
        out.append(f"Stage iterations sized from the base's {s['rate']:,.0f} tokens/s × "
                   f"{s['share']} (arms side by side) and {s['free_s']} s left for stages.")
        out.append("")
    out += ["## Steps", "", "| step | start s | end s | status |", "|---|---|---|---|"]
    out += [f"| {t['step']} | {t['start_s']} | {t['end_s']} | {t['status']} |" for t in timings]
    notes = info.get("notes") or []
    for arm, a in after.items():
        if not a.get("complete", True):
            notes.append(f"{arm}: the clock stopped its stages; 'after' is {a['checkpoint']} "
                         f"at iteration {a['iteration']}")
    if notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def _local(path: str, work: str) -> str:
    """``path`` as written by a config of this run or of the STAGE=base call (whose WORK may
    have been elsewhere): itself when it exists, else its part from ``/base/`` on under
    ``work``."""
    if not path or os.path.exists(path) or "/base/" not in path:
        return path
    return os.path.join(work, "base", path.rsplit("/base/", 1)[1])


# what STAGE=base hands to STAGE=arms, relative to WORK/base: the exported HF folder (weights,
# config, tokenizer), the import's model.yaml (the trainer flags of the model's shape), the
# base's config, metrics, tracker, short NIAH and base.json; no Megatron checkpoint
BASE_MEMBERS = ("hf", "import/model.yaml", "base.yaml", "base.json", "train/metrics.jsonl",
                "train/latest_checkpointed_iteration.txt", "niah")
PART_BYTES = 15 * 2 ** 20


def _suffix(i: int) -> str:
    """split(1)'s suffixes: aa, ab, ..., zz."""
    return chr(ord("a") + i // 26) + chr(ord("a") + i % 26)


def bf16_weights(hf: str) -> int:
    """The HF folder's fp32 safetensors tensors rewritten as bf16 (config.json's dtype too), in
    place; the number of tensors cast. Nano's HF folder is bf16, and the arms train in bf16; an
    fp32 export (the checkpoint's dtype) would double the carried bytes."""
    import torch  # noqa: PLC0415
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    cast = 0
    for path in sorted(glob.glob(os.path.join(hf, "*.safetensors"))):
        tensors = load_file(path)
        if not any(t.dtype == torch.float32 for t in tensors.values()):
            continue
        cast += sum(t.dtype == torch.float32 for t in tensors.values())
        save_file({k: (t.to(torch.bfloat16) if t.dtype == torch.float32 else t).contiguous()
                   for k, t in tensors.items()}, path, metadata={"format": "pt"})
    cfg_path = os.path.join(hf, "config.json")
    if cast and os.path.isfile(cfg_path):
        cfg = json.load(open(cfg_path, encoding="utf-8"))
        for key in ("torch_dtype", "dtype"):
            if key in cfg:
                cfg[key] = "bfloat16"
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
    return cast


def pack_parts(folder: str, prefix: str, members=BASE_MEMBERS, part_bytes: int = PART_BYTES,
               max_parts: int = 2) -> List[str]:
    """``members`` of ``folder`` (those that exist; ``hf`` must) as one tar.gz split into
    PREFIXaa, PREFIXab, ... of ``part_bytes`` each (``cat PREFIX* | tar -xz`` restores them).
    More than ``max_parts`` parts (a device call carries 64 MiB in all) is an EvidenceError
    and leaves none behind. Returns the parts' paths."""
    if not os.path.isfile(os.path.join(folder, "hf", "config.json")):
        raise EvidenceError(f"pack-base: no exported HF folder {os.path.join(folder, 'hf')}")
    import io  # noqa: PLC0415

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for m in members:
            if os.path.exists(os.path.join(folder, m)):
                tar.add(os.path.join(folder, m), arcname=m)
    data = buf.getvalue()
    n = max(1, -(-len(data) // part_bytes))
    if n > max_parts:
        raise EvidenceError(f"pack-base: {len(data) / 2 ** 20:.1f} MiB packed = {n} parts of "
                            f"{part_bytes / 2 ** 20:g} MiB, over --max-parts {max_parts}: "
                            "shrink evidence.yaml's model")
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    paths = []
    for i in range(n):
        paths.append(prefix + _suffix(i))
        with open(paths[-1], "wb") as f:
            f.write(data[i * part_bytes:(i + 1) * part_bytes])
    return paths


def unpack_parts(parts: List[str], folder: str) -> List[str]:
    """pack_parts' parts (in name order, as split names them) unpacked into ``folder``; the
    names unpacked. A member outside ``folder`` or no parts is an EvidenceError."""
    if not parts:
        raise EvidenceError("unpack-base: no parts given (.nano-base.tgz.aa, ...)")
    import io  # noqa: PLC0415

    data = b"".join(open(p, "rb").read() for p in sorted(parts))
    os.makedirs(folder, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        names = tar.getnames()
        for m in tar.getmembers():
            if os.path.isabs(m.name) or ".." in m.name.split("/") or not (m.isfile() or m.isdir()):
                raise EvidenceError(f"unpack-base: member {m.name!r} is not a plain path "
                                    "under the base folder")
        tar.extractall(folder)
    return names


def _keep(rel: str) -> bool:
    """What the tarball holds: configs, logs, metrics, NIAH results and plots, HF configs and
    tokenizers; no checkpoints, weights or data."""
    parts = rel.split("/")
    if any(p.startswith("iter_") or p == "cache" for p in parts) or parts[0] == "data":
        return False
    if "niah" in parts[:-1]:  # the arms' links to the stages' NIAH data
        return False
    if rel.endswith((".bin", ".idx", ".safetensors", ".pt", ".distcp", ".npy")):
        return False
    if parts[-1] == "tokenizer.json" and parts[0] != "hf-random":  # copies of the one
        return False
    return True


def pack(work: str, tarball: Optional[str], summary_path: Optional[str]) -> str:
    text = summary(work)
    arms = json.load(open(os.path.join(work, "timings.json"))).get("arms", []) \
        if os.path.isfile(os.path.join(work, "timings.json")) else []
    try:
        if heatmaps(work, arms, os.path.join(work, "niah-heatmaps.png")):
            pass
    except Exception as e:  # noqa: BLE001 - a plot must not cost the summary
        text += f"\n(heatmaps not drawn: {e})\n"
    with open(os.path.join(work, "summary.md"), "w", encoding="utf-8") as f:
        f.write(text)
    if summary_path:
        shutil.copyfile(os.path.join(work, "summary.md"), summary_path)
    if tarball:
        name = os.path.basename(os.path.normpath(work))
        with tarfile.open(tarball, "w:gz") as tar:
            for dirpath, dirnames, filenames in os.walk(work):
                rel_dir = os.path.relpath(dirpath, work)
                dirnames[:] = [d for d in dirnames
                               if _keep(os.path.normpath(os.path.join(rel_dir, d))
                                        .replace(os.sep, "/") + "/x")]
                for fn in sorted(filenames):
                    rel = os.path.normpath(os.path.join(rel_dir, fn)).replace(os.sep, "/")
                    if _keep(rel):
                        tar.add(os.path.join(dirpath, fn), arcname=f"{name}/{rel}")
    return text


# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/nano_evidence.py", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("check", "run", "pack", "pack-base", "unpack-base"))
    p.add_argument("--parts", nargs="+", default=[],
                   help="unpack-base: the carried parts (.nano-base.tgz.a*)")
    p.add_argument("--stage", default="all", choices=("all", "base", "base-more", "arms"),
                   help="all (one call), base (prep + the base for the whole call, its short "
                        "NIAH), base-more (the same from the base unpacked into WORK/carried: "
                        "one more round), arms (the arms from the base unpacked into WORK/base); "
                        "unpack-base: base-more unpacks into WORK/carried, others WORK/base")
    p.add_argument("--out", default=None, help="pack-base: the parts' prefix "
                                               "($OUT/nano-base.tgz.)")
    p.add_argument("--max-parts", type=int, default=2, help="pack-base: at most (default 2)")
    p.add_argument("--bf16", action="store_true",
                   help="pack-base: fp32 weights of the HF folder cast to bf16 first (GPU runs)")
    p.add_argument("--arms", default="superlinear,standard")
    p.add_argument("--work", default=os.path.join("runs", "nano-evidence"))
    p.add_argument("--dry", action="store_true", help="CPU sizes (evidence.yaml's dry block)")
    p.add_argument("--t0", type=float, default=None, help="the call's start (epoch s)")
    p.add_argument("--deadline", type=float, default=None,
                   help="epoch s by which every step has ended (default t0 + 1 h)")
    p.add_argument("--warm-only", action="store_true",
                   help="prep and the compile warm-ups only (a Triton cache for the next call)")
    p.add_argument("--base-iters", type=int, default=None)
    p.add_argument("--stage-iters", default=None, help="A,B,C: the stages' train-iters")
    p.add_argument("--fixed-iters", action="store_true",
                   help="the files' train-iters, not sized to the clock")
    p.add_argument("--tarball", default=None)
    p.add_argument("--summary", default=None)
    args = p.parse_args(argv)
    try:
        settings = read_settings(RECIPE, args.dry)
        arms = parse_arms(args.arms, settings)
        check_base_niah(settings)
        if args.stage_iters is not None:
            bad = [x for x in args.stage_iters.split(",") if not x.strip().isdigit()]
            if bad or len(args.stage_iters.split(",")) != 3:
                raise EvidenceError(f"--stage-iters {args.stage_iters!r}: allowed three "
                                    "positive integers A,B,C")
        if args.command == "run":
            find_corpus()
    except EvidenceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "check":
        print(f"arms: {', '.join(arms)}")
        return 0
    if args.command == "pack":
        print(pack(os.path.abspath(args.work), args.tarball, args.summary))
        return 0
    if args.command in ("pack-base", "unpack-base"):
        base = os.path.join(os.path.abspath(args.work), "base")
        try:
            if args.command == "pack-base":
                if not args.out:
                    raise EvidenceError("pack-base: --out PREFIX is required")
                if args.bf16:
                    print(f"pack-base: {bf16_weights(os.path.join(base, 'hf'))} fp32 "
                          "tensors cast to bf16")
                paths = pack_parts(base, args.out, max_parts=args.max_parts)
                print(f"pack-base: {len(paths)} part(s), "
                      f"{sum(os.path.getsize(x) for x in paths) / 2 ** 20:.1f} MiB: "
                      + " ".join(paths))
            else:
                # base-more trains, exports and packs WORK/base anew: the carried one apart
                dest = (os.path.join(os.path.abspath(args.work), "carried")
                        if args.stage == "base-more" else base)
                names = unpack_parts(args.parts, dest)
                print(f"unpack-base: {len(names)} entries into {dest}")
        except (EvidenceError, OSError, tarfile.TarError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    return Run(args, settings, arms).run()


if __name__ == "__main__":
    sys.exit(main())
