"""Runs a patch on a module as soon as the module is imported, or at once if it already is.

The GPU checks' faults wrap one function inside processes that sglang or `sglang-pd up` start, before
any of that code runs: `sitecustomize` (beside this file) calls `when_imported` at interpreter start,
and the finder below wraps the module's loader so that the patch runs right after the module body.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

Patch = Callable[[ModuleType], None]


def _patch_after_exec(loader: importlib.abc.Loader, patch: Patch) -> None:
    load = loader.exec_module

    def exec_module(module: ModuleType) -> None:
        load(module)
        patch(module)

    loader.exec_module = exec_module  # type: ignore[method-assign]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds `module` with the other finders and wraps its loader, so that `patch` runs as soon as
    the module is imported."""

    def __init__(self, module: str, patch: Patch) -> None:
        self.module, self.patch = module, patch

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != self.module:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                _patch_after_exec(spec.loader, self.patch)
                return spec
        return None


def when_imported(module: str, patch: Patch) -> None:
    """Run `patch(module)` now if `module` is loaded, else right after it is first imported."""
    if module in sys.modules:
        patch(sys.modules[module])
    elif not any(isinstance(f, _PatchOnImport) and f.module == module for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(module, patch))
