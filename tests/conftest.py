import os

import torch

# Without CUDA, Triton kernels run in Triton's interpreter. TRITON_INTERPRET must be set before
# triton is first imported (importing megatron_subq imports it), or interpreted kernels break
# ("Cannot call @triton.jit'd outside of the scope of a kernel"); conftest runs before any test
# module is imported. Importing torch does not import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Two CPU cores in CI: keep intra-op threads low so spawned ranks don't oversubscribe.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run through the device tool")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
