"""tools/gpu_nano_evidence.sh and tools/nano_evidence.py (issue 23, "Evidence on one GPU"): bad
arm names stop the script before anything is written; the one-GPU recipe files agree with the
model they describe and pass the curriculum's checks; and (-m slow, ~3-4 minutes on 2 cores) the
whole pipeline in its CPU dry mode: two arms, NIAH before and after each, tokens/s per stage,
one tarball and one summary. The two-call form: STAGE checks (exit 2 before anything is
written), the base's parts round trip, the evidence model's size bound, and (-m slow, ~3
minutes) STAGE=base chained into a STAGE=base-more call and the arms call through the
carried parts."""

import json
import os
import subprocess
import sys
import tarfile

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import curriculum  # noqa: E402
from tools import nano_evidence as ne  # noqa: E402

ONE_GPU = os.path.join(ROOT, "recipes", "nemotron-3-nano-superlinear", "one-gpu")
CORPUS = os.environ.get("SUBQ_CORPUS") or os.path.join(ROOT, "..", "shared", "data",
                                                       "docs-corpus.jsonl.xz")


def _script(tmp_path, *args, **env):
    """The script in the CPU dry mode with WORK, OUT and PARTS_DIR (where it looks for carried
    .nano-base.tgz.a*: an empty folder of the test unless given) under ``tmp_path``, so that
    parts a two-call run left in the repo root change nothing here."""
    parts = env.pop("PARTS_DIR", str(tmp_path / "parts"))
    os.makedirs(parts, exist_ok=True)
    full = dict(os.environ, WORK=str(tmp_path / "work"), OUT=str(tmp_path / "out"), DRY="1",
                SUBQ_CORPUS=CORPUS, PARTS_DIR=parts, **env)
    return subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_nano_evidence.sh"), *args],
                          cwd=ROOT, env=full, capture_output=True, text=True, timeout=1800)


def test_unknown_arm_fails_before_anything_runs(tmp_path, capsys):
    p = _script(tmp_path, "superlinear,dense")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "unknown arm 'dense'; allowed superlinear, standard" in p.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()
    settings = ne.read_settings()
    assert ne.parse_arms("standard", settings) == ["standard"]
    with pytest.raises(ne.EvidenceError, match="an arm named twice"):
        ne.parse_arms("standard,standard", settings)
    assert ne.main(["check", "--arms", " , "]) == 2
    assert "--arms ' , ': empty" in capsys.readouterr().err
    assert ne.main(["run", "--arms", "superlinear", "--stage-iters", "5,5"]) == 2
    assert "--stage-iters '5,5': allowed three positive integers" in capsys.readouterr().err


def _evidence_model_kwargs(settings):
    """evidence.yaml's model as transformers.NemotronHConfig arguments, and its pattern."""
    m = dict(settings["model"])
    pattern = m.pop("pattern")
    m.pop("seed")
    m["layers_block_type"] = [ne.SYMBOL_BLOCK[c] for c in pattern]
    m["vocab_size"] = settings["tokenizer"]["vocab-size"]
    return m, pattern


