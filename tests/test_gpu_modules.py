"""Every variant's megatron module on the GPU: its kernel ops give the reference ops' loss and
gradients through the whole model (spec, slot, layout conversion, process groups).

The op-level kernel tests check each kernel against its reference; this checks what the model
hands the kernels (layouts, strides, head splits such as Superlinear's search queries riding
along the query heads) on the device where the kernels run. GPU only: run through the device
tool (``python -m pytest -m gpu tests/test_gpu_modules.py``).

In float32: the half dtypes are the op tests' job (tests/test_*_kernel.py); here any difference
beyond the kernels' TF32 rounding is a plumbing error, and float32 keeps the comparison sharp
where a variant's math is ill-conditioned at random init (approx's signed denominators) or
discrete (Superlinear's top-k anchors, which half-precision rounding can flip).
"""

from pathlib import Path

import pytest
import torch

from megatron_subq import SubqTransformerConfig, build_gpt_model
from megatron_subq.testing.cases import VARIANT_TEST_SETTINGS, variant_test_settings
from megatron_subq.testing.equivalence import make_batch
from megatron_subq.testing.kernels import rel_rms

pytestmark = pytest.mark.gpu

# head dim 64 (the kernels' smallest tested size is 16; 64 is what models use), 2 query groups
SHAPE = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=512, use_cpu_initialization=True, params_dtype=torch.float32)
SEQ, BATCH, VOCAB = 64, 2, 128  # fixed_seq_qk's test text holds 64 ids < 128
GRAD_RTOL = 1e-2  # TF32 dots in the kernels, two summation orders
# the kernels' sizes (ASA's kernel takes m > 16); the test text from this checkout (the package
# may be installed elsewhere, as on the device)
GPU_SETTINGS = {"asa": {"asa_rank": 32},
                "fixed_seq_qk": {"fixed_qk_tokens_file": str(
                    Path(__file__).parent / "data" / "fixed_qk_tokens.txt")}}


@pytest.fixture(scope="module")
def single_process():
    from megatron_subq import destroy_single_process, init_single_process

    init_single_process()
    yield
    destroy_single_process()


def _loss_and_grads(model, config, impl):
    config.subq_impl = impl
    model.zero_grad(set_to_none=True)
    tokens, labels, pos = (x.cuda() for x in make_batch(VOCAB, BATCH, SEQ))
    loss = model(tokens, pos, None, labels=labels).float().mean()
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                         if p.grad is not None}


@pytest.mark.parametrize("name", sorted(VARIANT_TEST_SETTINGS))
def test_kernel_ops_match_reference_ops_in_the_model(single_process, name):
    torch.manual_seed(0)
    config = SubqTransformerConfig(
        **{**SHAPE, **variant_test_settings(name), **GPU_SETTINGS.get(name, {})})
    model = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=SEQ).cuda()
    loss_k, grads_k = _loss_and_grads(model, config, "kernel")
    loss_r, grads_r = _loss_and_grads(model, config, "reference")
    assert abs(loss_k - loss_r) <= 1e-3 * abs(loss_r), (loss_k, loss_r)
    assert grads_k.keys() == grads_r.keys()
    worst = {n: rel_rms(grads_k[n], grads_r[n]) for n in grads_r}
    bad = {n: e for n, e in worst.items() if not e <= GRAD_RTOL}
    assert not bad, f"{name}: gradients off (relative RMS): {bad}"
