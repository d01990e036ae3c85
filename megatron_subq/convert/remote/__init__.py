"""Hugging Face modeling code that megatron_subq ships for exported models (``trust_remote_code``).

One sub-package per custom architecture; ``export_hf`` copies its files into the exported folder
and points config.json's ``auto_map`` at them. ``REMOTE_CODE``: HF ``model_type`` -> the package.
"""

from __future__ import annotations

import os
import shutil

from . import nemotron_h_superlinear

REMOTE_CODE = {nemotron_h_superlinear.MODEL_TYPE: nemotron_h_superlinear}


def config_class(model_type: str):
    """The shipped config class of ``model_type`` (KeyError for one the project does not ship)."""
    package = REMOTE_CODE[model_type]
    from importlib import import_module  # noqa: PLC0415

    module = import_module(f"{package.__name__}.{package.FILES[0][:-3]}")
    return getattr(module, package.AUTO_MAP["AutoConfig"].split(".")[-1])


def copy_code(model_type: str, folder: str) -> list:
    """Copy the modeling files of ``model_type`` into ``folder``; their names."""
    package = REMOTE_CODE[model_type]
    for name in package.FILES:
        shutil.copyfile(os.path.join(package.FOLDER, name), os.path.join(folder, name))
    return list(package.FILES)
