"""`router.processes` in the chart: `--processes N` reaches `sglang-pd router` through launch unchanged,
only when N > 1; the schema refuses anything but an integer of 1 or more; the group's temp folder
has a writable /tmp under the read-only root."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from sglang_pd.deploy.cli import main as cli_main
from sglang_pd.deploy.common.contract import ENV_ROUTER_WORKER_API_KEY, ENV_WORKER_API_KEY
from sglang_pd.deploy.router.cli import add_arguments as add_router_arguments

from .conftest import CHART, helm_python, one

ROUTER_MODULE_ARGV = ["-m", "sglang_pd.deploy.cli", "router"]


def _router_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"]
    return container


def _router_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_router_arguments(parser)
    return parser


def _launched_router_argv(docs: list[dict[str, Any]], tmp_path: Path, monkeypatch, capsys) -> list[str]:
    """The router's argv as `sglang-pd launch --dry-run` builds it from the rendered container command."""
    topology = tmp_path / "topology.yaml"
    topology.write_text(one(docs, "ConfigMap", "-topology")["data"]["topology.yaml"])
    command = _router_container(docs)["command"]
    assert command[:4] == ["sglang-pd", "launch", "--role", "router"]
    topology_at = command.index("--topology") + 1
    command = [*command[:topology_at], str(topology), *command[topology_at + 1 :]]
    for name in (ENV_ROUTER_WORKER_API_KEY, ENV_WORKER_API_KEY):
        monkeypatch.delenv(name, raising=False)
    assert cli_main([command[1], "--dry-run", *command[2:]]) == 0
    argv: list[str] = json.loads(capsys.readouterr().out)["argv"]
    assert argv[:3] == ROUTER_MODULE_ARGV
    return argv


def test_default_renders_no_processes_flag_and_matches_the_routers_default(render) -> None:
    default = _router_container(render())
    assert not any(a.startswith("--processes") for a in default["command"])
    assert _router_container(render({"router": {"processes": 1}})) == default
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["router"]["processes"] == _router_parser().parse_args([]).processes == 1


def test_processes_reach_the_router_through_launch_unchanged(render, tmp_path, monkeypatch, capsys) -> None:
    docs = render({"router": {"processes": 3, "extraArgs": ["--max-retries", "2"]}})
    command = _router_container(docs)["command"]
    at = command.index("--processes")
    # Before extraArgs, so a flag given there still wins (argparse keeps the last).
    assert command[at : at + 4] == ["--processes", "3", "--max-retries", "2"]
    argv = _launched_router_argv(docs, tmp_path, monkeypatch, capsys)
    assert argv[argv.index("--processes") : argv.index("--processes") + 2] == ["--processes", "3"]
    parsed = _router_parser().parse_args(argv[len(ROUTER_MODULE_ARGV) :])
    assert parsed.processes == 3 and parsed.max_retries == 2 and parsed.kubernetes


@pytest.mark.parametrize(
    ("processes", "complaint"),
    [(0, "minimum: got 0, want 1"), ("two", "got string, want integer"), (2.5, "got number, want integer")],
    ids=["zero", "string", "fraction"],
)
def test_schema_refuses_anything_but_a_positive_integer(chart, processes, complaint) -> None:
    with pytest.raises(helm_python.HelmError) as info:
        chart.render({"router": {"processes": processes}}, name="demo", namespace="llm")
    error = str(info.value)
    assert "values don't meet the specifications of the schema" in error
    assert "/router/processes" in error and complaint in error


def test_the_group_temp_folder_has_a_writable_tmp(render) -> None:
    """The group's mkdtemp folder (control socket, PROMETHEUS_MULTIPROC_DIR) lands in $TMPDIR or /tmp."""
    docs = render({"router": {"processes": 4}})
    container = _router_container(docs)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "TMPDIR" not in {e["name"] for e in container.get("env") or []}
    (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert not tmp.get("readOnly", False)
    volumes = {v["name"]: v for v in one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes[tmp["name"]]


def test_values_document_processes() -> None:
    text = (CHART / "values.yaml").read_text()
    line = next(x for x in text.splitlines() if x.startswith("## @param router.processes "))
    assert "SO_REUSEPORT" in line and "router.resources.requests.cpu" in line
