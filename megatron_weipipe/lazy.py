"""Package namespaces whose names load on first use (PEP 562).

``megatron_weipipe.data`` and ``megatron_weipipe.fpdt`` re-export their modules' names,
but their configs (``data.config``, ``fpdt.config``) must import without torch, so the
re-exports are resolved only when a name is asked for.
"""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], list[str]]:
    """(``__getattr__``, ``__all__``) for ``package``; ``exports`` maps a name to its submodule."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return __getattr__, list(exports)
