"""`sglang-pd doctor`: versions, GPU, kernel, DeepEP layout, SBO modes and why not; `plan --check` SBO warnings."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from sglang_pd.deploy.cli import main
from sglang_pd.deploy.common import node
from sglang_pd.deploy.ops import doctor
from sglang_pd.deploy.sglang import sbo as sbo_checks
from sglang_pd.deploy.spec.topology import parse_topology
from sglang_pd.sglang_patches import status

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

has_deepep = status.distribution_version("sgl-deep-ep") is not None


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status, "device_capability", lambda: (9, 0))
    monkeypatch.setattr(doctor, "_gpu", lambda: {"capability": "sm_90", "name": "NVIDIA H200", "count": 8})
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)


def test_json_report_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--format", "json", "--skip-targets"]) == 0
    doc = json.loads(capsys.readouterr().out)
    keys = {"versions", "gpu", "kernel", "deepep_combine", "plugin", "deepep_driver", "hook_targets", "ep_nodes", "sbo"}
    assert set(doc) == keys | {"sglang_flags"}
    assert doc["sglang_flags"] is None  # --skip-targets imports no sglang
    assert set(doc["versions"]) == set(doctor.DISTRIBUTIONS)
    assert doc["versions"]["sglang-pd"] is not None
    assert set(doc["sbo"]) == {"full", "shared-only"}
    if status.device_capability() is None:  # a CPU machine says so, for both modes
        assert doc["gpu"]["capability"] is None
        assert doc["sbo"]["full"] == {"ok": False, "reason": "no CUDA device is visible"}
        assert not doc["kernel"]["usable"] and "no CUDA device" in doc["kernel"]["reason"]


def test_table_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--skip-targets"]) == 0
    out = capsys.readouterr().out
    rows = ("sglang", "sgl-deep-ep", "sgl-deep-gemm", "GPU", "our sm_90 kernel", "DeepEP driver options", "SBO full")
    for row in rows:
        assert any(line.startswith(row) for line in out.splitlines()), row


def test_sm90_with_our_kernel_and_antgroup_opt_serves_both_halves(sm90, antgroup_deepep) -> None:
    doc = doctor.collect(check_targets=False, ep_nodes=2)
    assert doc["kernel"]["usable"], doc["kernel"]
    assert doc["deepep_combine"]["layout"] == "sglang"
    assert doc["ep_nodes"] == 2
    assert doc["sbo"]["full"] == {"ok": True, "reason": "", "by": "sglang-pd plugin, sglang signal layout"}
    assert doc["sbo"]["shared-only"]["ok"]


@pytest.mark.skipif(not has_deepep, reason="sgl-deep-ep is not installed (dev extra, --no-deps)")
def test_sgl_deep_ep_serves_full_sbo_only_on_one_node_with_its_send_sms(
    sm90, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert doctor.collect(check_targets=False)["deepep_combine"]["layout"] == "deepep"
    monkeypatch.setenv(status.COMBINE_SEND_SMS_ENV, "32")
    assert doctor.collect(check_targets=False, ep_nodes=1)["sbo"]["full"]["ok"]
    across = doctor.collect(check_targets=False, ep_nodes=2)["sbo"]["full"]
    assert not across["ok"] and "traps on a peer across nodes, and decode EP here spans 2 nodes" in across["reason"]
    assert "Fix: build DeepEP's antgroup-opt branch" in across["reason"]
    monkeypatch.delenv(status.COMBINE_SEND_SMS_ENV)
    mismatch = doctor.collect(check_targets=False, ep_nodes=1)["sbo"]["full"]
    assert not mismatch["ok"] and "it sends on 32 SMs while sglang leaves 3 to combine-send" in mismatch["reason"]
    assert doctor.collect(check_targets=False, ep_nodes=2)["sbo"]["shared-only"]["ok"]
    # In a pod the group size says how many nodes the decode EP spans.
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    monkeypatch.setenv(status.COMBINE_SEND_SMS_ENV, "32")
    assert main(["doctor", "--skip-targets", "--expect", "full"]) == doctor.EXIT_INVALID
    assert "error: SBO full cannot run here: full SBO on sm_90 with sgl-deep-ep's" in capsys.readouterr().err
    assert main(["doctor", "--skip-targets", "--expect", "full", "--ep-nodes", "1"]) == 0


def test_capability_is_assumed_where_no_gpu_is_visible(antgroup_deepep, capsys: pytest.CaptureFixture[str]) -> None:
    """An image build has no GPU: `--capability 9.0` judges the image's stack for an sm_90 device."""
    pytest.importorskip(status.KERNEL_MODULE, reason="our kernel needs torch and triton")
    try:
        code = main(["doctor", "--skip-targets", "--capability", "9.0", "--ep-nodes", "2", "--expect", "full"])
    finally:
        status.assume_capability(None)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "none looked at; judged as sm_90 (--capability)" in out
    assert status.device_capability() != (9, 0) or status.assumed_capability() is None


