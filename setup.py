"""megatron_subq: attention variants (ASA, PPA, SAS, deconstructed attention, Superlinear) for
Megatron-Core. ``kernels/`` is installed as ``megatron_subq.kernels`` (no top-level ``kernels``)."""

from setuptools import find_packages, setup

packages = find_packages(include=["megatron_subq", "megatron_subq.*"])
kernel_packages = ["megatron_subq.kernels"] + [
    "megatron_subq.kernels." + p for p in find_packages(where="kernels")]

setup(
    name="megatron_subq",
    version="0.1.0",
    description="Sub-quadratic and simulated attention variants for Megatron-Core",
    python_requires=">=3.10",
    packages=packages + kernel_packages,
    package_dir={"megatron_subq.kernels": "kernels"},
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.17",
        "triton",
        "einops",
        "sentencepiece",
        "psutil",  # megatron's torch_dist checkpoint writer needs it (undeclared there)
        "pyyaml",
        "tqdm",
        "numpy",
        "zstandard",  # tools/preprocess_data.py reads .jsonl.zst shards (SlimPajama, FineWeb-Edu)
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "tokenizers", "matplotlib"],  # NIAH heatmap test
        # --tokenizer-model mistral reads mistral-common's packaged SentencePiece model (only the
        # data file: `pip install --no-deps mistral-common` is enough)
        "tokenizers": ["tokenizers", "mistral-common"],
        "logging": ["tensorboard"],
        "plots": ["matplotlib"],
        # checkpoint conversion (megatron_subq.convert, tools/convert_checkpoint.py): native
        # NemotronH starts at transformers 5.3
        "convert": ["transformers>=5.3", "safetensors"],
        # lm-evaluation-harness model (megatron_subq.evaluation, docs/evaluation.md): the core
        # package only (its [hf] extra is not needed: the model here is megatron_subq's own)
        "eval": ["lm_eval==0.4.13"],
    },
)
