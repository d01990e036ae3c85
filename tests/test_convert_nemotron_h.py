"""NemotronH (``NemotronHForCausalLM``) <-> the hybrid host, on a tiny random model built here
(transformers >= 5.3, no downloads; ``testing/convert.py: TINY_NEMOTRON_H``: M, *, E and - layers,
4 experts top-2, perturbed expert biases).

HF's CPU Mamba path differs from megatron's mixer in two ways that the tiny model steers around:
it floors dt at ``time_step_min`` (megatron has no floor: the tiny sets it to 1e-7), and its
inter-chunk recurrence is wrong (transformers #47246: sequences here stay within one chunk).

* import at TP=1: the hybrid host's logits (float32, the PyTorch mixer) equal HF's; export gives
  bitwise-identical tensors, in the hub layout, that transformers loads natively;
* an import as superlinear keeps every pretrained tensor bitwise, creates exactly one
  ``linear_qs.weight`` per '*' slot, trains 3 steps with the trainer (one process), and the
  trained run exports for the remote code (tests/test_convert_superlinear_hf.py checks it);
* a config.json field the host cannot represent fails naming it, writing nothing.
"""

import glob
import json
import os
import sys

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
if not hasattr(transformers, "NemotronHConfig"):
    pytest.skip("NemotronH needs transformers >= 5.3", allow_module_level=True)

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.convert import export_hf, import_hf  # noqa: E402
from megatron_subq.convert.api import one_process  # noqa: E402
from megatron_subq.testing import run_distributed  # noqa: E402
from megatron_subq.testing.cases import VARIANT_TEST_SETTINGS  # noqa: E402
from megatron_subq.testing.convert import (  # noqa: E402
    converted_logits,
    hf_logits,
    relative_error,
    tiny_nemotron_h,
    tokens,
    train_three_steps,
)

QUIET = dict(progress=False, log=lambda *a: None)
VOCAB = 96


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemotron_h")
    tiny_nemotron_h().save_pretrained(str(root / "hf"))
    return {"root": root, "standard": import_hf(str(root / "hf"), str(root / "ckpt"), **QUIET)}


def _safetensors(folder):
    from safetensors import safe_open

    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def test_import_matches_hf_logits_and_export_is_bitwise(work):
    root = work["root"]
    summary = work["standard"]
    assert summary.family == "nemotron_h" and summary.created == [] and summary.dropped == []
    assert summary.flags["hybrid-override-pattern"] == "M*E-ME"
    before = _safetensors(str(root / "hf"))
    assert "backbone.layers.2.mixer.experts.3.up_proj.weight" in before  # the hub layout
    ids = tokens(VOCAB, seq=32)  # <= chunk_size (64)
    with one_process(1234):
        got = converted_logits(str(root / "ckpt"), ids)
    reference = hf_logits(str(root / "hf"), ids)
    assert relative_error(got, reference) <= 1e-5  # measured ~3e-7

    export_hf(str(root / "ckpt"), str(root / "out"), **QUIET)
    after = _safetensors(str(root / "out"))
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    config = json.load(open(root / "out" / "config.json"))
    assert config["architectures"] == ["NemotronHForCausalLM"]
    assert config["layers_block_type"] == json.load(open(root / "hf" / "config.json"))[
        "layers_block_type"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root / "out"))
    with torch.no_grad():
        assert relative_error(model(ids).logits, reference) == 0.0


def test_superlinear_surgery_keeps_tensors_creates_linear_qs_and_trains(work):
    from megatron_subq.convert import load_converted_model
    from megatron_subq.convert.families import FAMILIES
    from megatron_subq.convert.hf_io import HFReader

    root = work["root"]
    summary = import_hf(str(root / "hf"), str(root / "sl"), attention_variant="superlinear",
                        knobs=VARIANT_TEST_SETTINGS["superlinear"], **QUIET)
    assert summary.copied == work["standard"].copied and summary.dropped == []
    assert summary.created == ["decoder.layers.1.self_attention.linear_qs.weight"]  # one '*'
    reader = HFReader(str(root / "hf"))
    with one_process(1234):
        model, args = load_converted_model(str(root / "sl"))
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        for tm in FAMILIES["nemotron_h"].tensor_maps(args, VOCAB):
            assert torch.equal(tensors[tm.megatron],
                               tm.to_megatron([reader.get(n) for n in tm.hf])), tm.megatron
    reader.close()
    [run] = run_distributed(train_three_steps, world_size=1, args=(
        str(root / "sl"), str(root / "sl-trained"), VOCAB))
    assert run["loaded_iteration"] == 0
    losses = list(run["iterations"].values())
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), run
    # the trained run's folder keeps no hf_config.json: the family comes from its flags, the
    # Superlinear layers go to the shipped remote code (tests/test_convert_superlinear_hf.py)
    out = export_hf(str(root / "sl-trained"), str(root / "sl-out"), **QUIET)
    assert "backbone.layers.1.mixer.qs_proj.weight" in out.copied
    config = json.load(open(root / "sl-out" / "config.json"))
    assert config["architectures"] == ["NemotronHSuperlinearForCausalLM"]
    assert config["superlinear_layers"] == [1]


@pytest.mark.parametrize("field,value", [
    ("conv_kernel", 3), ("norm_topk_prob", False), ("mlp_hidden_act", "silu"),
    ("n_group", 2), ("use_conv_bias", False), ("mamba_proj_bias", True),
    ("layer_norm_epsilon", 1e-6), ("layers_block_type", ["linear_attention", "cross"])])
def test_unrepresentable_field_is_named_and_nothing_written(work, tmp_path, field, value):
    hf = tmp_path / "hf"
    os.makedirs(hf)
    for name in os.listdir(work["root"] / "hf"):
        os.symlink(work["root"] / "hf" / name, hf / name)
    os.remove(hf / "config.json")
    cfg = json.load(open(work["root"] / "hf" / "config.json"))
    cfg[field] = value
    json.dump(cfg, open(hf / "config.json", "w"))
    save = tmp_path / "save"
    with pytest.raises(ValueError, match=rf"config.json: {field}=.*allowed"):
        import_hf(str(hf), str(save), **QUIET)
    assert not os.path.exists(save) and not glob.glob(str(tmp_path / ".save.partial-*"))


def test_tp_and_ep_of_an_moe_import_go_into_model_yaml(work, tmp_path):
    """TP > 1 with MoE layers needs sequence parallelism (megatron's MoE layer); EP divides the
    experts. (The TP=1 checkpoint itself loads at TP=2: measured ~4e-7 against HF.)"""
    import_hf(str(work["root"] / "hf"), str(tmp_path / "ckpt"), tensor_model_parallel_size=2,
              expert_model_parallel_size=2, **QUIET)
    text = open(tmp_path / "ckpt" / "model.yaml").read()
    for line in ("tensor-model-parallel-size: 2", "expert-model-parallel-size: 2",
                 "sequence-parallel: true", "hybrid-override-pattern: M*E-ME"):
        assert line in text, line
    with pytest.raises(ValueError, match="expert-model-parallel-size=3"):
        import_hf(str(work["root"] / "hf"), str(tmp_path / "no"), expert_model_parallel_size=3,
                  **QUIET)
    assert not os.path.exists(tmp_path / "no")