def test_one_gpu_recipe_files_agree():
    """The stage and base files carry evidence.yaml's model (as the converter reads its
    config.json), the stages chain 4K -> 8K -> 16K through the curriculum's checks, and the
    dense arm's copy drops nothing but the Superlinear knobs."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "NemotronHConfig"):
        pytest.skip("NemotronH needs transformers >= 5.3")
    from megatron_subq.convert.api import model_flags

    settings = ne.read_settings()
    m, pattern = _evidence_model_kwargs(settings)
    cfg = transformers.NemotronHConfig(**m).to_dict()
    cfg["architectures"] = ["NemotronHForCausalLM"]
    flags = {k.replace("_", "-"): v for k, v in model_flags(cfg).items()
             if k not in ("bf16", "fp16")}
    cur = curriculum.read_curriculum(os.path.join(ONE_GPU, "curriculum.yaml"))
    files = [st.config for st in cur.stages] + [ne._yaml(os.path.join(ONE_GPU, "base.yaml"))]
    for f in files:
        for key, value in flags.items():
            if key in f:
                assert f[key] == value, key
        assert f["hybrid-override-pattern"] == pattern and f["disable-mamba-mem-eff-path"]
    assert curriculum.check_stages(cur) == []
    assert [st.config["seq-length"] for st in cur.stages] == [4096, 8192, 16384]
    assert all(st.nodes == 1 for st in cur.stages)
    assert cur.spec["eval"]["lengths"] == "4096,8192,16384"
    # the arms are variants of the '*' slots only
    assert settings["arms"] == {"superlinear": {"attention-variant": "superlinear"},
                                "standard": {"attention-variant": "standard"}}
    dry = ne.read_settings(dry=True)
    assert [s["flags"]["seq-length"] for s in dry["dry-stages"]] == [256, 512, 1024]


def test_base_niah_format_and_loss_mask_flag_agree(tmp_path):
    """evidence.yaml's base.niah.format and base.yaml's subq-loss-mask-data: the shipped pair
    agrees (answer-only loss), and a disagreement or an unknown format stops the run naming
    both keys before anything is written."""
    settings = ne.read_settings()
    assert settings["base"]["niah"]["format"] == "train-answer"
    ne.check_base_niah(settings)
    base = ne._yaml(os.path.join(ONE_GPU, "base.yaml"))
    assert base["subq-loss-mask-data"] is True
    fake = tmp_path / "recipe"
    fake.mkdir()
    plain = {k: v for k, v in base.items() if k != "subq-loss-mask-data"}
    (fake / "base.yaml").write_text(yaml.safe_dump(plain))
    with pytest.raises(ne.EvidenceError, match="subq-loss-mask-data false disagree"):
        ne.check_base_niah(settings, recipe=str(fake))
    settings["base"]["niah"]["format"] = "train"
    ne.check_base_niah(settings, recipe=str(fake))
    settings["base"]["niah"]["format"] = "jsonl"
    with pytest.raises(ne.EvidenceError, match="allowed train, train-answer"):
        ne.check_base_niah(settings, recipe=str(fake))


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path):
    """The script's CPU dry mode: a tiny random NemotronH imported, base-trained, exported,
    imported again per arm (superlinear with surgery), three stages each, NIAH before and after;
    $OUT holds the tarball and the summary, nothing else."""
    p = _script(tmp_path, CALL_LIMIT="1700")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["nano-evidence.md", "nano-evidence.tgz"]
    text = (out / "nano-evidence.md").read_text()
    assert text in p.stdout  # printed too
    work = tmp_path / "work"
    names = tarfile.open(out / "nano-evidence.tgz").getnames()
    top = "work/"
    for arm in ("superlinear", "standard"):
        for when in ("before/niah.json", "run/eval/niah.json", "before/niah.png"):
            assert f"{top}arms/{arm}/{when}" in names, (arm, when)
        for k in (1, 2, 3):
            assert f"{top}arms/{arm}/run/stage{k}/metrics.jsonl" in names
            assert f"{top}arms/{arm}/stage{k}.yaml" in names
        # the after evaluation is the last stage's, through the curriculum's own eval step
        after = json.load(open(work / "arms" / arm / "run" / "eval" / "niah.json"))
        assert after["checkpoint"].endswith("stage3") and after["attention_variant"] == arm
        before = json.load(open(work / "arms" / arm / "before" / "niah.json"))
        assert before["iteration"] == 0 and before["attention_variant"] == arm
        assert [s["id"] for s in before["samples"]] == [s["id"] for s in after["samples"]]
        assert [(c["length"], c["depth"]) for c in after["cells"]] == [
            (n, d) for n in (256, 512, 1024) for d in (0, 50, 100)]
        # rows of the summary: before and after, and each stage with its tokens/s
        assert f"| {arm} | before | import (0) |" in text
        assert f"| {arm} | after | stage3 (2) |" in text
        for k in (1, 2, 3):
            row = next(x for x in text.splitlines() if x.startswith(f"| {arm} stage {k} |"))
            assert float(row.split("|")[6].replace(",", "")) > 0, row
        stage1 = yaml.safe_load(open(work / "arms" / arm / "stage1.yaml"))
        assert stage1["attention-variant"] == arm
        assert any(k.startswith("superlinear-") for k in stage1) == (arm == "superlinear")
    assert f"{top}niah-heatmaps.png" in names and f"{top}summary.md" in names
    assert f"{top}base/hf/config.json" in names and f"{top}hf-random/tokenizer.json" in names
    assert not [n for n in names if "/iter_" in n or n.endswith((".safetensors", ".bin", ".idx"))]
    # the superlinear arm's import made Q_s; the dense arm's has none
    yaml_s = yaml.safe_load(open(work / "arms" / "superlinear" / "run" / "import" / "model.yaml"))
    assert yaml_s["attention-variant"] == "superlinear"
    timings = json.load(open(work / "timings.json"))
    assert [t["step"].split(":")[0] for t in timings["timings"]] == [
        "prep (tokenizer, random NemotronH)", "base", "base", "base", "arms", "arms", "arms"]
    assert timings["after"]["superlinear"]["complete"] is True


def _metrics(path, losses):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"iteration": i, "lm_loss": loss, "time_s": 0.5,
                                "tokens_per_sec_per_gpu": 32.0}) + "\n")


def _run_yaml(work, rel, iters):
    path = work / rel
    os.makedirs(path.parent, exist_ok=True)
    save = work / os.path.dirname(rel) / "train"
    os.makedirs(save, exist_ok=True)
    (save / "latest_checkpointed_iteration.txt").write_text(str(iters))
    path.write_text(yaml.safe_dump({"global-batch-size": 2, "seq-length": 8, "save": str(save),
                                    "metrics-file": str(save / "metrics.jsonl")}))
    return save / "metrics.jsonl"


def test_summary_loss_column_averages_ten_iterations_at_each_end(tmp_path):
    """The summary's loss column: the mean of the first and of the last 10 iterations (all of
    them, said so, when fewer), not single iterations: the answer-only NIAH loss makes one
    iteration's loss swing (the base's round 3: iteration 859 4.21, 860 0.74, while the trainer's
    10-iteration means fell from 2.80 to 2.39)."""
    work = tmp_path / "work"
    # 30 iterations whose single first and last losses (9.0, 0.5) are far from their windows'
    # means: first 10 -> 3.0, last 10 -> 2.0
    first = [9.0] + [7.0 / 3.0] * 9
    last = [20.0 / 9.0] * 9 + [0.0]
    base_losses = first + [2.5] * 10 + last
    _metrics(str(_run_yaml(work, "base/base.yaml", 30)), base_losses)
    # a stage of 4 iterations: fewer than the window, averaged over all 4 at both ends
    _metrics(str(_run_yaml(work, "arms/standard/stage1.yaml", 4)), [4.0, 2.0, 1.0, 1.0])
    (work / "timings.json").write_text(json.dumps({
        "mode": "GPU", "stage": "arms", "arms": ["standard"], "timings": [],
        "iterations": {"base": {"planned": 30, "done": 30, "tokens_per_iter": 16},
                       "stages": [4, 4, 4]}}))
    text = ne.summary(str(work))
    lines = text.splitlines()
    head = next(x for x in lines if x.startswith("| run |"))
    assert head.endswith("| loss, mean of first 10 → last 10 iterations |"), head
    base = next(x for x in lines if x.startswith("| base (dense, alone)"))
    assert base.endswith("| 3.00 → 2.00 |"), base  # single iterations: 9.00 → 0.00
    stage = next(x for x in lines if x.startswith("| standard stage 1 |"))
    assert stage.endswith("| 2.00 → 2.00 (means of 4) |"), stage
    assert ne.loss_first_last([]) is None
    assert ne.loss_first_last([{"lm_loss": None}, {"lm_loss": 1.5}]) == (1.5, 1.5, 1)


def test_summary_splits_niah_by_the_superlinear_window(tmp_path):
    """The summary's window table: each arm's NIAH samples split by the needle's distance from
    the prompt's end, inside the Superlinear arm's window ((sw_index + 1)^2 - 1 = 15 tokens at
    sw_index 3) or outside it (per length and in all), for the dense arm too."""
    work = tmp_path / "work"

    def niah(arm, when, samples):
        folder = work / "arms" / arm / ("before" if when == "before" else "run/eval")
        folder.mkdir(parents=True, exist_ok=True)
        cells = [{"length": 64, "depth": 0, "accuracy": 0.5, "n": len(samples),
                  "mean_answer_logprob": -1.0}]
        (folder / "niah.json").write_text(json.dumps(
            {"iteration": 0 if when == "before" else 7, "accuracy": 0.5,
             "mean_answer_logprob": -1.0, "cells": cells,
             "samples": [{"length": n, "prompt_tokens": n, "needle_position": pos,
                          "correct": ok, "answer_logprob": lp}
                         for n, pos, ok, lp in samples]}))

    # distances 4, 15 (inside); 16, 40 at 64 tokens and 100 at 128 (outside)
    niah("superlinear", "before", [(64, 60, True, -0.5), (64, 49, True, -0.5),
                                   (64, 48, False, -3.0), (64, 24, False, -5.0),
                                   (128, 28, False, -4.0)])
    niah("superlinear", "after", [(64, 60, True, -0.5), (64, 49, False, -1.5),
                                  (64, 48, True, -0.2), (64, 24, False, -2.0),
                                  (128, 28, True, -0.1)])
    niah("standard", "before", [(64, 60, True, -0.1), (128, 28, True, -0.3)])
    imp = work / "arms" / "superlinear" / "run" / "import"
    imp.mkdir(parents=True)
    (imp / "model.yaml").write_text("attention-variant: superlinear\n"
                                    "superlinear-search-power: 0.5\nsuperlinear-sw-index: 3\n")
    (work / "timings.json").write_text(json.dumps(
        {"mode": "GPU", "stage": "arms", "arms": ["superlinear", "standard"], "timings": [],
         "after": {"superlinear": {"checkpoint": "stage1"}}}))
    assert ne.superlinear_window_of(str(work), ["standard", "superlinear"]) == 15
    lines = ne.summary(str(work)).splitlines()
    assert "### Inside and outside the Superlinear window (15 tokens)" in lines
    head = next(x for x in lines if x.startswith("| arm | when | checkpoint (iteration) | inside"))
    assert head.endswith("| inside (≤ 15 tokens) | outside, 64 | outside, 128 | outside, all |")
    rows = [x for x in lines if x.startswith("| superlinear |") and "/" in x.split("|")[4]]
    assert rows == [
        "| superlinear | before | import (0) | 2/2 (-0.50) | 0/2 (-4.00) | 0/1 (-4.00) "
        "| 0/3 (-4.00) |",
        "| superlinear | after | stage1 (7) | 1/2 (-1.00) | 1/2 (-1.10) | 1/1 (-0.10) "
        "| 2/3 (-0.77) |"]
    dense = [x for x in lines if x.startswith("| standard | before | import (0) | 1/1")]
    assert dense == ["| standard | before | import (0) | 1/1 (-0.10) |  | 1/1 (-0.30) "
                     "| 1/1 (-0.30) |"]


def test_compile_warm_up_config_is_a_valid_trainer_config(tmp_path):
    """The warm-up runs (Triton's compiles while the data is prepared: the first base step took
    99 s on an H200) get base.yaml's model on mock data, 2 steps of one sequence, nothing loaded
    or saved, the arm's variant in the '*' slots; the trainer's own parser accepts the config. On
    the CPU (DRY) there is none."""
    import argparse

    from megatron_subq.training.arguments import parse_args

    settings = ne.read_settings()
    args = argparse.Namespace(work=str(tmp_path / "work"), t0=None, deadline=None)
    run = ne.Run(args, dict(settings, dry=False), ["superlinear", "standard"])
    os.makedirs(run.hf_random)
    started = []
    run.job = lambda name, cmd, log=None, nice=0: started.append((name, cmd)) or name
    assert run.warm_up("superlinear") == "warm-superlinear"
    (name, cmd), = started
    path = cmd[cmd.index("--config") + 1]
    cfg = yaml.safe_load(open(path))
    assert cfg["attention-variant"] == "superlinear" and cfg["mock-data"] is True
    assert not set(ne.Run.WARM_DROP) & set(cfg)
    base = yaml.safe_load(open(os.path.join(ONE_GPU, "base.yaml")))
    # one step of the base's micro-batch: the kernels the base compiles (Triton specialises
    # integers equal to 1, so a micro-batch of 1 would compile others)
    assert cfg["train-iters"] == 2 and cfg["micro-batch-size"] == base["micro-batch-size"] > 1
    assert cfg["global-batch-size"] == cfg["micro-batch-size"]
    assert cfg["hybrid-override-pattern"] == base["hybrid-override-pattern"]
    assert cfg["seq-length"] == base["seq-length"]
    parsed = parse_args(["--is-hybrid-model", "--config", path], world_size=1, check_files=False)
    assert parsed.mock_data and parsed.attention_variant == "superlinear"
    run.dry = True
    assert run.warm_up("standard") is None and len(started) == 1


@pytest.mark.parametrize("exits, want", [((0, 0), 0), ((0, 3), 1)])
def test_warm_only_runs_each_variant_once_in_turn(tmp_path, exits, want):
    """--warm-only: the compile warm-ups of 'standard' and then of every other arm's variant,
    one at a time (each waited for before the next starts), nothing else; exit 1 when one
    failed."""
    import argparse

    settings = ne.read_settings()
    args = argparse.Namespace(work=str(tmp_path / "work"), t0=None, deadline=None,
                              warm_only=True)
    run = ne.Run(args, dict(settings, dry=False), ["superlinear", "standard"])
    os.makedirs(run.hf_random)
    events = []

    class FakeJob:
        def __init__(self, name, rc):
            self.name, self.rc, self.stopped = name, None, ""
            self._rc = rc

        def poll(self):
            self.rc = self._rc
            events.append(("poll", self.name))
            return self.rc

        def stop(self, grace, log):
            pass

    rcs = iter(exits)
    run.job = lambda name, cmd, log=None, nice=0: events.append(("start", name)) or FakeJob(
        name, next(rcs))
    assert run.warm_only() == want
    starts = [e for e in events if e[0] == "start"]
    assert starts == [("start", "warm-standard"), ("start", "warm-superlinear")]
    # the second warm-up starts only after the first was polled to its end
    assert events.index(("poll", "warm-standard")) < events.index(("start", "warm-superlinear"))
    assert run.timings[-1]["step"].startswith("compile warm-ups only")
    assert run.timings[-1]["status"] == ("ok" if want == 0 else "exits [0, 3]")


# ------------------------------------------------------------------------------------------------
# two device calls: STAGE=base, then STAGE=arms with the base carried as .nano-base.tgz.a*
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage, err", [
    ("dense", "STAGE=dense: allowed base, base-more, arms"),
    ("arms", "STAGE=arms needs the base's parts .nano-base.tgz.aa"),
    ("base-more", "STAGE=base-more needs the base's parts .nano-base.tgz.aa"),
])
def test_bad_stage_fails_before_anything_runs(tmp_path, stage, err):
    """An unknown STAGE, or STAGE=arms or base-more without the carried parts in the repo root,
    stops the script with exit 2 naming the variable, before WORK or OUT exist."""
    p = _script(tmp_path, STAGE=stage)
    assert p.returncode == 2, p.stdout + p.stderr
    assert err in p.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as e:  # the driver's own flag: argparse's choices
        ne.main(["run", "--stage", "both"])
    assert e.value.code == 2


def _fake_base(folder, weight_bytes):
    """A WORK/base as STAGE=base leaves it: the HF folder (incompressible weights of
    ``weight_bytes``), the import's model.yaml, base.json, and a checkpoint that must not
    travel."""
    hf = folder / "hf"
    hf.mkdir(parents=True)
    (hf / "model.safetensors").write_bytes(os.urandom(weight_bytes))
    (hf / "config.json").write_text('{"architectures": ["NemotronHForCausalLM"]}')
    (hf / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    (folder / "import").mkdir()
    (folder / "import" / "model.yaml").write_text("hidden-size: 256\n")
    (folder / "import" / "iter_0000000").mkdir()
    (folder / "import" / "iter_0000000" / "x.distcp").write_bytes(b"x" * 100)
    (folder / "base.json").write_text('{"base": {"rate": 1.0}}')
    (folder / "train").mkdir()
    (folder / "train" / "latest_checkpointed_iteration.txt").write_text("7")
    (folder / "train" / "iter_0000007").mkdir()
    return folder


def _tree(folder):
    out = {}
    for dirpath, _, files in os.walk(folder):
        for fn in files:
            path = os.path.join(dirpath, fn)
            out[os.path.relpath(path, folder)] = open(path, "rb").read()
    return out


def test_base_parts_round_trip(tmp_path):
    """pack_parts splits WORK/base's carried members into parts of the given size (named as
    split names them, so `cat parts | tar -xz` works too) and unpack_parts restores them byte for
    byte; checkpoints stay behind; more parts than allowed is an error that leaves none."""
    src = _fake_base(tmp_path / "src", 3 * 2 ** 20)
    paths = ne.pack_parts(str(src), str(tmp_path / "out" / "nano-base.tgz."),
                          part_bytes=2 ** 20, max_parts=4)
    assert [os.path.basename(p) for p in paths] == [
        "nano-base.tgz.aa", "nano-base.tgz.ab", "nano-base.tgz.ac", "nano-base.tgz.ad"]
    assert all(os.path.getsize(p) == 2 ** 20 for p in paths[:-1])
    dest = tmp_path / "dest"
    ne.unpack_parts(list(reversed(paths)), str(dest))  # name order, whatever order given
    want = {k: v for k, v in _tree(src).items() if "iter_" not in k}
    assert _tree(dest) == want and "hf/model.safetensors" in want
    assert "import/model.yaml" in want and "train/latest_checkpointed_iteration.txt" in want
    # the shell's way: cat + tar
    shell = tmp_path / "shell"
    shell.mkdir()
    subprocess.run(f"cat {' '.join(paths)} | tar -xz -C {shell}", shell=True, check=True)
    assert _tree(shell) == want
    # over the limit: an error, no parts left
    with pytest.raises(ne.EvidenceError, match="over --max-parts 2"):
        ne.pack_parts(str(src), str(tmp_path / "over" / "p."), part_bytes=2 ** 20, max_parts=2)
    assert not (tmp_path / "over").exists() or not os.listdir(tmp_path / "over")
    with pytest.raises(ne.EvidenceError, match="no parts"):
        ne.unpack_parts([], str(dest))
    with pytest.raises(ne.EvidenceError, match="no exported HF folder"):
        ne.pack_parts(str(tmp_path / "dest" / "import"), str(tmp_path / "x."))


def test_base_rounds_count_across_calls(tmp_path):
    """base.json's rounds: a base.json without them (the GPU base of 2026-11-27) is round 1
    with its done iterations; a base-more call after it trains round 2 on NIAH seed + 1 and
    counts the cumulative iterations and tokens of both; the labels say so."""
    import argparse

    old = {"planned": 1060, "tokens_per_iter": 65536, "seq": 4096, "budget_s": 313,
           "done": 895, "rate": 211240.1}
    assert ne.base_rounds(old) == {"round": 1, "cumulative_iters": 895,
                                   "cumulative_tokens": 895 * 65536, "stage": "base"}
    assert ne.rounds_label(old) == "round 1, cumulative 895 iterations / 58.65M tokens"
    settings = ne.read_settings()
    seed = settings["base"]["niah"]["seed"]
    args = argparse.Namespace(work=str(tmp_path / "work"), t0=None, deadline=None,
                              stage="base-more")
    run = ne.Run(args, dict(settings, dry=False), ["superlinear", "standard"])
    assert run.base_src == run.tok == str(tmp_path / "work" / "carried" / "hf")
    (tmp_path / "work" / "carried" / "hf").mkdir(parents=True)
    (tmp_path / "work" / "carried" / "hf" / "config.json").write_text("{}")
    (tmp_path / "work" / "carried" / "base.json").write_text(json.dumps({"base": old}))
    run._start_data = lambda jobs: None
    run._prep_more()
    assert run.round == 2 and run.niah_base_seed() == seed + 1
    new = {**old, "done": 900, **run._rounds(900, 65536)}
    assert new["round"] == 2 and new["stage"] == "base-more" and new["niah_seed"] == seed + 1
    assert new["cumulative_iters"] == 1795 and new["cumulative_tokens"] == 1795 * 65536
    assert [(r["round"], r["iterations"], r["niah_seed"]) for r in new["rounds"]] == [
        (1, 895, None), (2, 900, seed + 1)]
    assert ne.rounds_label(new) == "round 2, cumulative 1,795 iterations / 117.64M tokens"
    # STAGE=base (and one call) keep evidence.yaml's seed: round 1
    first = ne.Run(argparse.Namespace(work=str(tmp_path / "w1"), t0=None, deadline=None,
                                      stage="base"), dict(settings, dry=False), ["standard"])
    assert first.round == 1 and first.niah_base_seed() == seed
    assert first._rounds(895, 65536)["cumulative_iters"] == 895
    # no carried folder: a clear error
    (tmp_path / "work" / "carried" / "hf" / "config.json").unlink()
    with pytest.raises(ne.EvidenceError, match="STAGE=base-more: no carried base"):
        run._prep_more()


def test_evidence_model_fits_two_parts():
    """evidence.yaml's model (with the 8,192-token tokenizer) stays <= 13.5M parameters, so
    its bf16 weights (+ tokenizer) fit 2 parts of 15 MiB even uncompressed, and it keeps Nano's
    shape: the pattern, MoE with a shared expert, GQA with head_dim 128, Mamba-2."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "NemotronHConfig"):
        pytest.skip("NemotronH needs transformers >= 5.3")
    import torch

    m, pattern = _evidence_model_kwargs(ne.read_settings())
    assert pattern == "MEMEM*EMEM*E"
    assert m["head_dim"] == 128 and m["num_attention_heads"] > m["num_key_value_heads"] > 0
    assert m["moe_shared_expert_intermediate_size"] > 0 and m["n_routed_experts"] > 1
    assert m["mamba_num_heads"] > 0 and m["ssm_state_size"] > 0
    assert m["vocab_size"] == 8192
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.NemotronHConfig(**m))
    params = sum(p.numel() for p in model.parameters())
    assert params <= 13.5e6, params
    assert 2 * params + 2 * 2 ** 20 <= 2 * ne.PART_BYTES  # bf16 + a tokenizer, before gzip
    # the yaml's comment states the count
    text = open(os.path.join(ONE_GPU, "evidence.yaml"), encoding="utf-8").read()
    assert f"{params:,} parameters" in text


