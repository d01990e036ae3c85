"""Conversion tests' helpers: tiny random Hugging Face models per family, and logits of both sides.

``save_tiny_hf(case, folder)`` builds the tiny model of ``TINY_HF[case]`` with transformers (no
download; ``tiny_nemotron_h``: the hybrid host's NemotronH), perturbs every parameter (HF
initialises norms to 1 and biases to 0, which would hide a misplaced norm or bias) and
``save_pretrained``s it. ``hf_logits`` runs it; ``converted_logits``
runs a converted checkpoint under the current parallel state (any TP/PP, megatron's pipeline
schedule) and returns the full logits on the last stage (None elsewhere).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

# (transformers config class, its kwargs): GQA everywhere; head_dim != hidden/heads in two
# cases; tied embeddings + llama3 RoPE scaling in one
TINY_HF: Dict[str, Tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama_tied_rope3": ("LlamaConfig", dict(
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=16384,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        rope_theta=500000.0)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, head_dim=16, sliding_window=None,
                                      tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                  rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16,
                                  tie_word_embeddings=False)),
}
TINY_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                   num_attention_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6)


def tiny_hf_model(case: str, seed: int = 0, **overrides):
    """The tiny random HF model of ``case`` (float32, eval mode)."""
    import transformers  # noqa: PLC0415

    cls_name, kwargs = TINY_HF[case]
    config = getattr(transformers, cls_name)(**{**TINY_COMMON, **kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


# A tiny NemotronH (transformers >= 5.3): every layer kind (M, *, E, -), GQA, 4 experts top-2.
# HF's CPU Mamba path floors dt at time_step_min (megatron: no floor) and its inter-chunk
# recurrence is wrong (transformers #47246): time_step_min ~ 0, sequences <= chunk_size.
TINY_NEMOTRON_H = dict(
    vocab_size=96, hidden_size=32, layers_block_type=[
        "linear_attention", "full_attention", "moe", "mlp", "linear_attention", "moe"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
    mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=64,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, time_step_min=1e-7,
    max_position_embeddings=64, tie_word_embeddings=False)


def tiny_nemotron_h(seed: int = 0, **overrides):
    """The tiny random NemotronH of ``TINY_NEMOTRON_H`` (float32, eval), every parameter and the
    routers' expert biases perturbed (HF initialises them to 0/1)."""
    import transformers  # noqa: PLC0415

    config = transformers.NemotronHConfig(**{**TINY_NEMOTRON_H, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def save_tiny_hf(case: str, folder: str, seed: int = 0, **overrides) -> str:
    tiny_hf_model(case, seed, **overrides).save_pretrained(folder)
    return folder


def tokens(vocab: int = 96, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def hf_logits(folder: str, ids: torch.Tensor, dtype=torch.float32,
              device: str = "cpu") -> torch.Tensor:
    import transformers  # noqa: PLC0415

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    with torch.no_grad():
        return model(ids.to(device)).logits.float().cpu()


def converted_logits(load: str, ids: torch.Tensor, **overrides) -> Optional[torch.Tensor]:
    """Full [batch, seq, vocab] logits of the checkpoint ``load`` under the current parallel
    state (TP-gathered) on the last pipeline stage; None on the others."""
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415
    from megatron.core.tensor_parallel.mappings import (  # noqa: PLC0415
        gather_from_tensor_model_parallel_region,
    )

    from ..convert import load_converted_model  # noqa: PLC0415

    model, _ = load_converted_model(load, **overrides)
    model.eval()
    device = next(model.parameters()).device
    batch, seq = ids.shape
    pos = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)

    def forward_step(data_iterator, model):
        output = model(next(data_iterator), pos, None)

        def keep(out):
            return out.float().sum() * 0.0, {"logits": out.detach()}

        return output, keep

    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([ids.to(device)]), model=[model],
            num_microbatches=1, seq_length=seq, micro_batch_size=batch, forward_only=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return gather_from_tensor_model_parallel_region(out[0]["logits"]).float().cpu()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def train_three_steps(ckpt: str, save: str, vocab: int, script_flags=()) -> dict:
    """The trainer, 3 steps at TP=1 from the converted ``ckpt`` with its model.yaml (mock
    data), saving into ``save``; its summary."""
    import os  # noqa: PLC0415

    from ..training import pretrain  # noqa: PLC0415

    return pretrain([
        "--config", os.path.join(ckpt, "model.yaml"), "--load", ckpt, "--save", save,
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", str(vocab - 1), "--eval-iters", "0",
        "--log-interval", "1", "--num-workers", "0", *script_flags])


def four_rank_checks(cases, root: str, vocab: int, runs) -> dict:
    """Under the current parallel state (the test runs it at TP=2 + PP=2): the logits of
    ``root/<case>/ckpt`` for every case, then the trainer, 3 steps, from ``root/<name>/ckpt``
    with its model.yaml (mock data) for every ``name`` of ``runs``, saving into
    ``root/<name>/trained``. Lives here, not in the test file, so that the spawned ranks do not
    import transformers."""
    import os  # noqa: PLC0415

    from ..training import pretrain  # noqa: PLC0415

    ids = tokens(vocab, seq=32)
    out = {case: converted_logits(os.path.join(root, case, "ckpt"), ids) for case in cases}
    for name in runs:
        ckpt = os.path.join(root, name, "ckpt")
        out["trained " + name] = pretrain([
            "--config", os.path.join(ckpt, "model.yaml"), "--load", ckpt,
            "--save", os.path.join(root, name, "trained"),
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", str(vocab - 1), "--eval-iters", "0",
            "--log-interval", "1", "--num-workers", "0"])
    return out
