"""DeepEP's antgroup-opt revision (DeepEP PR #483) as a source-only `deep_ep` package, for tests that need its contract.

The plugin reads DeepEP's signatures from its Python sources (`sglang_patches.status`), never importing
it, so a package holding the revision's `Buffer` signatures stands for that DeepEP here. The combine
signature is quoted verbatim from the revision's `deep_ep/buffer.py` (line 629); the dispatch signature
has the same parameters as its `low_latency_dispatch` (line 560), annotations left out.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

from sglang_pd.deploy.common.contract import DEEPEP_REVISION

__all__ = ["DISPATCH_SOURCE", "REVISION", "REVISION_SOURCE", "SOURCE_COPY", "install", "write_package"]

SOURCE_COPY = Path(__file__).resolve().parents[2] / ".gpu_bundle" / "deepep-src" / "deep_ep" / "buffer.py"
#: The revision the image pins (deploy/common/contract.py).
REVISION = DEEPEP_REVISION
SOURCE_COPY = Path(__file__).resolve().parents[2] / ".gpu_bundle" / "deepep-src" / "deep_ep" / "buffer.py"

#: `Buffer.low_latency_combine` of that revision: its signature as written there, body elided.
REVISION_SOURCE = """
class Buffer:
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            overlap: bool = False, packed_recv_count: torch.Tensor = None, comp_signal: torch.Tensor = None,
                            block_m: int = 64, threshold: int = 0, num_sms: int = 3,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> \\
            Tuple[torch.Tensor, EventOverlap, Callable]:
        ...
"""  # noqa: E501 (quoted verbatim)

#: `Buffer.low_latency_dispatch`'s parameters in that revision, body elided.
DISPATCH_SOURCE = """
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False,
                             async_finish=False, return_recv_hook=False):
        ...
"""


def write_package(root: Path) -> Path:
    """A `deep_ep` package under `root` whose buffer.py holds the revision's signatures; returns buffer.py."""
    pkg = root / "deep_ep"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "buffer.py").write_text(REVISION_SOURCE + DISPATCH_SOURCE)
    return pkg / "buffer.py"


def install(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Put the revision's package first on this process's path and on child processes' PYTHONPATH."""
    from sglang_pd.sglang_patches import status

    buffer = write_package(root)
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    # A fresh decision cache for as long as the patch lasts: the process's own one comes back with undo.
    monkeypatch.setattr(status, "deepep_layout", functools.cache(status.deepep_layout.__wrapped__))
    return buffer
