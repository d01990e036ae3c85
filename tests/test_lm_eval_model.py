"""The lm-evaluation-harness model ``megatron_subq`` on a tiny checkpoint (CPU, offline): its
loglikelihoods are the model's own token log-probs, rolling loglikelihoods cover every token
once, a local multiple-choice task runs end to end through ``lm_eval.simple_evaluate``, and
``generate_until`` cuts at its stop strings."""

import importlib.util
import json
import os

import pytest
import torch

pytest.importorskip("lm_eval")
if importlib.util.find_spec("mistral_common") is None:
    pytest.skip("needs mistral-common (the Mistral SentencePiece model)", allow_module_level=True)

from lm_eval.api.instance import Instance  # noqa: E402

import megatron_subq.inference as inference  # noqa: E402
from megatron_subq.evaluation.lm_eval_model import MegatronSubqLM  # noqa: E402
from megatron_subq.inference import full_logits, token_logprobs  # noqa: E402
from megatron_subq.training import pretrain  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = os.path.join(REPO, "tests", "data", "lm_eval_tasks")
SEQ = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("lm_eval") / "ckpt")
    pretrain(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--attention-variant", "asa", "--seq-length", str(SEQ), "--max-position-embeddings",
              str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters",
              "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "GPTSentencePieceTokenizer",
              "--tokenizer-model", "mistral", "--eval-iters", "0", "--num-workers", "0", "--save",
              save, "--save-interval", "2"])
    return save


@pytest.fixture(scope="module")
def lm(checkpoint):
    model = MegatronSubqLM.create_from_arg_string(f"load={checkpoint},batch_size=3",
                                                  {"batch_size": 1, "device": None})
    yield model
    model.close()


def ll_requests(pairs):
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def lm_eval_split(lm, context, continuation):
    """lm-eval's causal convention, written out: trailing spaces move to the continuation, the
    whole text is encoded and split after the context's own token count; an empty context is
    EOD."""
    if not context:
        return [lm.eot_token_id], lm.tok_encode(continuation)
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = lm.tok_encode(context + continuation)
    return whole[:len(lm.tok_encode(context))], whole[len(lm.tok_encode(context)):]


def test_loglikelihood_is_the_models_token_logprobs(lm):
    pairs = [("The cat sat on the", " mat"), ("", "Hello world"), ("Question: 2+2 = ", "4"),
             ("word " * 40, "end of a long one"), ("Once upon a", " time there was")]
    got = lm.loglikelihood(ll_requests(pairs), disable_tqdm=True)
    assert lm.max_length == SEQ
    for (context, continuation), (logp, greedy) in zip(pairs, got):
        ctx, cont = lm_eval_split(lm, context, continuation)
        seq = torch.tensor([(ctx + cont)[-(SEQ + 1):]])  # cut from the left at max_length
        want = token_logprobs(lm.model, seq)[0, -len(cont):].sum().item()
        assert logp == pytest.approx(want, abs=1e-4), (context, continuation)
        argmax = full_logits(lm.model, seq[:, :-1])[0, -len(cont):].argmax(-1)
        assert greedy == bool((argmax == torch.tensor(cont)).all())

    # is_greedy on token requests: the model's own argmax chain, then one token changed
    ctx = lm.tok_encode("The weather today is")
    chain = list(ctx)
    for _ in range(3):
        chain.append(int(full_logits(lm.model, torch.tensor([chain]))[0, -1].argmax()))
    greedy_cont = chain[len(ctx):]
    other = greedy_cont[:2] + [(greedy_cont[2] + 1) % 32000]
    (lp_g, is_g), (lp_o, is_o) = lm._loglikelihood_tokens([(None, ctx, greedy_cont),
                                                         (None, ctx, other)], True)
    assert is_g and not is_o and lp_g > lp_o


def test_loglikelihood_rolling_scores_every_token_once(lm):
    docs = ["Rolling windows cover a document. " * 12, "A short one.", ""]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), i)
                                    for i, d in enumerate(docs)], disable_tqdm=True)
    for doc, total in zip(docs, got):
        tokens = lm.tok_encode(doc)
        stream = [lm.eot_token_id] + tokens  # token t is predicted from stream[:t + 1]
        want, start = 0.0, 0
        while start < len(tokens):  # disjoint spans of max_length predictions, full context
            end = min(start + SEQ, len(tokens))
            seq = torch.tensor([stream[max(0, end - SEQ):end + 1]])
            want += token_logprobs(lm.model, seq)[0, -(end - start):].sum().item()
            start = end
        assert total == pytest.approx(want, abs=1e-3)
    assert len(lm.tok_encode(docs[0])) > 2 * SEQ and got[2] == 0.0


def greedy_by_full_passes(model, prompts, max_new_tokens, *, eos_id=None, vocab_size=None):
    """The reference of greedy decoding: one full forward pass per new token (no cache)."""
    out = []
    for prompt in prompts:
        seq, new = list(prompt), []
        for _ in range(max_new_tokens):
            token = int(full_logits(model, torch.tensor([seq]))[0, -1, :vocab_size].argmax())
            new.append(token)
            seq.append(token)
            if token == eos_id:
                break
        out.append(new)
    return out


