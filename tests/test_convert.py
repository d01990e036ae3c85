"""Checkpoint conversion (megatron_subq.convert, tools/convert_checkpoint.py) on tiny random HF
models built here (no downloads): Llama (GQA, untied; tied + llama3 RoPE scaling), Mistral,
Qwen2 (q/k/v biases), Qwen3 (q/k norms).

* import at TP=1: the megatron model's logits equal HF's (float32, 1e-5 relative); export back
  gives bitwise-identical tensors and a folder transformers loads without custom code;
* one 4-process launch (TP=2 + PP=2): every family's checkpoint loads and gives HF's logits, and
  the Llama imported as asa and as superlinear trains 3 steps with the trainer;
* surgery keeps every pretrained tensor bitwise and creates exactly the variant's parameters;
* bad input fails naming the file or field, and leaves nothing in --save.
"""

import glob
import json
import os
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.convert import export_hf, import_hf  # noqa: E402
from megatron_subq.convert.api import one_process  # noqa: E402
from megatron_subq.testing import run_distributed  # noqa: E402
from megatron_subq.testing.cases import VARIANT_TEST_SETTINGS  # noqa: E402
from megatron_subq.testing.convert import (  # noqa: E402
    TINY_HF,
    converted_logits,
    four_rank_checks,
    hf_logits,
    relative_error,
    save_tiny_hf,
    tokens,
)

SURGERY = ("asa", "superlinear")
# the tests' variant settings, fitted to the tiny Llama's head dimension of 8
SURGERY_KNOBS = {"asa": {**VARIANT_TEST_SETTINGS["asa"], "asa_rank": 4},
                 "superlinear": VARIANT_TEST_SETTINGS["superlinear"]}
