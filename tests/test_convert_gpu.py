"""Conversion at real width on a GPU: a 2-layer Llama with Llama-3-8B's widths (hidden 4096, 32
heads, 8 key/value groups, MLP 14336, vocabulary 128256; about 3.5 GB in bf16) imported at TP=1,
its megatron logits against HF's on the GPU in bf16, and the conversion time per GB (import and
export) printed as one ``CONVERT-TIMING`` JSON line (and written to ``$OUT/convert_timing.json``
when ``$OUT`` is set) for docs/conversion.md.

    python -m pytest -q -s -p no:cacheprovider tests/test_convert_gpu.py

Needs transformers and safetensors on the GPU machine (the ``[convert]`` extra).
"""

import json
import os
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WIDE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
            rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.mark.gpu
def test_real_width_llama_bf16_logits_and_conversion_time(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    import megatron_subq as subq
    from megatron_subq.convert import export_hf, import_hf, load_converted_model
    from megatron_subq.testing.convert import relative_error

    def rms_error(a, b):
        """RMS of a - b over the RMS of b (max-based errors follow one outlier logit)."""
        return float((a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt())

    hf, ckpt, out = (str(tmp_path / n) for n in ("hf", "ckpt", "out"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**WIDE, dtype="bfloat16")
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(hf)  # bf16 weights, as published checkpoints are
    del model
    ids = torch.randint(0, WIDE["vocab_size"], (1, 512), device="cuda")
    refs = {}
    for dtype in (torch.float32, torch.bfloat16):  # reloaded: RoPE's inv_freq computed afresh
        # (a model cast with .to(bfloat16) keeps a bf16-rounded inv_freq buffer, which is not
        # what from_pretrained gives and drifts with position)
        model = transformers.LlamaForCausalLM.from_pretrained(hf, dtype=dtype).cuda().eval()
        with torch.no_grad():
            refs[dtype] = model(ids).logits.float().cpu()
        del model
    ref, ref_bf16 = refs[torch.float32], refs[torch.bfloat16]
    torch.cuda.empty_cache()

    subq.init_single_process()  # nccl on the GPU; conversion reuses this world of one
    start = time.perf_counter()
    summary = import_hf(hf, ckpt, progress=False)
    import_s = time.perf_counter() - start
    start = time.perf_counter()
    export_hf(ckpt, out, progress=False)
    export_s = time.perf_counter() - start

    megatron, args = load_converted_model(ckpt)
    assert args.bf16
    megatron = megatron.cuda().eval()
    pos = torch.arange(ids.shape[1], device="cuda").unsqueeze(0)
    with torch.no_grad():
        got = megatron(ids, pos, None).float().cpu()
    rel, rel_hf = rms_error(got, ref), rms_error(ref_bf16, ref)
    gb = summary.nbytes / 1e9
    record = {"gpu": torch.cuda.get_device_name(), "gb": round(gb, 3),
              "import_s": round(import_s, 1), "import_s_per_gb": round(import_s / gb, 2),
              "export_s": round(export_s, 1), "export_s_per_gb": round(export_s / gb, 2),
              "bf16_logits_rms_error_vs_fp32": rel, "hf_bf16_rms_error_vs_fp32": rel_hf,
              "bf16_logits_max_error_vs_hf_bf16": relative_error(got, ref_bf16),
              "tokens": ids.shape[1]}
    print("CONVERT-TIMING " + json.dumps(record))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "convert_timing.json"), "w") as f:
            json.dump(record, f, indent=2)
    # bf16 end to end: ours must be as close to the float32 truth as HF's own bf16 run is
    # (different kernels on both sides); float32 equality is the CPU tests' job
    assert rel <= 2 * rel_hf + 1e-3, record
