"""The proxy-fence check on PTX that Triton compiles here for sm_90 (no GPU needed): the kernels'
release helpers pass it, a release without the fence fails it, and so does a cache with no release."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
gluon = pytest.importorskip("triton.experimental.gluon")
gl = pytest.importorskip("triton.experimental.gluon.language")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sglang_pd.kernels import signal_gemm as sg  # noqa: E402
from sglang_pd.kernels import signal_gemm_ws as ws  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts/gpu"))
check_ptx_fences = importlib.import_module("check_ptx_fences")

pytestmark = pytest.mark.slow  # each compile takes a second or two on 2 cores

SM90 = GPUTarget("cuda", 90, 32)


@triton.jit
def _store_then_release_one(p):
    tl.store(p + 1, 1)
    sg._release_add_one(p)


@triton.jit
def _store_then_release_range(p):
    tl.store(p + 40, 1)
    sg._release_add_one_range(p, 0, 8)


@triton.jit
def _store_then_fence_then_atomic(p):
    tl.store(p + 1, 1)
    sg._fence_for_tma_readers()
    tl.debug_barrier()
    tl.atomic_add(p, 1, sem="release", scope="gpu")


@triton.jit
def _store_then_atomic_without_fence(p):
    tl.store(p + 1, 1)
    tl.debug_barrier()
    tl.atomic_add(p, 1, sem="release", scope="gpu")


@triton.jit
def _store_then_default_atomic(p):  # Triton's default sem is acq_rel: a release too
    tl.store(p + 1, 1)
    tl.debug_barrier()
    tl.atomic_add(p, 1, scope="gpu")


@gluon.jit
def _gluon_store_then_fence_then_atomic(p):
    gl.store(p + 1, 1)
    ws._fence_for_tma_readers()
    ws._barrier()
    gl.atomic_add(p, 1, sem="release", scope="gpu")


def _ptx(fn: object, source: type = ASTSource) -> str:
    return str(triton.compile(source(fn=fn, signature={"p": "*i32"}, constexprs={}), target=SM90).asm["ptx"])


SHIPPED_RELEASES = [_store_then_release_one, _store_then_release_range, _store_then_fence_then_atomic]


@pytest.mark.parametrize("kernel", SHIPPED_RELEASES, ids=lambda k: k.__name__)
def test_the_kernels_release_paths_fence_their_stores(kernel: object) -> None:
    assert check_ptx_fences.check_ptx(_ptx(kernel))["fenced"] == 1


def test_the_gluon_storers_fence_compiles_before_its_release() -> None:
    runtime = pytest.importorskip("triton.experimental.gluon._runtime")
    result = check_ptx_fences.check_ptx(_ptx(_gluon_store_then_fence_then_atomic, runtime.GluonASTSource))
    assert result == {"kernel": "_gluon_store_then_fence_then_atomic", "releases": 1, "fenced": 1}


def test_a_release_without_the_fence_fails_the_cache_check(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a/good.ptx").write_text(_ptx(_store_then_release_one))
    (tmp_path / "a/bad.ptx").write_text(_ptx(_store_then_atomic_without_fence))
    result = check_ptx_fences.check_cache(tmp_path)
    assert result["ok"] is False
    assert [k["kernel"] for k in result["unfenced"]] == ["_store_then_atomic_without_fence"]


def test_an_acq_rel_atomic_counts_as_a_release() -> None:
    assert check_ptx_fences.check_ptx(_ptx(_store_then_default_atomic)) == {
        "kernel": "_store_then_default_atomic",
        "releases": 1,
        "fenced": 0,
    }


def test_a_fence_before_a_later_store_does_not_count() -> None:
    lines = [".entry k(", "fence.proxy.async.global;", "st.global.b32 [%rd1], %r1;"]
    ptx = "\n".join([*lines, "red.release.gpu.global.add.s32 [%rd2], 1;"])
    assert check_ptx_fences.check_ptx(ptx) == {"kernel": "k", "releases": 1, "fenced": 0}


def test_a_cache_without_releases_fails(tmp_path: Path) -> None:
    (tmp_path / "plain.ptx").write_text(".entry k(\n st.global.b32 [%rd1], %r1;\n")
    assert check_ptx_fences.check_cache(tmp_path)["ok"] is False


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "good.ptx").write_text(_ptx(_store_then_release_one))
    monkeypatch.setattr(sys, "argv", ["check_ptx_fences.py", str(tmp_path)])
    assert check_ptx_fences.main() == 0
    (tmp_path / "bad.ptx").write_text(_ptx(_store_then_atomic_without_fence))
    assert check_ptx_fences.main() == 1
    monkeypatch.setattr(sys, "argv", ["check_ptx_fences.py", str(tmp_path / "missing")])
    assert check_ptx_fences.main() == 2
    assert "TRITON_CACHE_DIR" in capsys.readouterr().err
