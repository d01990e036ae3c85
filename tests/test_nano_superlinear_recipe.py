"""recipes/nemotron-3-nano-superlinear end to end on a tiny random NemotronH (CPU): the real stage
YAMLs, with the tiny model's shape, small lengths and a few steps laid over them in tmp_path,
through tools/curriculum.py: import with superlinear surgery -> stage 1 (256 tokens) -> stage 2
(512 tokens) on NIAH + LM text -> NIAH evaluation (2 lengths x 3 depths) -> export (skipped while
this checkout's export refuses superlinear slots). Bad stage configs fail before anything is
written.
"""

import json
import os
import sys

import pytest
import yaml

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
if not hasattr(transformers, "NemotronHConfig"):
    pytest.skip("NemotronH needs transformers >= 5.3", allow_module_level=True)

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.testing.convert import tiny_nemotron_h  # noqa: E402
from megatron_subq.testing.tokenizers import train_niah_bpe  # noqa: E402
from tools import curriculum  # noqa: E402

RECIPE = os.path.join(ROOT, "recipes", "nemotron-3-nano-superlinear")
CORPUS = os.environ.get("SUBQ_CORPUS") or os.path.join(ROOT, "..", "shared", "data",
                                                       "docs-corpus.jsonl.xz")
VOCAB = 2048
# the tiny model (megatron_subq/testing/convert.py: TINY_NEMOTRON_H) as trainer flags, and what a
# CPU run of one process needs instead of the cluster layout
TINY = {"hybrid-override-pattern": "M*E-ME", "num-layers": 6, "hidden-size": 32,
        "num-attention-heads": 4, "num-query-groups": 2, "kv-channels": 16,
        "ffn-hidden-size": 64, "mamba-num-heads": 4, "mamba-head-dim": 16,
        "mamba-state-dim": 16, "mamba-num-groups": 2, "num-experts": 4,
        "moe-ffn-hidden-size": 24, "moe-shared-expert-intermediate-size": 48,
        "moe-router-topk": 2, "superlinear-sw-index": 3,  # window 15: the search matters
        "moe-token-dispatcher-type": "allgather", "bf16": False,
        "tensor-model-parallel-size": 1, "sequence-parallel": False,
        "expert-model-parallel-size": 1, "context-parallel-size": 1,
        "use-distributed-optimizer": False, "overlap-grad-reduce": False,
        "overlap-param-gather": False, "recompute-activations": False,
        "micro-batch-size": 1, "global-batch-size": 1, "train-iters": 2, "lr-warmup-iters": 1,
        "num-workers": 0,
        "eval-iters": 0, "eval-interval": 1000, "log-interval": 1, "split": "100,0,0",
        "exit-signal-handler": False}


def _tokenizer(folder):
    """A 2000-token byte-level BPE of corpus sentences and the NIAH template (NIAH prompts of a
    few hundred tokens fit it)."""
    train_niah_bpe(CORPUS, folder, documents=60, vocab_size=2000, template_repeats=5)


