"""The chart's plan hook refuses a topology, given as values, whose extra_args or env would override a value the
topology rules checked: the hook Job's own command, run on the files its pod would mount, fails with the rule's
words, and passes the same topology without the override."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sglang_pd.deploy.cli import main as cli_main
from tests.support.override_cases import OVERRIDES

from .conftest import one, preset_topology
from .pod_fs import mount_config_maps


def _run_plan_hook(docs: list[dict[str, Any]], root: Path) -> int:
    """Lay out the plan Job's ConfigMap volumes under `root` and run its container's command on them."""
    job = one(docs, "Job", "-plan")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    spec = job["spec"]["template"]["spec"]
    container = spec["containers"][0]
    mount_config_maps(root, docs, spec, container)
    command = container["command"]
    assert command[:2] == ["sglang-pd", "plan"], command
    mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
    # Paths inside the pod's mounts are read from where the mounts were laid out here.
    argv = [str(root / a.lstrip("/")) if any(a.startswith(m) for m in mounts) else a for a in command[1:]]
    return cli_main(argv)


@pytest.mark.parametrize("case", OVERRIDES)
def test_the_plan_hook_refuses_an_override_of_a_checked_value(
    case: str, render, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    override = OVERRIDES[case]
    preset = preset_topology("deepseek-r1-h200-1p1d")
    assert _run_plan_hook(render({"topology": override.control(preset)}), tmp_path / "control") == 0
    capsys.readouterr()

    docs = render({"topology": override.apply(preset)})
    # The chart carries the override into the topology the hook checks (and the pods would run).
    shipped = yaml.safe_load(one(docs, "ConfigMap", "-plan")["data"]["topology.yaml"])
    assert shipped[override.role].get("extra_args", []) == override.extra_args
    assert override.env.items() <= shipped[override.role].get("env", {}).items()
    assert _run_plan_hook(docs, tmp_path / "override") == 1
    err = capsys.readouterr().err
    assert "the topology breaks 1 rule(s)" in err and override.says in err, err
