"""NemotronH with Superlinear '*' slots -> a Hugging Face folder with the project's remote code
(``megatron_subq/convert/remote/nemotron_h_superlinear``), loaded with ``trust_remote_code=True``.

A tiny random NemotronH ("M*M-M*E": Mamba before each attention layer, as in Nemotron-3-Nano;
float32) is imported as superlinear (``Q_s`` initialised by the variant), exported, and:

* the remote code's logits, loaded in a subprocess where megatron_subq cannot be imported,
  equal the megatron model's on 128 tokens (<= chunk_size: transformers' CPU Mamba path is
  wrong beyond one chunk, transformers #47246); the knobs (w = 8, offsets 8, 15, 24, ...) leave
  up to 9 candidate anchors per query outside the window, so search, top-k and spans all run;
* ``generate`` with the cache gives the tokens of full recomputation (``use_cache=False``);
* importing the export back copies ``Q_s`` (nothing created) and gives bitwise the same tensors;
* the remote PyTorch Superlinear equals the project's op (reference and dense form), full
  sequences and cached rows;
* other variants (asa) are still refused on export, naming the layers.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
if not hasattr(transformers, "NemotronHConfig"):
    pytest.skip("NemotronH needs transformers >= 5.3", allow_module_level=True)

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_subq.convert import export_hf, import_hf, load_converted_model  # noqa: E402
from megatron_subq.convert.api import one_process  # noqa: E402
from megatron_subq.convert.remote import nemotron_h_superlinear as remote  # noqa: E402
from megatron_subq.convert.remote.nemotron_h_superlinear import (  # noqa: E402
    modeling_nemotron_h_superlinear as modeling,
)
from megatron_subq.ops.superlinear import (  # noqa: E402
    superlinear_attention_dense,
    superlinear_attention_reference,
)
from megatron_subq.testing.convert import (  # noqa: E402
    converted_logits,
    relative_error,
    tiny_nemotron_h,
    tokens,
)

QUIET = dict(progress=False, log=lambda *a: None)
VOCAB = 96
SEQ = 128
# w = floor(3^2) - 1 = 8; candidate offsets 8, 15, 24, 35, 48, 63, 80, 99, 120; spans of
# ceil(2 sqrt(i)) back and ceil(sqrt(i)/2) forward
KNOBS = {"superlinear_sw_index": 2, "superlinear_forward_factor": 0.5}
PATTERN = ["linear_attention", "full_attention", "linear_attention", "mlp", "linear_attention",
           "full_attention", "moe"]

# runs in a fresh interpreter with megatron_subq made unimportable: the exported folder must
# load with transformers + torch alone
LOAD_ALONE = r"""
import sys, torch
sys.modules["megatron_subq"] = None  # any import of it raises ImportError
import transformers
folder, ids_path, out_path = sys.argv[1:4]
ids = torch.load(ids_path)
model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(ids).logits
    prompt = ids[:1, :40]  # an explicit mask: generate() masks pad_token_id otherwise
    gen = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    cached = model.generate(prompt, use_cache=True, **gen)
    full = model.generate(prompt, use_cache=False, **gen)
names = sorted(n for n, _ in model.named_parameters())
torch.save({"logits": logits, "cached": cached, "full": full, "names": names,
            "class": type(model).__name__,
            "mixers": [type(layer.mixer).__name__ for layer in model.model.layers]}, out_path)
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemotron_h_superlinear")
    tiny_nemotron_h(layers_block_type=PATTERN, chunk_size=128,
                    max_position_embeddings=256).save_pretrained(str(root / "hf"))
    imported = import_hf(str(root / "hf"), str(root / "ckpt"), attention_variant="superlinear",
                         knobs=KNOBS, **QUIET)
    exported = export_hf(str(root / "ckpt"), str(root / "out"), **QUIET)
    return {"root": root, "imported": imported, "exported": exported}


def _tensors(load):
    with one_process(1234):
        model, _ = load_converted_model(load)
        return {k: v.clone() for k, v in model.state_dict().items()
                if not k.endswith("_extra_state")}