def _stage(real, out, k, tok, lm, **over):
    with open(os.path.join(RECIPE, real), encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    cfg.update(TINY)
    cfg.update({"tokenizer-model": tok, "save": f"{out}/stage{k}",
                "load": f"{out}/import" if k == 1 else f"{out}/stage{k - 1}",
                "metrics-file": f"{out}/stage{k}/metrics.jsonl",
                "data-path": [0.5, lm, 0.5, f"{out}/niah/stage{k}_text_document"]})
    cfg.update(over)
    return cfg


def _write_curriculum(tmp, name, hf, stages, **spec_over):
    """Stage YAMLs + a curriculum file under tmp/name; the run's folder is tmp/name/run."""
    folder = os.path.join(tmp, name)
    os.makedirs(folder)
    entries = []
    for k, (cfg, lengths) in enumerate(stages, start=1):
        with open(os.path.join(folder, f"stage{k}.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
        entries.append({"config": f"stage{k}.yaml", "nodes": 1,
                        "niah": {"lengths": lengths, "samples-per-cell": 2, "seed": 100 + k}})
    spec = {"hf": hf, "out": os.path.join(folder, "run"),
            "import": {"save": os.path.join(folder, "run", "import"), "progress": False},
            "plan": {"gpus-per-node": 1}, "niah": {"depths": "0,50,100", "corpus": CORPUS},
            "stages": entries,
            "eval": {"lengths": "192,384", "depths": "0,50,100", "samples-per-cell": 1,
                     "seed": 9001, "corpus": CORPUS, "skip-documents": 100, "plot": False},
            "export": {"hf-out": os.path.join(folder, "run", "hf"), "progress": False}}
    spec.update(spec_over)
    path = os.path.join(folder, "curriculum.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
    return path


def _weights(folder):
    from megatron.core.dist_checkpointing import load_plain_tensors

    from megatron_subq.convert.api import one_process

    with one_process(1234):
        return {k: v for k, v in load_plain_tensors(folder).items()
                if isinstance(v, torch.Tensor) and not k.startswith("optimizer")}


def test_recipe_end_to_end_on_a_tiny_nemotron_h(tmp_path, capsys):
    tmp = str(tmp_path)
    hf = os.path.join(tmp, "hf")
    tiny_nemotron_h(vocab_size=VOCAB, max_position_embeddings=512).save_pretrained(hf)
    _tokenizer(hf)  # the import keeps it in import/hf_files, as Nano's own tokenizer files
    from tools import preprocess_data

    preprocess_data.main(["--input", CORPUS, "--max-documents", "40", "--output-prefix",
                          os.path.join(tmp, "lm"), "--tokenizer-type", "HuggingFaceTokenizer",
                          "--tokenizer-model", hf, "--workers", "1", "--no-progress"])
    lm = os.path.join(tmp, "lm_text_document")

    # the real curriculum's stages pass the static checks (the planner's verdict: the -m slow test)
    real = curriculum.read_curriculum(os.path.join(RECIPE, "curriculum.yaml"))
    assert curriculum.check_stages(real) == [] and len(real.stages) == 5
    assert [st.config["seq-length"] for st in real.stages] == [4096, 8192, 16384, 32768, 65536]

    # bad stage configs fail before anything is written, naming the stage file and the key
    out = os.path.join(tmp, "{name}", "run")
    tok = os.path.join(out, "import", "hf_files")

    def bad(name, k, **over):
        s1 = _stage("stage1-4k.yaml", out.format(name=name), 1, tok.format(name=name), lm,
                    **{"seq-length": 256, **(over if k == 1 else {})})
        s2 = _stage("stage2-8k.yaml", out.format(name=name), 2, tok.format(name=name), lm,
                    **{"seq-length": 512, **(over if k == 2 else {})})
        for key in [key for key, v in over.items() if v is None]:
            (s1 if k == 1 else s2).pop(key)
        path = _write_curriculum(tmp, name, hf, [(s1, [160, 192]), (s2, [192, 384])])
        assert curriculum.main(["run", path]) == 2
        err = capsys.readouterr().err
        assert not os.path.exists(out.format(name=name)), name
        return err

    err = bad("missing", 2, **{"train-iters": None})
    assert "stage2.yaml: missing key 'train-iters'" in err, err
    err = bad("shorter", 2, **{"seq-length": 256})
    assert "stage2.yaml: seq-length 256 does not increase" in err, err
    err = bad("chain", 2, load=os.path.join(tmp, "elsewhere"))
    assert "stage2.yaml: load" in err and "is not stage 1's save" in err, err
    err = bad("layout", 1, **{"tensor-model-parallel-size": 3})
    assert "stage1.yaml" in err and "--tensor-model-parallel-size" in err, err
    err = bad("knobs", 2, **{"superlinear-backward-factor": 4.0})
    assert "stage2.yaml: superlinear-backward-factor 4.0 differs from stage 1's" in err, err
    err = bad("mask", 2, **{"subq-loss-mask-data": True})  # the NIAH data are format train
    assert "stage2.yaml: subq-loss-mask-data true disagrees" in err, err

    # the curriculum: import -> 2 stages -> NIAH eval (export below)
    name = "good"
    o, t = out.format(name=name), tok.format(name=name)
    s1 = _stage("stage1-4k.yaml", o, 1, t, lm, **{"seq-length": 256})
    # stage 2's first step runs at LR 0 (warm-up from 0) and is saved: its weights are the
    # weights stage 2 started from
    s2 = _stage("stage2-8k.yaml", o, 2, t, lm, **{"seq-length": 512, "lr-warmup-iters": 1,
                                                  "lr-warmup-init": 0.0, "save-interval": 1})
    path = _write_curriculum(tmp, name, hf, [(s1, [160, 192]), (s2, [192, 384])])
    cur = curriculum.read_curriculum(path)
    done = curriculum.run(cur, steps=("import", "train", "eval"), log=lambda *a: None)
    assert done["stages"] == ["trained", "trained"]

    # the import: Q_s created, drawn from normal(0, initializer_range) like HF's q_proj
    model_yaml = yaml.safe_load(open(os.path.join(o, "import", "model.yaml")))
    assert model_yaml["attention-variant"] == "superlinear"
    assert model_yaml["init-method-std"] == pytest.approx(0.02)  # config.json initializer_range
    imported = _weights(os.path.join(o, "import", "iter_0000000"))
    qs = imported["decoder.layers.1.self_attention.linear_qs.weight"]
    assert abs(float(qs.std()) - 0.02) < 0.002 and abs(float(qs.mean())) < 0.002

    # stage 1 trained from the import; stage 2 from stage 1's weights, iteration restarted
    assert curriculum.saved_iteration(os.path.join(o, "stage1")) == 2
    assert curriculum.saved_iteration(os.path.join(o, "stage2")) == 2  # not 4: iterations restart
    log1 = open(os.path.join(o, "stage1", "stage1.log")).read()
    log2 = open(os.path.join(o, "stage2", "stage2.log")).read()
    assert os.path.join(o, "import") in log1 and os.path.join(o, "stage1") in log2
    rows = [json.loads(x) for x in open(os.path.join(o, "stage2", "metrics.jsonl"))]
    assert [r["iteration"] for r in rows if "lm_loss" in r][:1] == [1]
    end1 = _weights(os.path.join(o, "stage1", "iter_0000002"))
    start2 = _weights(os.path.join(o, "stage2", "iter_0000001"))
    compared = 0
    for key, value in end1.items():
        if key.endswith("expert_bias"):  # moved by token counts, not by the LR
            continue
        assert torch.equal(start2[key], value), key
        compared += 1
    assert compared > 20 and not torch.equal(end1["embedding.word_embeddings.weight"],
                                             imported["embedding.word_embeddings.weight"])

    # the import evaluates too (the "before" of tools/nano_evidence.py): its checkpoint names no
    # tokenizer, the one the import kept in hf_files is taken
    from tools import niah as niah_tool

    before = niah_tool.main(["eval", "--load", os.path.join(o, "import"), "--lengths", "192",
                             "--depths", "50", "--samples-per-cell", "1", "--corpus", CORPUS,
                             "--skip-documents", "100", "--output",
                             os.path.join(tmp, "before.json"), "--no-progress"])
    assert before["iteration"] == 0 and before["attention_variant"] == "superlinear"
    assert before["settings"]["tokenizer"] == "HuggingFaceTokenizer:" + os.path.join(
        o, "import", "hf_files")

    # the NIAH evaluation over 2 lengths x 3 depths
    result = done["eval"]
    assert [(c["length"], c["depth"]) for c in result["cells"]] == [
        (n, d) for n in (192, 384) for d in (0, 50, 100)]
    assert result["attention_variant"] == "superlinear" and result["iteration"] == 2

    # a re-run skips everything done
    again = curriculum.run(curriculum.read_curriculum(path), steps=("import", "train", "eval"),
                           log=lambda *a: None)
    assert again["stages"] == ["done", "done"]

    # export: the last stage to Hugging Face, with the shipped remote code (its logits against
    # the megatron model: tests/test_convert_superlinear_hf.py)
    curriculum.export_step(cur, log=lambda *a: None)
    hf_out = os.path.join(o, "hf")
    config = json.load(open(os.path.join(hf_out, "config.json")))
    assert config["auto_map"] and config["superlinear_backward_factor"] == 2.0
    assert any(n.startswith("modeling_") and n.endswith(".py") for n in os.listdir(hf_out))
    assert any(n.endswith(".safetensors") for n in os.listdir(hf_out))
    # the import's tokenizer goes with it (the stages' saves keep none)
    assert open(os.path.join(hf_out, "tokenizer.json")).read() == open(
        os.path.join(o, "import", "hf_files", "tokenizer.json")).read()


def test_stages_niah_with_the_loss_on_the_answers_only(tmp_path, capsys):
    """``niah.format: train-answer``: each stage's NIAH data is written with its loss-mask
    sidecar (1 on the answers only), the stages must read it (``subq-loss-mask-data: true``, a
    disagreement or an unknown format is refused before anything is written), and the shipped
    one-GPU curriculum uses it."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_subq.training.loss_mask_data import sidecar_prefix

    one_gpu = curriculum.read_curriculum(os.path.join(RECIPE, "one-gpu", "curriculum.yaml"))
    assert curriculum.niah_format(one_gpu) == "train-answer"
    assert curriculum.check_stages(one_gpu) == []
    assert all(st.config["subq-loss-mask-data"] is True for st in one_gpu.stages)

    tmp = str(tmp_path)
    hf = os.path.join(tmp, "hf")
    os.makedirs(hf)
    _tokenizer(hf)
    lm = os.path.join(tmp, "lm_text_document")  # not read: only the NIAH data step runs

    def write(name, fmt, masked):
        out = os.path.join(tmp, name, "run")
        stages = [(_stage("stage1-4k.yaml", out, 1, hf, lm, **{"seq-length": 256,
                                                              "subq-loss-mask-data": masked}),
                   [160, 192])]
        return _write_curriculum(tmp, name, hf, stages, niah={
            "depths": "0,50,100", "corpus": CORPUS, "format": fmt})

    for name, fmt, masked, msg in (
            ("unmasked", "train-answer", False, "subq-loss-mask-data false disagrees"),
            ("unknown", "jsonl", True, "niah.format 'jsonl'; allowed train, train-answer")):
        assert curriculum.main(["run", write(name, fmt, masked)]) == 2
        err = capsys.readouterr().err
        assert msg in err, err
        assert not os.path.exists(os.path.join(tmp, name, "run"))

    cur = curriculum.read_curriculum(write("good", "train-answer", True))
    assert curriculum.check_stages(cur) == []
    st = cur.stages[0]
    curriculum.niah_data_step(cur, st, log=lambda *a: None)
    prefix = cur.niah_prefix(st)
    tokens, mask = IndexedDataset(prefix), IndexedDataset(sidecar_prefix(prefix))
    assert len(tokens) == len(mask) == 2 * 3 * 2  # lengths x depths x samples per cell
    for i in range(len(tokens)):
        m = mask[i]
        assert len(m) == len(tokens[i]) and set(m.tolist()) <= {0, 1}
        assert 0 < int(m.sum()) < len(m) // 10 and m[-1] == 0  # the answer; EOD not counted
    logs = []
    curriculum.niah_data_step(cur, st, log=logs.append)  # done: skipped
    assert logs == [f"== stage 1 NIAH data: done ({prefix})"]


@pytest.mark.slow
def test_real_curriculum_plans_on_four_nodes():
    """The real stage files through the planner (layout and memory on 4 x 8 H100), both routings."""
    for overlay in (None, os.path.join(RECIPE, "extended.yaml")):
        cur = curriculum.read_curriculum(os.path.join(RECIPE, "curriculum.yaml"), overlay)
        plans = curriculum.validate(cur)
        assert [p.args.context_parallel_size for _, p, _ in plans] == [1, 1, 2, 4, 8]
        assert all(p.total_memory_gib < 79.1 for _, p, _ in plans)
