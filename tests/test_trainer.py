"""examples/pretrain_gpt.py end to end on the CPU: real data, TP=2 + SP with torchrun, exact resume,
an interrupted save, resharding to TP=1, tools/evaluate.py, and every registered variant.

Process launches are few on purpose (each costs seconds of imports): one torchrun run of 30
iterations (A), one torchrun run resuming A's copy from iteration 20 (B), and one single-process
run of the remaining checks (TP=1 reload, evaluate.py, a crash inside a save, the variants).
"""

import glob
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq import VARIANTS  # noqa: E402
from megatron_subq.distributed import free_port  # noqa: E402
from megatron_subq.testing import run_distributed  # noqa: E402
from megatron_subq.testing.cases import trainer_flags  # noqa: E402
from megatron_subq.training import arguments  # noqa: E402
from megatron_subq.training.checkpointing import read_tracker  # noqa: E402

CORPUS = os.environ.get("SUBQ_CORPUS") or os.path.join(ROOT, "..", "shared", "data",
                                                       "docs-corpus.jsonl.xz")
HAVE_MISTRAL = importlib.util.find_spec("mistral_common") is not None

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style",
        "cosine", "--lr-warmup-iters", "3", "--split", "90,10,0", "--num-workers", "0",
        "--eval-iters", "2", "--log-interval", "5", "--seed", "1234"]



def _torchrun(argv, log_path, nproc=2, timeout=400, script=("examples", "pretrain_gpt.py")):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           os.path.join(ROOT, *script)] + argv
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                              timeout=timeout)
    text = open(log_path).read()
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{text[-6000:]}"
    return text


def _metrics(path):
    train, valid = {}, {}
    for line in open(path):
        record = json.loads(line)
        if "lm_loss" in record:
            train[record["iteration"]] = record
        else:
            valid[record["iteration"]] = record["valid_loss"]
    return train, valid


