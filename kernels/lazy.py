"""Names of a kernel package that load their module on first use (PEP 562).

The ops import each kernel package's triton-free modules (``state``, ``plan``) at their own import,
before ``TRITON_INTERPRET`` may be set and where triton may be absent; the Triton modules load only
when one of their names is first asked for.
"""

import importlib
import sys
from typing import Callable, Dict


def lazy_attributes(package: str, table: Dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``table`` maps each lazy name to the relative
    module defining it (``".function"``). The first access imports that module and binds the
    name in the package, so later accesses are plain attribute reads."""

    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