def _carry(out, parts):
    """The parts of a call's $OUT copied into ``parts`` (the next call's PARTS_DIR) as
    .nano-base.tgz.a*, over those of the call before (removed first)."""
    os.makedirs(parts, exist_ok=True)
    for f in os.listdir(parts):
        os.remove(os.path.join(parts, f))
    for f in sorted(os.listdir(out)):
        if f.startswith("nano-base.tgz.a"):
            subprocess.run(["cp", str(out / f), os.path.join(parts, "." + f)], check=True)


@pytest.mark.slow
def test_dry_two_calls_chain(tmp_path):
    """STAGE=base, then STAGE=base-more, then STAGE=arms in the CPU dry mode: call A leaves the
    base's parts (and no arm), its summary says whether the base retrieves; with the parts
    copied as .nano-base.tgz.a* into the next call's PARTS_DIR, call M (a fresh WORK) trains
    the carried base one more round (no random model, no tokenizer; NIAH of another seed) and
    leaves new parts whose base.json says round 2 and the iterations of both rounds; with those
    copied over A's, call B imports both arms from the round-2 base without training a base,
    and its summary has before/after rows per arm."""
    a = _script(tmp_path / "a", CALL_LIMIT="1700", STAGE="base")
    assert a.returncode == 0, a.stdout[-4000:] + a.stderr[-4000:]
    out_a = tmp_path / "a" / "out"
    assert sorted(os.listdir(out_a)) == ["nano-base.tgz.aa", "nano-evidence.md",
                                        "nano-evidence.tgz"]
    text_a = (out_a / "nano-evidence.md").read_text()
    assert "STAGE=base" in text_a and "The base's NIAH at short lengths" in text_a
    assert not (tmp_path / "a" / "work" / "arms").exists()
    meta_a = json.load(open(tmp_path / "a" / "work" / "base" / "base.json"))["base"]
    seed = ne.read_settings(dry=True)["base"]["niah"]["seed"]
    assert meta_a["round"] == 1 and meta_a["niah_seed"] == seed and meta_a["stage"] == "base"
    assert meta_a["cumulative_iters"] == meta_a["done"] > 0
    parts = str(tmp_path / "carried")
    _carry(out_a, parts)
    m = _script(tmp_path / "m", CALL_LIMIT="1700", STAGE="base-more", PARTS_DIR=parts)
    assert m.returncode == 0, m.stdout[-4000:] + m.stderr[-4000:]
    out_m = tmp_path / "m" / "out"
    _carry(out_m, parts)
    b = _script(tmp_path / "b", CALL_LIMIT="1700", PARTS_DIR=parts)  # no STAGE: parts mean arms
    # call M: the carried base trained further, packed again
    assert sorted(os.listdir(out_m)) == ["nano-base.tgz.aa", "nano-evidence.md",
                                        "nano-evidence.tgz"]
    work_m = tmp_path / "m" / "work"
    assert not (work_m / "hf-random").exists()  # no random model, no tokenizer training
    assert (work_m / "carried" / "hf" / "config.json").is_file()
    imp_log = (work_m / "logs" / "base-import.log").read_text()
    assert f"--hf {work_m / 'carried' / 'hf'}" in imp_log
    assert yaml.safe_load(open(work_m / "base" / "base.yaml"))["tokenizer-model"] == str(
        work_m / "carried" / "hf")
    meta_m = json.load(open(work_m / "base" / "base.json"))["base"]
    assert meta_m["round"] == 2 and meta_m["stage"] == "base-more"
    assert meta_m["niah_seed"] == seed + 1 != meta_a["niah_seed"]
    assert f"--seed {seed + 1} " in (work_m / "logs" / "prep-niah-base.log").read_text()
    assert meta_m["cumulative_iters"] == meta_a["done"] + meta_m["done"]
    assert meta_m["cumulative_tokens"] == (meta_a["done"] + meta_m["done"]) * meta_m[
        "tokens_per_iter"]
    assert [r["round"] for r in meta_m["rounds"]] == [1, 2]
    text_m = (out_m / "nano-evidence.md").read_text()
    label = (f"round 2, cumulative {meta_m['cumulative_iters']:,} iterations / "
             f"{ne._count(meta_m['cumulative_tokens'])} tokens")
    assert "STAGE=base-more" in text_m and label in text_m
    assert f"The base's NIAH at short lengths (end of the STAGE=base-more call: {label})" \
        in text_m
    timings_m = json.load(open(work_m / "timings.json"))
    assert [t["step"].split(":")[0] for t in timings_m["timings"]] == [
        "prep (the carried base, round 2)", "base", "base", "base"]
    # call B: the arms from the round-2 base
    assert b.returncode == 0, b.stdout[-4000:] + b.stderr[-4000:]
    assert "STAGE=arms: the carried base's parts" in b.stdout
    work_b = tmp_path / "b" / "work"
    assert (work_b / "base" / "hf" / "config.json").is_file()
    assert json.load(open(work_b / "base" / "base.json"))["base"] == meta_m
    assert not (work_b / "hf-random").exists()  # no random model, no base import or training
    assert not (work_b / "logs" / "base-import.log").exists()
    assert not [d for d in os.listdir(work_b / "base" / "train") if d.startswith("iter_")]
    text_b = (tmp_path / "b" / "out" / "nano-evidence.md").read_text()
    assert "STAGE=arms" in text_b and f"(STAGE=base-more call, carried); {label}" in text_b
    for arm in ("superlinear", "standard"):
        assert f"| {arm} | before | import (0) |" in text_b
        assert f"| {arm} | after | stage3 (2) |" in text_b
    timings = json.load(open(work_b / "timings.json"))
    assert [t["step"].split(":")[0] for t in timings["timings"]] == [
        "prep (the carried base)", "arms", "arms", "arms"]
    # the arms imported the carried folder
    cur = yaml.safe_load(open(work_b / "arms" / "standard" / "curriculum.yaml"))
    assert cur["hf"] == str(work_b / "base" / "hf")


def test_bf16_weights_casts_fp32_only(tmp_path):
    """pack-base --bf16 (GPU runs): the HF folder's fp32 tensors become bf16 (config.json says
    so), other dtypes stay, the values are the bf16 roundings; a bf16 folder is left alone."""
    import torch
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    w = torch.randn(64, 32)
    save_file({"w": w, "i": torch.arange(4)}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text('{"torch_dtype": "float32"}')
    assert ne.bf16_weights(str(hf)) == 1
    t = load_file(str(hf / "model.safetensors"))
    assert t["w"].dtype == torch.bfloat16 and torch.equal(t["w"], w.to(torch.bfloat16))
    assert t["i"].dtype == torch.int64
    assert json.load(open(hf / "config.json"))["torch_dtype"] == "bfloat16"
    assert ne.bf16_weights(str(hf)) == 0