def test_export_writes_remote_code_and_config(work):
    out = work["root"] / "out"
    assert sorted(work["imported"].created) == [
        "decoder.layers.1.self_attention.linear_qs.weight",
        "decoder.layers.5.self_attention.linear_qs.weight"]
    for name in remote.FILES:
        assert (out / name).read_bytes() == open(os.path.join(remote.FOLDER, name), "rb").read()
    cfg = json.load(open(out / "config.json"))
    assert cfg["architectures"] == ["NemotronHSuperlinearForCausalLM"]
    assert cfg["model_type"] == "nemotron_h_superlinear" and cfg["auto_map"] == remote.AUTO_MAP
    assert cfg["superlinear_layers"] == [1, 5] and cfg["layers_block_type"] == PATTERN
    assert cfg["superlinear_sw_index"] == 2 and cfg["superlinear_forward_factor"] == 0.5
    assert cfg["superlinear_search_power"] == 0.5 and cfg["superlinear_topk"] == 2
    assert "backbone.layers.5.mixer.qs_proj.weight" in work["exported"].copied
    # the remote file imports megatron_subq only inside a function (CUDA path), never at the top
    source = (out / "modeling_nemotron_h_superlinear.py").read_text()
    top = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not [line for line in top if "megatron_subq" in line], top
    assert not glob.glob(str(work["root"] / ".out.partial-*"))


def test_remote_logits_equal_megatron_and_generate_is_exact(work, tmp_path):
    root = work["root"]
    ids = tokens(VOCAB, seq=SEQ)
    with one_process(1234):
        want = converted_logits(str(root / "ckpt"), ids)
    torch.save(ids, tmp_path / "ids.pt")
    # one thread: tiny GEMMs on a shared CPU are ~100x slower with several
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "hf_modules"),
               PYTHONPATH="", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", LOAD_ALONE, str(root / "out"),
                          str(tmp_path / "ids.pt"), str(tmp_path / "got.pt")],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(tmp_path / "got.pt")
    assert got["class"] == "NemotronHSuperlinearForCausalLM"
    assert got["mixers"][1] == got["mixers"][5] == "NemotronHSuperlinearAttention"
    assert "model.layers.1.mixer.qs_proj.weight" in got["names"]
    err = relative_error(got["logits"], want)
    print(f"relative error remote code vs megatron: {err:.2e}")
    assert err <= 1e-5, err  # measured ~3e-7 (float32)
    assert torch.equal(got["cached"], got["full"]), (got["cached"], got["full"])


def test_import_of_the_export_copies_q_s_and_round_trips_bitwise(work):
    root = work["root"]
    again = import_hf(str(root / "out"), str(root / "again"), **QUIET)
    assert again.created == [] and again.dropped == []
    assert "decoder.layers.5.self_attention.linear_qs.weight" in again.copied
    assert again.flags["attention-variant"] == "superlinear"
    assert again.flags["superlinear-sw-index"] == 2
    before, after = _tensors(str(root / "ckpt")), _tensors(str(root / "again"))
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    # imported as standard: the search projections have no place and are dropped, by name
    plain = import_hf(str(root / "out"), str(root / "plain"), attention_variant="standard",
                      **QUIET)
    assert plain.created == [] and plain.dropped == [
        "backbone.layers.1.mixer.qs_proj.weight", "backbone.layers.5.mixer.qs_proj.weight"]


def test_partial_superlinear_layers_round_trip(work, tmp_path):
    """One of two '*' slots Superlinear: config.json's superlinear_layers names that layer, no
    qs_proj in the other, and the import back gives the per-slot --layer-pattern; a layer that is
    not attention is refused by field."""
    import_hf(str(work["root"] / "hf"), str(tmp_path / "ckpt"), attention_variant="superlinear",
              layer_pattern="standard,superlinear", knobs=KNOBS, **QUIET)
    out = export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"), **QUIET)
    cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert cfg["superlinear_layers"] == [5]
    assert [n for n in out.copied if "qs_proj" in n] == ["backbone.layers.5.mixer.qs_proj.weight"]
    again = import_hf(str(tmp_path / "out"), str(tmp_path / "again"), **QUIET)
    assert again.created == [] and again.flags["layer-pattern"] == "standard,superlinear"

    cfg["superlinear_layers"] = [0]
    os.remove(tmp_path / "out" / "config.json")
    json.dump(cfg, open(tmp_path / "out" / "config.json", "w"))
    with pytest.raises(ValueError, match=r"config.json: superlinear_layers=\[0\].*allowed"):
        import_hf(str(tmp_path / "out"), str(tmp_path / "no"), **QUIET)
    assert not os.path.exists(tmp_path / "no")


