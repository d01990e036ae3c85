"""tools/bench_decode.py on the CPU: a tiny hybrid with superlinear and standard in its '*' slots,
two contexts of a few hundred tokens, a few decode steps. The JSON has every field, positive; the
greedy token after the chunked prefill is the argmax of ``scoring.full_logits`` on the same
prompt (the benchmark times a working decode); bad arguments fail naming their flag before
anything is built."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tools import bench_decode  # noqa: E402

TINY = ["--hybrid-override-pattern", "M*EM-EM*", "--num-layers", "8", "--hidden-size", "64",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "16",
        "--ffn-hidden-size", "128", "--mamba-num-heads", "8", "--mamba-head-dim", "16",
        "--mamba-state-dim", "16", "--mamba-num-groups", "2", "--num-experts", "4",
        "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "64",
        "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--squared-relu", "--position-embedding-type", "none",
        "--vocab-size", "256"]
# a window of 3 keys and spans reaching forward: anchors and spans are used at these lengths
ARMS = "slp=superlinear:superlinear_sw_index=1:superlinear_forward_factor=0.5,standard"
@pytest.fixture(autouse=True)
def _no_dynamo(monkeypatch):
    """megatron's MoE helpers are torch.compile'd (jit_fuser): compiling them for each new
    shape is most of this tiny model's CPU time, and changes nothing measured here."""
    monkeypatch.setattr(torch._dynamo.config, "disable", True)


CONTEXTS = (150, 260)  # 2 and 3 prefill chunks, the last one partial


def _argv(tmp_path, *extra):
    return ["--contexts", ",".join(map(str, CONTEXTS)), "--variants", ARMS,
            "--prefill-chunk", "128", "--decode-steps", "2", "--warmup-steps", "1",
            "--layer-steps", "1", "--batch-size", "2", "--verify-upto", "1000",
            "--json", str(tmp_path / "decode.json"), *extra, "--", *TINY]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU (fp32) path")
def test_bench_decode_tiny_hybrid(tmp_path, capsys):
    out = bench_decode.main(_argv(tmp_path))
    data = json.loads((tmp_path / "decode.json").read_text())
    assert data["results"] == json.loads(json.dumps(out["results"]))
    meta = data["meta"]
    assert meta["host"] == "hybrid" and meta["pattern"] == "M*EM-EM*" and meta["baseline"] == \
        "standard" and meta["cuda_graph"] is False
    assert [a["layer_variants"] for a in meta["arms"]] == [
        [None, "superlinear", None, None, None, None, None, "superlinear"],
        [None, "standard", None, None, None, None, None, "standard"]]
    rows = data["results"]
    assert [(r["context"], r["arm"]) for r in rows] == [
        (c, a) for c in CONTEXTS for a in ("slp", "standard")]
    for r in rows:
        for key in ("prefill_s", "prefill_tok_s", "prefill_chunk_ms_first",
                    "prefill_chunk_ms_last", "prefill_chunk_ms_median", "decode_s",
                    "decode_tok_s", "ms_per_step", "step_ms_median", "host_enqueue_ms_median",
                    "attention_ms_per_step", "decode_speedup_vs_baseline",
                    "prefill_speedup_vs_baseline", "parameters", "warmup_s"):
            assert r[key] > 0, (key, r)
        assert r["batch"] == 2 and r["decode_steps"] == 2 and r["prefill_chunk"] == 128
        assert [x["layer"] for x in r["attention_layers"]] == [2, 8]
        assert all(x["layer_ms"] > 0 and x["core_ms"] > 0 for x in r["attention_layers"])
        assert r["verify"]["match"], r["verify"]
        assert r["first_tokens"] == r["verify"]["full_argmax"]
    assert all(r["decode_speedup_vs_baseline"] == 1.0 for r in rows if r["arm"] == "standard")
    printed = capsys.readouterr().out
    assert "| context | arm | prefill tok/s | decode tok/s" in printed
    _check_first_tokens_outside_the_tool(_argv(tmp_path), rows)


def _check_first_tokens_outside_the_tool(argv, rows):
    """Independently of the tool's own --verify: the same model and prompt rebuilt from the
    tool's plan, one full forward (``scoring.full_logits``), its last argmax against the JSON's
    greedy tokens after the prefill."""
    import megatron_subq as subq
    from megatron_subq.inference import full_logits

    plan = bench_decode.plan(argv)
    subq.init_single_process(plan.seed)
    try:
        for arm in plan.arms:
            model = bench_decode._build(plan, arm)
            for length in CONTEXTS:
                ref = full_logits(model, bench_decode._prompt(plan, arm, length))
                row = next(r for r in rows if r["arm"] == arm.label and r["context"] == length)
                assert row["first_tokens"] == ref[:, -1].argmax(dim=-1).tolist(), row
    finally:
        subq.destroy_single_process()