def test_kernel_row_says_which_kernel_runs(sm90, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = pytest.importorskip(status.KERNEL_MODULE, reason="our kernel needs torch and triton")
    for ws, expected in ((True, "warp-specialized (Gluon): yes"), (False, "Triton only")):
        monkeypatch.setattr(kernel, "ws_usable", lambda *a, ws=ws: ws)
        doc = doctor.collect(check_targets=False)
        assert doc["kernel"]["usable"] and doc["kernel"]["warp_specialized"] is ws
        row = next(line for line in doctor.format_table(doc).splitlines() if line.startswith("our sm_90 kernel"))
        assert expected in row, row


@pytest.mark.skipif(not has_deepep, reason="sgl-deep-ep is not installed (dev extra, --no-deps)")
def test_sm90_without_our_kernel_serves_shared_only(
    sm90, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, status.KERNEL_MODULE, None)
    doc = doctor.collect(check_targets=False)
    assert not doc["sbo"]["full"]["ok"] and "does not import" in doc["sbo"]["full"]["reason"]
    assert doc["sbo"]["shared-only"]["ok"]
    assert main(["doctor", "--skip-targets", "--expect", "shared-only"]) == 0
    assert main(["doctor", "--skip-targets", "--expect", "full"]) == doctor.EXIT_INVALID
    assert "error: SBO full cannot run here: our kernel" in capsys.readouterr().err


def test_sglang_plugins_whitelist_without_us_is_reported(sm90, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    doc = doctor.collect(check_targets=False)
    assert doc["plugin"]["entry_point"] and not doc["plugin"]["loaded_by_sglang"]
    assert doc["sbo"]["shared-only"] == {"ok": False, "reason": "the sglang-pd plugin is excluded by SGLANG_PLUGINS"}


def test_other_architectures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "_gpu", lambda: {"capability": "sm_80", "name": "A100", "count": 8})
    assert (
        "needs Hopper (sm_90, with this plugin) or Blackwell; this is sm_80"
        in (doctor.collect(check_targets=False)["sbo"]["full"]["reason"])
    )
    monkeypatch.setattr(doctor, "_gpu", lambda: {"capability": "sm_100", "name": "B200", "count": 8})
    assert doctor.collect(check_targets=False)["sbo"]["full"]["ok"]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
def test_hook_targets_are_checked_and_probed_against_the_installed_sglang() -> None:
    doc = doctor.collect(check_targets=True)
    assert doc["hook_targets"] == {name: "ok" for name in doc["hook_targets"]}
    assert set(doc["hook_targets"]) == {
        "moe-config",
        "down-gemm",
        "combine-signal",
        "combine-call",
        "shared-stream",
        "shared-only",
    }


NO_EFFECT_HOOKS = """
from dataclasses import replace

from sglang_pd.sglang_patches.plugin import HOOKS as _REAL


def passthrough(original, *args, **kwargs):
    return original(*args, **kwargs)


# The moe-config hook as a version that does not reach what sglang reads: it runs sglang unchanged.
HOOKS = {**_REAL, "moe-config": replace(_REAL["moe-config"], hook=passthrough)}
"""


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
def test_doctor_catches_a_hook_without_effect(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target exists with its parameters, so the name check passes; the probe shows sglang still refuses."""
    (tmp_path / "no_effect_hooks.py").write_text(NO_EFFECT_HOOKS)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    targets = doctor._targets(hooks="no_effect_hooks:HOOKS")
    problem = targets["moe-config"]
    assert problem is not None
    assert problem.startswith("hook 'moe-config' does not take effect in the installed sglang: no effect: ")
    assert "still refuses SBO on sm_90 under the hook" in problem
    assert "SBO (single batch overlap) is not supported on SM90 GPUs" in problem
    assert [name for name, p in targets.items() if p is not None] == ["moe-config"]
    modes = doctor._sbo_modes("sm_90", {"loaded_by_sglang": True, "entry_point": True}, targets)
    assert not modes["full"]["ok"] and not modes["shared-only"]["ok"]
    assert "does not take effect" in modes["shared-only"]["reason"]


@pytest.mark.parametrize(
    ("gpu", "capability", "sbo", "warned"),
    [
        ("A100", None, "full", True),
        ("L40S", None, "shared-only", True),
        ("H200", None, "full", False),
        ("B200", None, "full", False),
        ("H200-NVL", "9.0", "full", False),  # a type the GPU table lacks, placed by its capability
        ("A800", "8.0", "full", True),
    ],
)
def test_plan_warnings_for_sbo_on_gpus_this_build_cannot_serve(
    preset_dict, gpu: str, capability: str | None, sbo: str, warned: bool
) -> None:
    data = preset_dict()
    data["hardware"]["gpu"] = gpu
    if capability is not None:
        data["hardware"]["compute_capability"] = capability
    data["decode"]["sbo"] = sbo
    warnings = sbo_checks.sbo_topology_warnings(parse_topology(data))
    assert bool(warnings) == warned, warnings
    if warned:
        assert warnings[0].startswith(f"decode.sbo: {sbo} on hardware.gpu {gpu}: this build serves SBO on Hopper")


def test_plan_warns_when_the_plugin_is_not_installed(preset_dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sbo_checks.importlib.metadata, "entry_points", lambda group: [])
    [warning] = sbo_checks.sbo_topology_warnings(parse_topology(preset_dict()))
    assert "needs the sglang-pd sglang plugin, and its entry point is not installed here" in warning


def test_plan_check_shows_the_sbo_warning(preset_dict, write_topology, capsys: pytest.CaptureFixture[str]) -> None:
    data = preset_dict()
    data["hardware"]["gpu"] = "A100"
    main(["plan", str(write_topology(data)), "--check", "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert any(w.startswith("decode.sbo: full on hardware.gpu A100") for w in doc["warnings"])


@pytest.mark.skipif(not has_deepep, reason="sgl-deep-ep is not installed (dev extra, --no-deps)")
def test_plan_check_refuses_sgl_deep_ep_across_nodes(preset_dict, write_topology, capsys) -> None:
    """The H200 preset's decode EP16 spans 2 nodes; with this machine's sgl-deep-ep full SBO would trap there."""
    data = preset_dict()
    assert data["decode"]["nodes"] == 2 and data["decode"]["sbo"] == "full"
    path = write_topology(data)
    errors = sbo_checks.sbo_topology_errors(parse_topology(data))
    [error] = errors
    assert error.startswith("decode.sbo: full on H200 with decode.nodes=2: full SBO on sm_90 with sgl-deep-ep's")
    assert "traps on a peer across nodes" in error and "Fix: build DeepEP's antgroup-opt branch" in error
    assert "judged from the DeepEP installed where this check runs: 0.1.2.post1" in error
    assert main(["plan", str(path), "--check", "--local-deepep", "--format", "json"]) == doctor.EXIT_INVALID
    doc = json.loads(capsys.readouterr().out)
    assert doc["errors"] == errors


def test_plan_check_accepts_antgroup_opt_across_nodes(preset_dict, antgroup_deepep) -> None:
    assert sbo_checks.sbo_topology_errors(parse_topology(preset_dict())) == []


# --- DeepEP's NVIDIA driver options (/proc/driver/nvidia/params) or GDRCopy ---------------------

PARAMS_SET = 'EnableStreamMemOPs: 1\nRegistryDwords: "PeerMappingOverride=1;"\nEnableMSI: 1\n'
PARAMS_UNSET = 'EnableStreamMemOPs: 0\nRegistryDwords: ""\nEnableMSI: 1\n'


@pytest.mark.parametrize(
    ("params", "gdrcopy", "ok"),
    [(PARAMS_SET, False, True), (PARAMS_UNSET, True, True), (PARAMS_UNSET, False, False)],
    ids=["driver-options", "gdrcopy", "neither"],
)
def test_deepep_driver_options(tmp_path, params: str, gdrcopy: bool, ok: bool) -> None:
    (tmp_path / "params").write_text(params)
    if gdrcopy:
        (tmp_path / "gdrdrv").touch()
    found = node.deepep_driver(tmp_path / "params", tmp_path / "gdrdrv")
    assert found["ok"] is ok and found["driver"] is True
    if not ok:
        assert "DeepEP across nodes will fail" in found["detail"]
        assert 'NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"' in found["detail"]
        assert "or install GDRCopy" in found["detail"]


def test_deepep_driver_without_nvidia_driver(tmp_path) -> None:
    found = node.deepep_driver(tmp_path / "absent", tmp_path / "gdrdrv")
    assert found == {"ok": None, "driver": False, "detail": f"no NVIDIA driver here ({tmp_path / 'absent'} is absent)"}


def test_kv_probe_reports_the_driver_options(monkeypatch) -> None:
    from sglang_pd.deploy.kv import cli as kv_cli

    missing = {"ok": False, "driver": True, "detail": "EnableStreamMemOPs=not 1; " + node.DRIVER_FIX}
    monkeypatch.setattr(kv_cli, "deepep_driver", lambda: missing)
    row = kv_cli._deepep_driver_check()
    assert row == {"check": "deepep-driver", "ok": False, "advisory": True, "detail": missing["detail"]}
    monkeypatch.setattr(kv_cli, "deepep_driver", lambda: {"ok": None, "driver": False, "detail": "no NVIDIA driver"})
    assert kv_cli._deepep_driver_check()["ok"] is True  # nothing to check on a machine without the driver


@pytest.mark.parametrize(("installed", "warned"), [("0.5.23", False), ("0.5.17", False), ("0.5.99", True)])
def test_plan_warns_only_for_an_sglang_the_hooks_were_not_tested_in(
    preset_dict, monkeypatch: pytest.MonkeyPatch, installed: str, warned: bool
) -> None:
    real = status.distribution_version
    monkeypatch.setattr(status, "distribution_version", lambda name: installed if name == "sglang" else real(name))
    warnings = sbo_checks.sbo_topology_warnings(parse_topology(preset_dict()))
    assert any("relies on hooks written for sglang 0.5.23" in w for w in warnings) is warned
