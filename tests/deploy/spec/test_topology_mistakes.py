"""A new user's topology mistakes: GPU names in any case, unknown ones with suggestions, a missing config.json as a
warning naming what is skipped, RDMA lists that disagree, unknown keys listing the allowed fields, every rule
error in one pass (through the CLI, as a user meets them)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.deploy.spec.topology import (
    FIELDS_DOC,
    GPU_CAPABILITY,
    ModelSpec,
    Topology,
    TopologyError,
    canonical_gpu,
    check_rules,
    parse_topology,
)

REPO = Path(__file__).resolve().parents[3]
Preset = Callable[..., dict[str, Any]]


def _plan(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.cli", "plan", str(path)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("spelled", ["h200", "H200", " h200 ", "H200"])
def test_gpu_names_match_the_table_whatever_their_case(preset_dict: Preset, spelled: str) -> None:
    d = preset_dict()
    d["hardware"]["gpu"] = spelled
    t = parse_topology(d)
    assert t.hardware.gpu == "H200" and t.hardware.capability() == GPU_CAPABILITY["H200"]
    assert check_rules(t).errors == []


def test_cpu_in_any_case_is_the_local_stack(preset_dict: Preset) -> None:
    d = preset_dict("local-cpu")
    d["hardware"]["gpu"] = "CPU"
    t = parse_topology(d)
    assert t.hardware.gpu == "cpu" and t.is_local
    assert canonical_gpu("gh200") == "GH200" and canonical_gpu("H300") is None


def test_unknown_gpu_is_refused_with_suggestions(preset_dict: Preset, write_topology: Callable[[Any], Path]) -> None:
    d = preset_dict()
    d["hardware"]["gpu"] = "H300"
    r = _plan(write_topology(d))
    assert r.returncode == 1 and r.stdout == ""
    assert "hardware.gpu: 'H300' is not a GPU type sglang-pd knows (known: A100, A800, L40S, L20, H100," in r.stderr
    assert "Did you mean H800 or H200 or H100?" in r.stderr
    assert "set hardware.compute_capability (e.g. '9.0') as well" in r.stderr


def test_an_unknown_gpu_with_its_compute_capability_is_planned(preset_dict: Preset) -> None:
    d = preset_dict()
    d["hardware"]["gpu"] = "H300"
    d["hardware"]["compute_capability"] = "9.0"
    assert not any(e.startswith("hardware.gpu") for e in check_rules(parse_topology(d)).errors)


def test_missing_config_json_is_a_warning_naming_what_is_skipped(preset_dict: Preset) -> None:
    d = preset_dict()
    with_cfg = check_rules(parse_topology(d))
    del d["model"]["config_json"]
    report = check_rules(parse_topology(d))
    assert report.errors == [] and with_cfg.warnings == []
    warning = report.warnings[0]
    assert warning.startswith("model.config_json: unset, so the checks against the model's shape are skipped")
    assert "routed experts against ep" in warning and "startup budget" in warning


def test_ib_devices_outside_rdma_devices_are_refused_even_with_one_rdma_device(preset_dict: Preset) -> None:
    d = preset_dict()
    d["hardware"]["rdma_devices"] = ["mlx5_0"]
    d["transfer"]["ib_devices"] = {0: "mlx5_0", 1: "mlx5_1"}
    errors = check_rules(parse_topology(d)).errors
    assert any(
        e.startswith("transfer.ib_devices: mlx5_1 not among hardware.rdma_devices (mlx5_0); name the same devices")
        for e in errors
    ), errors
    d["transfer"]["ib_devices"] = {0: "mlx5_0", 1: "mlx5_0"}  # the control: consistent lists pass
    assert not any(e.startswith("transfer.ib_devices") for e in check_rules(parse_topology(d)).errors)


def test_unknown_key_lists_the_allowed_fields_and_the_field_reference(
    preset_dict: Preset, write_topology: Callable[[Any], Path]
) -> None:
    d = preset_dict()
    d["model"]["served_nmae"] = "r1"
    r = _plan(write_topology(d))
    assert r.returncode == 1
    allowed = ", ".join(sorted(ModelSpec.model_fields))
    assert f"model.served_nmae: unknown key (did you mean served_name?); model takes {allowed}." in r.stderr
    assert f"Every field is described in {FIELDS_DOC}" in r.stderr and (REPO / FIELDS_DOC).is_file()


def test_unknown_top_level_key_lists_the_sections() -> None:
    with pytest.raises(TopologyError, match=r"hardwre: unknown key \(did you mean hardware\?\); the top level takes "):
        parse_topology({"hardwre": {}, **{k: {} for k in ()}})
    assert "hardware" in Topology.model_fields


def test_every_rule_error_is_reported_in_one_pass(preset_dict: Preset, write_topology: Callable[[Any], Path]) -> None:
    d = preset_dict()
    d["hardware"]["gpu"] = "H300"
    d["decode"]["ep"] = 8  # DeepEP needs ep = tp
    d["model"]["config_json"] = "missing-config.json"  # was raised alone, before the other rules ran
    d["transfer"]["ib_devices"] = {0: "mlx9_0"}
    r = _plan(write_topology(d))
    assert r.returncode == 1
    starts = ("hardware.gpu: 'H300'", "decode.ep: DeepEP", "model.config_json: file ", "transfer.ib_devices: mlx9_0")
    for start in starts:
        assert f"  - {start}" in r.stderr, (start, r.stderr)
    assert "breaks 4 rule(s)" in r.stderr