def corpus_slice(work, documents: int):
    """The first ``documents`` of the real corpus preprocessed into ``work/docs`` with the
    Mistral tokenizer (or a tiny SentencePiece model trained here when mistral-common is
    missing). Returns (preprocess_data's summary, the tokenizer model)."""
    from test_preprocess import corpus_texts, train_tiny_sentencepiece

    from tools import preprocess_data

    assert os.path.isfile(CORPUS), f"the corpus is missing: {CORPUS}"
    model = "mistral" if HAVE_MISTRAL else train_tiny_sentencepiece(
        str(work), [t[:20000] for t in corpus_texts(20)])
    out = preprocess_data.main(["--input", CORPUS, "--max-documents", str(documents),
                                "--output-prefix", str(work / "docs"), "--tokenizer-type",
                                "GPTSentencePieceTokenizer", "--tokenizer-model", model,
                                "--workers", "2", "--no-progress"])
    return out, model


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A slice of the real corpus preprocessed with the Mistral tokenizer (or a tiny
    SentencePiece model trained here when mistral-common is missing)."""
    work = tmp_path_factory.mktemp("trainer")
    out, model = corpus_slice(work, 120)
    heldout = work / "heldout.jsonl"
    import lzma

    with lzma.open(CORPUS, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(123)][120:]
    heldout.write_text("".join(lines))
    flags = ["--data-path", out["prefixes"]["text"], "--tokenizer-type",
             "GPTSentencePieceTokenizer", "--tokenizer-model", model]
    return {"work": work, "flags": flags, "heldout": str(heldout), "model": model}


@pytest.fixture(scope="module")
def run_a(data):
    """30 iterations, TP=2 + SP, distributed optimizer, saves at 10, 20, 30."""
    save = data["work"] / "ckpt_a"
    log = _torchrun(TINY + data["flags"] + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
        "--train-iters", "30", "--save", str(save), "--save-interval", "10", "--eval-interval",
        "10", "--metrics-file", str(data["work"] / "a.jsonl"), "--peak-tflops-per-gpu", "1.0"],
        data["work"] / "a.log")
    train, valid = _metrics(data["work"] / "a.jsonl")
    return {"save": str(save), "log": log, "train": train, "valid": valid}


def test_log_lines_and_loss_falls(run_a):
    log, train = run_a["log"], run_a["train"]
    lines = [ln for ln in log.splitlines() if " iteration " in ln and "consumed samples" in ln]
    assert len(lines) == 6  # every --log-interval 5
    for key in ("consumed samples:", "elapsed time per iteration (ms):", "learning rate:",
                "lm loss:", "grad norm:", "number of skipped iterations:",
                "number of nan iterations:", "tokens per second per GPU:",
                "throughput per GPU (TFLOP/s/GPU):", "MFU:", "peak CPU RSS (GB):"):
        assert key in lines[-1], key
    assert "validation loss at iteration 30 | lm loss value:" in log and "lm loss PPL:" in log
    assert sorted(train) == list(range(1, 31)) and sorted(run_a["valid"]) == [10, 20, 30]
    first = sum(train[i]["lm_loss"] for i in range(1, 4)) / 3
    last = sum(train[i]["lm_loss"] for i in range(28, 31)) / 3
    assert last < first - 0.5, (first, last)
    assert read_tracker(run_a["save"]) == 30


def test_resume_after_interrupted_save_is_bitwise_exact(run_a, data):
    """B = A's checkpoints 10 and 20 + the debris of a save of 30 that died midway (shards
    partly written, tracker still 20). B resumes from 20 and must reproduce A's iterations
    21-30 and its validation loss bit for bit, then commit its own save of 30."""
    b = data["work"] / "ckpt_b"
    b.mkdir()
    for it in (10, 20):
        shutil.copytree(os.path.join(run_a["save"], f"iter_{it:07d}"), b / f"iter_{it:07d}")
    (b / "latest_checkpointed_iteration.txt").write_text("20\n")
    debris = b / "iter_0000030.partial"
    shutil.copytree(os.path.join(run_a["save"], "iter_0000030"), debris)
    shards = sorted(glob.glob(str(debris / "*.distcp")))
    assert shards
    with open(shards[0], "r+b") as f:
        f.truncate(os.path.getsize(shards[0]) // 2)
    for name in (".metadata", "metadata.json"):
        if (debris / name).exists():
            (debris / name).unlink()

    log = _torchrun(TINY + data["flags"] + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
        "--train-iters", "30", "--load", str(b), "--save", str(b), "--save-interval", "10",
        "--eval-interval", "10", "--metrics-file", str(data["work"] / "b.jsonl")],
        data["work"] / "b.log")
    assert "loaded checkpoint at iteration 20" in log
    train_b, valid_b = _metrics(data["work"] / "b.jsonl")
    assert sorted(train_b) == list(range(21, 31))
    for it in range(21, 31):
        a, bb = run_a["train"][it], train_b[it]
        assert (bb["lm_loss"], bb["grad_norm"], bb["lr"], bb["consumed_samples"]) == \
            (a["lm_loss"], a["grad_norm"], a["lr"], a["consumed_samples"]), it
    assert valid_b[30] == run_a["valid"][30]
    assert read_tracker(str(b)) == 30 and (b / "iter_0000030").is_dir()
    assert not debris.exists()


@pytest.mark.slow
def test_resume_dp_reshardable_optimizer_state(data):
    """DP = 2, distributed optimizer saved with --no-dist-ckpt-optim-fully-reshardable (its
    per-DP-rank layout): a run resumed from iteration 2 repeats the uninterrupted run's
    iterations 3-4 bit for bit. It once failed twice: with fp32 parameters the load copied into
    views of the model's parameters with autograd on (an error), and Adam's step count came back
    as 0 (iteration 4 differed)."""
    flags = TINY + data["flags"] + ["--use-distributed-optimizer",
                                    "--no-dist-ckpt-optim-fully-reshardable", "--train-iters", "4",
                                    "--save-interval", "2", "--eval-interval", "100"]
    runs = {}
    for name, extra in (("straight", []), ("first", ["--exit-interval", "2"])):
        save = data["work"] / f"dpr_{name}"
        _torchrun(flags + ["--save", str(save), "--metrics-file",
                           str(data["work"] / f"dpr_{name}.jsonl")] + extra,
                  data["work"] / f"dpr_{name}.log")
        runs[name] = save
    log = _torchrun(flags + ["--load", str(runs["first"]), "--save", str(runs["first"]),
                             "--metrics-file", str(data["work"] / "dpr_resumed.jsonl")],
                    data["work"] / "dpr_resumed.log")
    assert "loaded checkpoint at iteration 2" in log
    straight, _ = _metrics(data["work"] / "dpr_straight.jsonl")
    resumed, _ = _metrics(data["work"] / "dpr_resumed.jsonl")
    assert sorted(resumed) == [3, 4]
    for it in (3, 4):
        assert resumed[it]["lm_loss"] == straight[it]["lm_loss"], it


def _overlap_param_gather_runs(flags, work):
    """On 2 ranks: 4 iterations saving at 2 and 4, then a run resumed from a copy of the save
    of iteration 2."""
    import torch.distributed as dist

    from megatron_subq.training import pretrain
    from megatron_subq.training.checkpointing import write_tracker

    straight, resumed = os.path.join(work, "opg_straight"), os.path.join(work, "opg_resumed")
    pretrain(flags + ["--save", straight, "--save-interval", "2", "--metrics-file",
                      straight + ".jsonl"])
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(straight, "iter_0000002"),
                        os.path.join(resumed, "iter_0000002"))
        write_tracker(resumed, 2)
    dist.barrier()
    return pretrain(flags + ["--load", resumed, "--metrics-file", resumed + ".jsonl"])[
        "loaded_iteration"]


def test_resume_with_overlap_param_gather_is_bitwise_exact(tmp_path):
    """DP = 2, --overlap-param-gather, bf16: the distributed optimizer's step writes only each
    rank's shard of the bf16 weights and the others arrive in the next forward, so a save right
    after a step must gather them first. It once saved them one step stale: the resumed run
    differed from iteration 3 on. (fp32 weights hide the bug: the loaded main parameters are
    views of them.)"""
    flags = TINY + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
                    "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                    "--overlap-param-gather", "--train-iters", "4", "--eval-iters", "0",
                    "--eval-interval", "100"]
    loaded = run_distributed(_overlap_param_gather_runs, world_size=2,
                             args=(flags, str(tmp_path)))
    assert loaded == [2, 2]
    straight, _ = _metrics(tmp_path / "opg_straight.jsonl")
    resumed, _ = _metrics(tmp_path / "opg_resumed.jsonl")
    assert sorted(straight) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    for it in (3, 4):
        assert (resumed[it]["lm_loss"], resumed[it]["grad_norm"]) == \
            (straight[it]["lm_loss"], straight[it]["grad_norm"]), it


# ---- single-process checks (one spawned process) -------------------------------------------
def _single_process_checks(tiny, flags, a_save, heldout, crash_dir, variant_runs):
    import megatron_subq.training.checkpointing as ckpt
    from megatron_subq.training import pretrain
    from tools import evaluate

    out = {}
    # the TP=2 + SP checkpoint of iteration 20, resharded to TP=1
    out["tp1"] = pretrain(tiny + flags + ["--load", a_save, "--ckpt-step", "20",
                                          "--skip-train"])
    out["evaluate"] = evaluate.main(["--load", a_save, "--input", heldout, "--ckpt-step", "30"])
    from megatron_subq.training.tokenizer import build_tokenizer

    tok = build_tokenizer(flags[flags.index("--tokenizer-type") + 1],
                          flags[flags.index("--tokenizer-model") + 1])
    out["heldout_tokens"] = sum(len(tok.tokenize(json.loads(line)["text"])) + 1
                                for line in open(heldout) if line.strip()) - 1

    # a crash inside the save of iteration 4: the shards are partly written, then the process
    # "dies" (an exception escapes) before the commit
    real_save = ckpt.dist_checkpointing.save

    def crashing_save(state, folder, *args, **kwargs):
        real_save(state, folder, *args, **kwargs)
        if folder.endswith("iter_0000004.partial"):
            shard = sorted(glob.glob(os.path.join(folder, "*.distcp")))[0]
            with open(shard, "r+b") as f:
                f.truncate(10)
            raise RuntimeError("simulated crash during save")

    crash = tiny + flags + ["--train-iters", "4", "--save", crash_dir, "--save-interval", "2",
                            "--eval-interval", "100", "--eval-iters", "0"]
    ckpt.dist_checkpointing.save = crashing_save
    try:
        pretrain(crash)
        out["crash_raised"] = False
    except RuntimeError as e:
        out["crash_raised"] = "simulated crash" in str(e)
    finally:
        ckpt.dist_checkpointing.save = real_save
    out["tracker_after_crash"] = read_tracker(crash_dir)
    out["dirs_after_crash"] = sorted(os.listdir(crash_dir))
    out["resumed"] = pretrain(crash + ["--load", crash_dir])
    out["tracker_after_resume"] = read_tracker(crash_dir)
    out["dirs_after_resume"] = sorted(os.listdir(crash_dir))

    # bf16 (Float16Module + fp32 main params) with activation recomputation, full and selective
    out["bf16_recompute"] = {
        mode: pretrain(tiny + flags + ["--bf16", "--seq-length", "32", "--global-batch-size", "2",
                                       "--train-iters", "4", "--eval-iters", "0",
                                       "--eval-interval", "100"] + extra)["iterations"]
        for mode, extra in (("full", ["--recompute-granularity", "full"]),
                            ("selective", ["--recompute-activations"]))}

    # every registered variant: 5 iterations through the trainer
    out["variants"] = {}
    for name, extra in variant_runs:
        summary = pretrain(tiny + flags + ["--seq-length", "32",
                                           "--global-batch-size", "2", "--train-iters", "5",
                                           "--eval-iters", "0", "--eval-interval", "100"]
                           + extra)
        out["variants"][name] = summary["iterations"]
    return out


@pytest.fixture(scope="module")
def single(run_a, data):
    # each variant's tiny settings (megatron_subq.testing.cases), as flags
    variant_runs = [(name, trainer_flags(name)) for name in sorted(VARIANTS)]
    [result] = run_distributed(_single_process_checks, world_size=1, args=(
        TINY, data["flags"], run_a["save"], data["heldout"], str(data["work"] / "crash"),
        variant_runs))
    return result


def test_checkpoint_loads_at_tp1_with_the_same_validation_loss(single, run_a):
    assert single["tp1"]["loaded_iteration"] == 20
    assert single["tp1"]["valid"][20] == pytest.approx(run_a["valid"][20], rel=1e-5)


def test_evaluate_tool_perplexity(single):
    ev = single["evaluate"]
    assert ev["iteration"] == 30 and ev["tokens"] == single["heldout_tokens"]
    assert math.isfinite(ev["loss"]) and ev["perplexity"] == pytest.approx(math.exp(ev["loss"]))


def test_evaluate_at_pp2_reshards_and_matches_tp1(single, run_a, data):
    """tools/evaluate.py under torchrun at PP=2 on the TP=2 + SP checkpoint: the layers are
    resharded over pipeline stages and the perplexity matches the TP=1 evaluation."""
    out = data["work"] / "eval_pp2.json"
    log = _torchrun(["--load", run_a["save"], "--input", data["heldout"], "--ckpt-step", "30",
                     "--output", str(out), "--pipeline-model-parallel-size", "2"],
                    data["work"] / "eval_pp2.log", script=("tools", "evaluate.py"))
    assert "resharding checkpoint from (TP, PP)=(2, 1) to (1, 2)" in log
    pp2, tp1 = json.loads(out.read_text()), single["evaluate"]
    assert pp2["tokens"] == tp1["tokens"]
    assert pp2["loss"] == pytest.approx(tp1["loss"], rel=1e-5)


def test_crash_inside_save_keeps_previous_checkpoint(single):
    assert single["crash_raised"]
    assert single["tracker_after_crash"] == 2
    assert "iter_0000004" not in single["dirs_after_crash"]
    assert "iter_0000004.partial" in single["dirs_after_crash"]
    assert single["resumed"]["loaded_iteration"] == 2
    assert sorted(single["resumed"]["iterations"]) == [3, 4]
    assert single["tracker_after_resume"] == 4
    assert "iter_0000004" in single["dirs_after_resume"]
    assert "iter_0000004.partial" not in single["dirs_after_resume"]


def test_bf16_with_activation_recomputation(single):
    for mode, losses in single["bf16_recompute"].items():
        assert sorted(losses) == [1, 2, 3, 4], mode
        assert all(math.isfinite(v) for v in losses.values()), (mode, losses)


def test_every_registered_variant_trains_5_iterations(single):
    assert sorted(single["variants"]) == sorted(VARIANTS)
    for name, losses in single["variants"].items():
        assert sorted(losses) == [1, 2, 3, 4, 5], name
        assert all(math.isfinite(v) for v in losses.values()), (name, losses)


# ---- flags (no processes) ---------------------------------------------------------------------
MIN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3",
       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def _error(argv, capsys, world_size=1):
    with pytest.raises(SystemExit) as e:
        arguments.parse_args(argv, world_size=world_size)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_every_variant_knob_is_a_flag():
    parser = arguments.build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    for field in arguments.variant_fields():
        assert "--" + field.name.replace("_", "-") in flags, field.name
    variant = next(a for a in parser._actions if "--attention-variant" in a.option_strings)
    assert set(variant.choices) == set(VARIANTS)
    assert "SubqTransformerConfig" in parser.format_help()


def test_config_file_and_command_line_override(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("num-layers: 4\nhidden_size: 128\nsequence-parallel: true\n"
                   "tensor_model_parallel_size: 2\nlr: 0.5\n")
    args = arguments.parse_args(["--config", str(cfg)] + MIN[4:] + ["--num-attention-heads", "4",
                                                                    "--lr", "0.25"], world_size=2)
    assert (args.num_layers, args.hidden_size, args.lr) == (4, 128, 0.25)
    assert args.sequence_parallel and args.tensor_model_parallel_size == 2
    assert args.global_batch_size == 2 and args.ffn_hidden_size == 320  # derived as Megatron-LM
    js = tmp_path / "r.json"
    from test_data_checks import write_indexed_dataset  # --data-path must exist

    x = write_indexed_dataset(tmp_path / "x", [64] * 1000)
    js.write_text(json.dumps({"attention_variant": "asa", "asa_rank": 8, "data_path": [x]}))
    args = arguments.parse_args(["--config", str(js)] + MIN[:-5] + ["--tokenizer-type",
                                                                    "NullTokenizer",
                                                                    "--vocab-size", "9"])
    assert args.attention_variant == "asa" and args.asa_rank == 8 and args.data_path == [x]


def test_bad_flags_fail_at_start_naming_the_flag(tmp_path, capsys):
    assert "--tensor-model-parallel-size=2" in _error(
        MIN + ["--tensor-model-parallel-size", "2"], capsys, world_size=3)
    assert "--global-batch-size=5" in _error(MIN + ["--global-batch-size", "5"], capsys)
    assert "--bf16 conflicts with --fp16" in _error(MIN + ["--bf16", "--fp16"], capsys)
    assert "--mock-data conflicts" in _error(MIN + ["--data-path", "x"], capsys)
    assert "--lr-warmup-fraction conflicts" in _error(
        MIN + ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"], capsys)
    assert "--attention-variant" in _error(MIN + ["--attention-variant", "nope"], capsys)
    assert "--save-interval needs --save" in _error(MIN + ["--save-interval", "2"], capsys)
    assert "--num-query-groups=3" in _error(MIN + ["--num-query-groups", "3"], capsys)
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layerz: 3\n")
    assert "unknown key 'num_layerz'" in _error(["--config", str(bad)] + MIN, capsys)


def test_pack_documents_cuts_after_every_eod_and_at_sample_ends():
    import torch

    from megatron_subq.training.trainer import pack_documents

    eod = 2
    tokens = torch.tensor([[5, 6, eod, 7], [eod, 8, 9, eod]])
    batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(2, 4),
             "position_ids": torch.arange(4).expand(2, 4)}
    row, params = pack_documents(batch, eod)
    assert params.cu_seqlens_q.tolist() == [0, 3, 4, 5, 8] and params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32
    assert row["tokens"].tolist() == [[5, 6, eod, 7, eod, 8, 9, eod]]
    assert row["labels"].shape == row["loss_mask"].shape == (1, 8)


def test_reset_attention_mask_trains_at_tp2_sp_and_pp2(data):
    """--reset-attention-mask through the trainer: packed micro-batches train at TP=2 + SP and at
    PP=2, whose stages exchange [b*s, 1, h] activations (the two layouts initialise differently,
    so their losses are not compared; tests/test_packed_sequences.py checks the math)."""
    runs = {}
    save = data["work"] / "ckpt_packed"
    for name, layout in (("tp2sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--save", str(save)]),
                         ("pp2", ["--pipeline-model-parallel-size", "2"])):
        metrics = data["work"] / f"packed_{name}.jsonl"
        _torchrun(TINY + data["flags"] + layout + [
            "--attention-variant", "asa", "--asa-rank", "8", "--reset-attention-mask",
            "--seq-length", "256", "--train-iters", "3", "--lr-warmup-iters", "1",
            "--eval-iters", "0", "--eval-interval", "100", "--metrics-file", str(metrics)],
            data["work"] / f"packed_{name}.log")
        runs[name] = {i: r["lm_loss"] for i, r in _metrics(metrics)[0].items()}
    for name, losses in runs.items():
        assert sorted(losses) == [1, 2, 3], name
        assert all(math.isfinite(v) and 5.0 < v < 12.0 for v in losses.values()), (name, losses)
    # tools/evaluate.py evaluates such a checkpoint packed too (its stored flags), unless told not
    # to: the held-out windows cross document ends, so the two losses differ
    evals = {}
    for name, extra in (("packed", []), ("unpacked", ["--no-reset-attention-mask"])):
        out = data["work"] / f"eval_packed_{name}.json"
        _torchrun(["--load", str(save), "--input", data["heldout"], "--output", str(out)] + extra,
                  data["work"] / f"eval_packed_{name}.log", nproc=1, script=("tools", "evaluate.py"))
        evals[name] = json.loads(out.read_text())["loss"]
    assert math.isfinite(evals["packed"]) and evals["packed"] != evals["unpacked"]


def test_reset_attention_mask_needs_packing_variants(capsys):
    err = _error(MIN + ["--reset-attention-mask", "--attention-variant", "static_emb_qk"], capsys)
    assert "--reset-attention-mask: the variant(s) static_emb_qk do not take packed" in err
    assert "allowed with it: approx, asa, mlp, nonapprox, ppa, sas, standard, superlinear" in err
    err = _error(MIN + ["--reset-attention-mask", "--attention-variant", "asa", "--layer-pattern",
                        "asa,rnd_emb_qk"], capsys)
    assert "variant(s) rnd_emb_qk do not" in err
    arguments.parse_args(MIN + ["--reset-attention-mask", "--attention-variant", "ppa"])


def test_bad_variant_knob_names_its_flag(capsys):
    from megatron_subq.training.trainer import build_config

    args = arguments.parse_args(MIN + ["--attention-variant", "asa", "--asa-rank", "99"],
                                world_size=1)
    with pytest.raises(SystemExit):
        build_config(args)
    assert "--asa-rank" in capsys.readouterr().err


def test_flops_formulas():
    from megatron_subq import SubqTransformerConfig
    from megatron_subq.training import flops

    cfg = SubqTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                num_query_groups=2, ffn_hidden_size=128)
    L, V = 32, 256
    h, H, G, D, F = 64, 4, 2, 16, 128
    per_layer = (2 * L * h * (H * D + 2 * G * D) + 2 * L * H * D * h + 2 * L * h * F * 3
                 + 4 * (L * (L + 1) // 2) * H * D)
    expected = 3 * 8 * (2 * (per_layer) + 2 * L * h * V)
    assert flops.flops_per_iteration(cfg, L, V, global_batch_size=8) == expected
    # PPA: p = 1 is full causal attention, p = 0 the window of w + 1 tokens
    assert flops.ppa_pairs(L, 1.0, 4) == L * (L + 1) // 2
    assert flops.ppa_pairs(L, 0.0, 4) == sum(min(i, 4) + 1 for i in range(L))
    assert flops.ppa_pairs(100, 0.5, 0) == 100 + sum(100 - j * j for j in range(1, 10))
