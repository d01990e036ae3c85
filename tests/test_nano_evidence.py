"""tools/gpu_nano_evidence.sh and tools/nano_evidence.py (issue 23, "Evidence on one GPU"): bad
arm names stop the script before anything is written; the one-GPU recipe files agree with the
model they describe and pass the curriculum's checks; and (-m slow, ~3-4 minutes on 2 cores) the
whole pipeline in its CPU dry mode: two arms, NIAH before and after each, tokens/s per stage,
one tarball and one summary."""

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
    full = dict(os.environ, WORK=str(tmp_path / "work"), OUT=str(tmp_path / "out"), DRY="1",
                SUBQ_CORPUS=CORPUS, **env)
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


def test_one_gpu_recipe_files_agree():
    """The stage and base files carry evidence.yaml's model (as the converter reads its
    config.json), the stages chain 4K -> 8K -> 16K through the curriculum's checks, and the
    dense arm's copy drops nothing but the Superlinear knobs."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "NemotronHConfig"):
        pytest.skip("NemotronH needs transformers >= 5.3")
    from megatron_subq.convert.api import model_flags

    settings = ne.read_settings()
    m = dict(settings["model"])
    pattern = m.pop("pattern")
    m.pop("seed")
    m["layers_block_type"] = [ne.SYMBOL_BLOCK[c] for c in pattern]
    m["vocab_size"] = settings["tokenizer"]["vocab-size"]
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