def test_generate_until_cuts_at_stop_strings(lm, monkeypatch):
    """The real cached generate equals greedy full passes; stop strings and EOD cut."""
    prompts = ["The cat sat on the", "Once upon a time", "word " * 40, "Hi"]
    free = lm.generate_until([Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 6}),
                                       i) for i, p in enumerate(prompts)], disable_tqdm=True)
    for prompt, text in zip(prompts, free):  # each prompt its own continuation, order kept
        ids = lm.tok_encode(prompt)[-(SEQ - 6):]  # cut from the left to max_length - 6
        new = greedy_by_full_passes(lm.model, [ids], 6, vocab_size=lm._tokenizer.vocab_size)[0]
        assert text == lm._new_text(ids, new) and len(text) > 0
    text = free[0]
    stop = next(c for c in text[1:] if not c.isspace())
    cut = lm.generate_until([Instance("generate_until", {}, (prompts[0], {
        "until": ["\u2603 never", stop], "max_gen_toks": 6}), 0)], disable_tqdm=True)[0]
    assert cut == text[:text.index(stop)] and stop not in cut

    # a generation that reaches EOD ends there; the earliest stop string wins
    canned = lm.tok_encode("Say alpha beta. gamma\n\ndelta")[len(lm.tok_encode("Say")):]

    def canned_generate(model, prompts, max_new_tokens, **kw):
        assert kw["eos_id"] == lm.eot_token_id and max_new_tokens == 16
        return [canned + [lm.eot_token_id] + lm.tok_encode("after") for _ in prompts]

    monkeypatch.setattr(inference, "generate", canned_generate, raising=False)
    out = lm.generate_until([Instance("generate_until", {}, ("Say", kw), i) for i, kw in enumerate(
        [{"until": [], "max_gen_toks": 16}, {"until": ".", "max_gen_toks": 16},
         {"until": ["\n\n", "beta"], "max_gen_toks": 16}])], disable_tqdm=True)
    assert out == [" alpha beta. gamma\n\ndelta", " alpha beta", " alpha "]


def test_bad_model_args_are_named(tmp_path):
    with pytest.raises(ValueError, match="load="):
        MegatronSubqLM()
    with pytest.raises(ValueError, match="batch_size"):
        MegatronSubqLM(load=str(tmp_path), batch_size="auto")
    with pytest.raises(ValueError, match="not_a_flag"):
        MegatronSubqLM(load=str(tmp_path), not_a_flag=1)
    with pytest.raises(FileNotFoundError, match="load="):
        MegatronSubqLM(load=str(tmp_path / "missing"))


def test_simple_evaluate_runs_a_local_task_offline(lm, checkpoint, monkeypatch, tmp_path):
    """Last in the file: the evaluation loads a second copy of the model, which re-creates
    megatron's parallel state under the fixture's model."""
    import lm_eval  # noqa: PLC0415
    from lm_eval.tasks import TaskManager  # noqa: PLC0415

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.chdir(REPO)  # the task's data_files path is relative to the repository
    with open(os.path.join(TASKS, "tiny_mc.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    hits, lls = [], []
    for doc in docs:
        scores = [ll for ll, _ in lm.loglikelihood(ll_requests(
            [(doc["question"], " " + c) for c in doc["choices"]]), disable_tqdm=True)]
        lls.append(scores)
        hits.append(float(max(range(len(scores)), key=scores.__getitem__) == doc["answer"]))

    out = lm_eval.simple_evaluate(model="megatron_subq", model_args=f"load={checkpoint}",
                                  tasks=["megatron_subq_tiny_mc"], batch_size=2,
                                  task_manager=TaskManager(include_path=TASKS,
                                                           include_defaults=False),
                                  bootstrap_iters=0, log_samples=True)
    acc = out["results"]["megatron_subq_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0 and acc == pytest.approx(sum(hits) / len(hits))
    samples = sorted(out["samples"]["megatron_subq_tiny_mc"], key=lambda s: s["doc_id"])
    for sample, scores in zip(samples, lls):
        assert [r[0][0] for r in sample["resps"]] == pytest.approx(scores, abs=1e-4)


@pytest.mark.slow
def test_command_line_registers_the_model(checkpoint, tmp_path):
    """`python -m megatron_subq.evaluation.lm_eval` is lm-eval's own command line with
    ``--model megatron_subq`` known (slow: lm-eval indexes all of its built-in tasks)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    env = {k: v for k, v in os.environ.items()  # not this process's group (its port is taken)
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"),
               PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_subq.evaluation.lm_eval", "--model", "megatron_subq",
         "--model_args", f"load={checkpoint},batch_size=4", "--tasks", "megatron_subq_tiny_mc",
         "--include_path", TASKS, "--output_path", str(tmp_path / "out")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "out") for f in fs
             if f.startswith("results") and f.endswith(".json")]
    with open(found[0], encoding="utf-8") as f:
        acc = json.load(f)["results"]["megatron_subq_tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