def test_asa_slots_are_still_refused_naming_the_layers(work, tmp_path):
    import_hf(str(work["root"] / "hf"), str(tmp_path / "asa"), attention_variant="asa",
              layer_pattern="superlinear,asa", knobs={"asa_rank": 8}, **QUIET)
    with pytest.raises(ValueError, match=r"'standard' or 'superlinear' export to Hugging Face "
                                         r"as nemotron_h; layer\(s\) 6 \(asa\) are not"):
        export_hf(str(tmp_path / "asa"), str(tmp_path / "out"), **QUIET)
    assert not os.path.exists(tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# the remote PyTorch Superlinear alone
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("knobs", [
    {},
    {"sw_index": 2, "forward_factor": 0.5},
    {"sw_index": 3, "topk": 3, "backward_factor": 2.5, "span_power": 0.6},
    {"search_power": 1 / 3, "span_power": 2 / 3, "backward_factor": 3.0, "sw_index": 1},
])
def test_remote_superlinear_equals_the_project_op(knobs):
    g = torch.Generator().manual_seed(0)
    B, T, H, Hk, D = 2, 100, 4, 2, 8
    q, q_s, k, v = (torch.randn(B, T, h, D, generator=g) for h in (H, H, Hk, Hk))
    ref = superlinear_attention_reference(q, q_s, k, v, **knobs)
    got = modeling.superlinear_rows(q, q_s, k, v, 0, **knobs)
    assert torch.equal(got, ref)  # the same chunks and float32 operations
    torch.testing.assert_close(got, superlinear_attention_dense(q, q_s, k, v, **knobs),
                               rtol=1e-5, atol=1e-5)
    for start in (60, 99):  # cached rows (prefill chunk, one decode step)
        rows = modeling.superlinear_rows(q[:, start:], q_s[:, start:], k, v, start, **knobs)
        torch.testing.assert_close(rows, ref[:, start:], rtol=1e-5, atol=1e-5)


def test_remote_attention_module_with_and_without_cache():
    """The module: prefill + steps through transformers' DynamicCache = the full forward."""
    from transformers import DynamicCache

    cfg = remote_config()
    torch.manual_seed(0)
    attn = modeling.NemotronHSuperlinearAttention(cfg, layer_idx=1).eval()
    x = torch.randn(1, 40, cfg.hidden_size)
    with torch.no_grad():
        full, _ = attn(x)
        cache = DynamicCache(config=cfg)
        parts = [attn(x[:, :30], cache=cache)[0]]
        parts += [attn(x[:, t:t + 1], cache=cache)[0] for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-6)
    # the same numbers as the project's op on the module's own projections
    shape = (1, 40, -1, attn.head_dim)
    with torch.no_grad():
        o = superlinear_attention_reference(
            attn.q_proj(x).view(shape), attn.qs_proj(x).view(shape), attn.k_proj(x).view(shape),
            attn.v_proj(x).view(shape), **modeling._knobs(cfg))
        assert torch.equal(attn.o_proj(o.reshape(1, 40, -1)), full)


def remote_config():
    """A tiny config of the shipped class (one Mamba, one Superlinear layer)."""
    from megatron_subq.convert.remote import config_class

    return config_class(remote.MODEL_TYPE)(
        vocab_size=VOCAB, hidden_size=32, layers_block_type=["linear_attention",
                                                             "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, superlinear_sw_index=1,
        superlinear_forward_factor=0.5)