QUIET = dict(progress=False, log=lambda *a: None)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Every family's tiny HF model imported at TP=1, and the Llama imported as each SURGERY
    variant (checked for TP=2/PP=2)."""
    root = tmp_path_factory.mktemp("convert")
    out = {"root": root, "summary": {}}
    for case in TINY_HF:
        save_tiny_hf(case, str(root / case / "hf"))
        out["summary"][case] = import_hf(str(root / case / "hf"), str(root / case / "ckpt"),
                                         **QUIET)
    for variant in SURGERY:
        out["summary"][variant] = import_hf(
            str(root / "llama" / "hf"), str(root / variant / "ckpt"), attention_variant=variant,
            knobs=SURGERY_KNOBS[variant], tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2, **QUIET)
    return out


def _safetensors(folder):
    from safetensors import safe_open

    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


@pytest.mark.parametrize("case", sorted(TINY_HF))
def test_import_matches_hf_logits_and_export_is_bitwise(work, case):
    import transformers

    root = work["root"] / case
    ids = tokens(seq=32)
    with one_process(1234):
        got = converted_logits(str(root / "ckpt"), ids)
    assert relative_error(got, hf_logits(str(root / "hf"), ids)) <= 1e-5
    summary = work["summary"][case]
    assert summary.created == [] and summary.dropped == []

    # export in small shards: index + several files, then transformers loads it natively
    export_hf(str(root / "ckpt"), str(root / "out"), max_shard_size=20000, **QUIET)
    assert os.path.isfile(root / "out" / "model.safetensors.index.json")
    before, after = _safetensors(str(root / "hf")), _safetensors(str(root / "out"))
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    config = json.load(open(root / "out" / "config.json"))
    assert config["architectures"] == json.load(open(root / "hf" / "config.json"))[
        "architectures"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root / "out"))
    with torch.no_grad():
        assert relative_error(model(ids).logits, hf_logits(str(root / "hf"), ids)) == 0.0


def test_tp2_pp2_loads_every_family_and_surgery_trains(work):
    root = work["root"]
    ranks = run_distributed(four_rank_checks, world_size=4, tp=2, pp=2, args=(
        sorted(TINY_HF), str(root), 96, ["llama", *SURGERY]))
    last = ranks[-1]
    ids = tokens(seq=32)
    for case in TINY_HF:
        assert relative_error(last[case], hf_logits(str(root / case / "hf"), ids)) <= 1e-5, case
    for name in ("llama", *SURGERY):
        run = last["trained " + name]
        assert run["loaded_iteration"] == 0
        losses = list(run["iterations"].values())
        assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), (name, run)

    # the trained Llama (saved by the trainer at TP=2 + PP=2, with its optimizer) exports, with
    # the architecture of the import's config.json, to a folder whose logits are the checkpoint's
    trained, out = str(root / "llama" / "trained"), str(root / "llama" / "trained-hf")
    export_hf(trained, out, hf_config=str(root / "llama" / "ckpt"), **QUIET)
    with one_process(1234):
        megatron = converted_logits(trained, ids)
    assert relative_error(hf_logits(out, ids), megatron) <= 1e-5
    assert relative_error(megatron, hf_logits(str(root / "llama" / "hf"), ids)) > 1e-4  # trained


@pytest.mark.parametrize("variant", SURGERY)
def test_surgery_keeps_pretrained_tensors_and_creates_the_variants(work, variant):
    from megatron_subq.convert import load_converted_model
    from megatron_subq.convert.families import FAMILIES
    from megatron_subq.convert.hf_io import HFReader
    from megatron_subq.training.trainer import bare_model
    from megatron_subq.convert.api import _build_config

    root = work["root"]
    standard, summary = work["summary"]["llama"], work["summary"][variant]
    assert summary.copied == standard.copied and summary.dropped == []
    own = {"asa": "self_attention.core_attention.", "superlinear": "self_attention.linear_qs."}
    assert summary.created and all(own[variant] in n for n in summary.created), summary.created
    yaml_text = open(root / variant / "ckpt" / "model.yaml").read()
    assert f"attention-variant: {variant}" in yaml_text
    assert "tensor-model-parallel-size: 2" in yaml_text

    reader = HFReader(str(root / "llama" / "hf"))
    with one_process(1234):
        model, args = load_converted_model(str(root / variant / "ckpt"))
        params = dict(model.named_parameters())
        for tm in FAMILIES["llama"].tensor_maps(args, 96):
            assert torch.equal(params[tm.megatron], tm.to_megatron([reader.get(n)
                                                                     for n in tm.hf]))
        assert sorted(set(params) - set(standard.copied)) == sorted(summary.created)
    with one_process(1234):  # the new parameters are the variant's own initialisation
        fresh = dict(bare_model(args, _build_config(args), 96).named_parameters())
    for name in summary.created:
        assert torch.equal(params[name], fresh[name]), name
    with pytest.raises(ValueError, match=r"layer\(s\) 1 \(" + variant):
        export_hf(str(root / variant / "ckpt"), str(root / variant / "out"), **QUIET)
    assert not os.path.exists(root / variant / "out")


def _edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


def _nothing_written(save):
    parent, name = os.path.dirname(save), os.path.basename(save)
    return not os.path.exists(save) and not glob.glob(os.path.join(parent, f".{name}.partial-*"))


def test_bad_input_names_the_file_or_field_and_writes_nothing(tmp_path):
    from megatron_subq.testing.convert import tiny_hf_model

    model = tiny_hf_model("llama", num_hidden_layers=2)
    sharded = str(tmp_path / "sharded")
    model.save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(glob.glob(os.path.join(sharded, "model-*.safetensors")))
    assert len(shards) > 1
    save = str(tmp_path / "save")

    def fails(hf, match, error=ValueError, **kwargs):
        with pytest.raises(error, match=match):
            import_hf(hf, save, **QUIET, **kwargs)
        assert _nothing_written(save)

    fails(sharded, "heads.* not divisible by --tensor-model-parallel-size=3",
          tensor_model_parallel_size=3)
    fails(sharded, "--num-layers=2 is not divisible by --pipeline-model-parallel-size=4",
          pipeline_model_parallel_size=4)
    os.rename(shards[-1], shards[-1] + ".gone")
    fails(sharded, "missing: .*" + os.path.basename(shards[-1]), FileNotFoundError)
    os.rename(shards[-1] + ".gone", shards[-1])

    for field, value, match in (
            ("intermediate_size", 48, r"mlp.gate_proj.weight has shape \[64, 32\].*\[48, 32\]"),
            ("architectures", ["GPT2LMHeadModel"], "architectures=.*GPT2LMHeadModel.*not "
             "supported: allowed LlamaForCausalLM"),
            ("attention_bias", True, "attention_bias=True"),
            ("hidden_act", "gelu", "hidden_act='gelu'"),
            ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0},
             "rope_parameters.rope_type='yarn'")):
        bad = str(tmp_path / f"bad-{field}")
        model.save_pretrained(bad)
        _edit_config(bad, **{field: value})
        fails(bad, match)

    qwen3 = str(tmp_path / "qwen3")
    save_tiny_hf("qwen3", qwen3, num_hidden_layers=2)
    fails(qwen3, "qk_layernorm=True is not supported by the attention variant 'static_emb_qk'",
          attention_variant="static_emb_qk")
    mistral = str(tmp_path / "mistral")
    save_tiny_hf("mistral", mistral, sliding_window=16)
    fails(mistral, "sliding_window=16")
    os.makedirs(save)
    open(os.path.join(save, "keep"), "w").close()
    with pytest.raises(FileExistsError, match="--save .* is not empty"):
        import_hf(sharded, save, **QUIET)
    assert os.listdir(save) == ["keep"]


def test_cli_import_sharded_and_export_a_step(work, tmp_path, capsys):
    from tools import convert_checkpoint

    root = work["root"]
    convert_checkpoint.main(["export", "--load", str(root / "qwen3" / "ckpt"), "--hf-out",
                             str(tmp_path / "hf"), "--ckpt-step", "0", "--max-shard-size",
                             "20KB", "--no-progress"])
    convert_checkpoint.main(["import", "--hf", str(tmp_path / "hf"), "--save",
                             str(tmp_path / "again"), "--tensor-model-parallel-size", "2",
                             "--attention-variant", "asa", "--layer-pattern", "hybrid",
                             "--asa-rank", "8", "--no-progress"])
    text = capsys.readouterr().out
    assert "import (qwen3)" in text and "created  decoder.layers.{0,2}.self_attention" in text
    assert "--qk-layernorm" in text and "--layer-pattern hybrid" in text
    with pytest.raises(SystemExit):
        convert_checkpoint.main(["export", "--load", str(tmp_path / "again"), "--hf-out",
                                 str(tmp_path / "no")])
    assert "layer(s) 1 (asa), 3 (asa)" in capsys.readouterr().err


def test_bf16_folder_round_trips_bitwise_in_bf16(tmp_path):
    from megatron_subq.testing.convert import tiny_hf_model

    hf = str(tmp_path / "hf")
    tiny_hf_model("qwen2", num_hidden_layers=2).to(torch.bfloat16).save_pretrained(hf)
    summary = import_hf(hf, str(tmp_path / "ckpt"), **QUIET)
    assert summary.flags["bf16"] is True
    assert "bf16: true" in open(tmp_path / "ckpt" / "model.yaml").read()
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), **QUIET)
    before, after = _safetensors(hf), _safetensors(str(tmp_path / "out"))
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(after[name], tensor), name
    assert json.load(open(tmp_path / "out" / "config.json"))["dtype"] == "bfloat16"


def test_variant_hf_param_map_copies_what_the_folder_holds(work, tmp_path, monkeypatch):
    """A variant whose ``hf_param_map`` names HF tensors gets them copied, not initialised."""
    import dataclasses

    from safetensors.torch import save_file

    from megatron_subq import variants

    root = work["root"]
    hf = str(tmp_path / "hf")
    os.makedirs(hf)
    tensors = _safetensors(str(root / "llama" / "hf"))
    for i in range(4):
        tensors[f"model.layers.{i}.self_attn.asa_pq"] = torch.randn(4, 8, 4)
    save_file(tensors, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    open(os.path.join(hf, "config.json"), "w").write(open(root / "llama" / "hf" /
                                                          "config.json").read())
    asa = dataclasses.replace(variants.VARIANTS["asa"],
                              hf_param_map=lambda config: {"core_attention.p_q":
                                                           "self_attn.asa_pq"})
    monkeypatch.setitem(variants.VARIANTS, "asa", asa)
    summary = import_hf(hf, str(tmp_path / "ckpt"), attention_variant="asa",
                        knobs=SURGERY_KNOBS["asa"], **QUIET)
    pq = [f"decoder.layers.{i}.self_attention.core_attention.p_q" for i in range(4)]
    assert set(pq) <= set(summary.copied) and not set(pq) & set(summary.created)
    assert all(n.endswith("p_k") for n in summary.created)


def test_qk_layernorm_fills_the_slot_or_is_refused_by_name():
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_subq.config import SubqTransformerConfig
    from megatron_subq.slots import SubqLocalSpecProvider, attention_slot_spec
    from megatron_subq.norm import LocalNorm

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, qk_layernorm=True)
    spec = attention_slot_spec(SubqTransformerConfig(**base, attention_variant="asa",
                                                     asa_rank=4), 1, SubqLocalSpecProvider())
    assert spec.submodules.q_layernorm is LocalNorm and spec.submodules.k_layernorm is LocalNorm
    plain = attention_slot_spec(SubqTransformerConfig(**{**base, "qk_layernorm": False}), 1,
                                SubqLocalSpecProvider())
    assert plain.submodules.q_layernorm is IdentityOp
    with pytest.raises(ValueError, match="qk_layernorm=True is not supported by the attention "
                                         "variant 'static_emb_qk'"):
        attention_slot_spec(SubqTransformerConfig(**base, attention_variant="static_emb_qk"), 1,
                            SubqLocalSpecProvider())
