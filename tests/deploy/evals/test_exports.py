"""The package's public surface is exactly its `__all__` (as httpx guards its own)."""

from __future__ import annotations

import types

import sglang_pd.deploy.evals as evals


def test_exported_members() -> None:
    names = {n for n, v in vars(evals).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert set(evals.__all__) == names
    assert len(evals.__all__) == len(set(evals.__all__))