@pytest.mark.parametrize("extra, flag", [
    (["--variants", "nope,standard"], "--variants: unknown variant 'nope'"),
    (["--variants", "rnd_emb_qk"], "--variants: 'rnd_emb_qk' cannot decode"),
    (["--variants", "superlinear:superlinear_topk=zero"], "--superlinear-topk"),
    (["--contexts", "256,-4"], "--contexts '-4' is invalid"),
    (["--contexts", "1.5K"], "--contexts '1.5K' is invalid"),
    (["--decode-steps", "0"], "--decode-steps '0' is invalid"),
    (["--baseline", "dense"], "--baseline 'dense': no such arm"),
    (["--decode-cuda-graph", "yes"], "--decode-cuda-graph 'yes' is invalid: allowed off, on, "
                                     "both"),
    (["--decode-cuda-graph", "on", "--variants", "standard"],
     "--decode-cuda-graph on: no arm of variant 'superlinear'"),
    (["--decode-cuda-graph", "both", "--variants", "slp=superlinear,slp-graph=standard"],
     "--decode-cuda-graph both: the captured twin of arm 'slp' would be labelled 'slp-graph'"),
    (["--position-embedding-type", "learned_absolute", "--max-position-embeddings", "256"],
     "--contexts 260: with the decode steps 265 positions, more than the model's learned "
     "position table (--max-position-embeddings 256)"),
])
def test_bad_arguments_name_their_flag(tmp_path, extra, flag):
    argv = _argv(tmp_path)
    cut = argv.index("--")
    argv = argv[:cut] + extra + argv[cut:] if extra[0] in ("--variants", "--contexts",
                                                           "--decode-steps", "--baseline",
                                                           "--decode-cuda-graph") \
        else argv + extra
    with pytest.raises(bench_decode.BenchError, match=None) as e:
        bench_decode.plan(argv)
    assert flag in str(e.value), str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only refusals")
@pytest.mark.parametrize("extra, flag", [
    (["--device", "cuda"], "--device cuda: no CUDA device here"),
    (["--profile"], "--profile: times CUDA kernels and needs a GPU"),
    (["--", "--bf16"], "--bf16: needs a GPU"),
])
def test_gpu_only_options_are_refused_on_the_cpu(tmp_path, extra, flag, capsys):
    argv = _argv(tmp_path)
    argv = argv + extra[1:] if extra[0] == "--" else extra + argv
    with pytest.raises(SystemExit) as e:
        bench_decode.main(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "decode.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU (fp32) path")
def test_load_a_checkpoint_and_swap_its_variant(tmp_path):
    """--load: the checkpoint's model (a 2-layer GPT with superlinear); the standard arm keeps
    its matching weights (every one but linear_qs) and still decodes what full_logits says."""
    from megatron_subq.training import pretrain

    save = str(tmp_path / "ckpt")
    pretrain(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--attention-variant", "superlinear", "--superlinear-sw-index", "1",
              "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
              "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
              "NullTokenizer", "--vocab-size", "95", "--eval-iters", "0", "--num-workers", "0",
              "--save", save, "--save-interval", "1"])
    out = bench_decode.main(["--load", save, "--contexts", "90", "--variants",
                             "superlinear,standard", "--prefill-chunk", "64", "--decode-steps",
                             "1", "--warmup-steps", "0", "--layer-steps", "1", "--verify-upto",
                             "90"])
    assert out["meta"]["load"] == save and out["meta"]["host"] == "gpt"
    assert [a["layer_variants"] for a in out["meta"]["arms"]] == [["superlinear"] * 2,
                                                                  ["standard"] * 2]
    assert all(r["verify"]["match"] and r["decode_tok_s"] > 0 for r in out["results"])
    with pytest.raises(bench_decode.BenchError, match="--load: the model comes from the "):
        bench_decode.plan(["--load", save, "--", "--num-layers", "2"])
    with pytest.raises(bench_decode.BenchError, match="--load '/nonexistent'"):
        bench_decode.plan(["--load", "/nonexistent"])


GPT_TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--kv-channels", "16", "--ffn-hidden-size", "128",
            "--vocab-size", "256", "--superlinear-sw-index", "1", "--superlinear-forward-factor",
            "0.5"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU (fp32) path")
def test_decode_cuda_graph_both_adds_the_planned_twin(tmp_path):
    """``--decode-cuda-graph both``: each superlinear arm runs eager (LABEL) and through the
    decode plan (LABEL-graph; on the CPU the plan uncaptured, its kernels in the interpreter:
    ``subq_impl=kernel``). Context 15: the steps' lengths 16..19 cross the bucket boundary 16.
    Both arms give the same greedy token after the prefill; the twin's steps all went through
    the plan, the eager arm's none; no CUDA graph on the CPU. ``on`` keeps the labels."""
    arms = "slp=superlinear:subq_impl=kernel,standard"
    argv = ["--contexts", "15", "--variants", arms, "--prefill-chunk", "none",
            "--decode-steps", "2", "--warmup-steps", "1", "--layer-steps", "1",
            "--decode-cuda-graph", "both", "--json", str(tmp_path / "d.json"), "--", *GPT_TINY]
    out = bench_decode.main(argv)
    assert out["meta"]["decode_cuda_graph"] == "both" and out["meta"]["cuda_graph"] is False
    rows = {r["arm"]: r for r in out["results"]}
    assert list(rows) == ["slp", "slp-graph", "standard"]
    eager, planned = rows["slp"], rows["slp-graph"]
    assert planned["knobs"] == {"subq_impl": "kernel", "superlinear_decode_graph": "true"}
    assert (eager["decode_cuda_graph"], planned["decode_cuda_graph"]) == (False, True)
    assert eager["decode_plan_steps"] == 0 and rows["standard"]["decode_plan_steps"] == 0
    assert planned["decode_plan_steps"] == 2 * (1 + 2 + 1)  # 2 layers x (warmup, timed, layer)
    assert planned["decode_graph_captures"] == planned["decode_graph_captures_timed"] == 0
    assert planned["first_tokens"] == eager["first_tokens"]
    assert all(r["attention_ms_per_step"] > 0 for r in rows.values())
    on = bench_decode.plan(argv[:argv.index("both")] + ["on"] + argv[argv.index("both") + 1:])
    assert [(a.label, a.knobs.get("superlinear_decode_graph")) for a in on.arms] == [
        ("slp", "true"), ("standard", None)]
