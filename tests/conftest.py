import os

import pytest
import torch

# Two CPU cores in CI: keep intra-op threads low so spawned ranks don't oversubscribe.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run through the device tool")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
