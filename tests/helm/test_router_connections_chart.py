"""`router.connections` in the chart: the connection cap, one address's share of it and the body's
minimum rate reach `sglang-pd router` through launch as its flags, the chart's defaults are the
router's own, and the schema refuses a share outside (0, 1]."""

from __future__ import annotations

import pytest
import yaml

from sglang_pd.deploy.router.config import RouterConfig

from .conftest import CHART, helm_python
from .test_router_processes import ROUTER_MODULE_ARGV, _launched_router_argv, _router_parser


def test_connection_values_reach_the_router_as_its_flags(render, tmp_path, monkeypatch, capsys) -> None:
    values = {"maxConnections": 2000, "sourceShare": 0.1, "bodyMinRate": 4096, "bodyGraceSeconds": 2.5}
    docs = render({"router": {"connections": values}})
    argv = _launched_router_argv(docs, tmp_path, monkeypatch, capsys)
    parsed = _router_parser().parse_args(argv[len(ROUTER_MODULE_ARGV) :])
    assert (parsed.max_connections, parsed.source_share, parsed.body_min_rate, parsed.body_grace) == (
        2000,
        0.1,
        4096,
        2.5,
    )


def test_the_charts_defaults_are_the_routers() -> None:
    shipped = yaml.safe_load((CHART / "values.yaml").read_text())["router"]["connections"]
    config = RouterConfig()
    assert shipped == {
        "maxConnections": config.max_connections,
        "sourceShare": config.source_share,
        "bodyMinRate": config.body_min_rate,
        "bodyGraceSeconds": config.body_grace_s,
    }


@pytest.mark.parametrize(
    ("share", "complaint"), [(0, "exclusiveMinimum"), (1.5, "maximum"), ("half", "got string, want number")]
)
def test_schema_refuses_a_share_outside_zero_to_one(chart, share, complaint) -> None:
    with pytest.raises(helm_python.HelmError) as info:
        chart.render({"router": {"connections": {"sourceShare": share}}}, name="demo", namespace="llm")
    error = str(info.value)
    assert "/router/connections/sourceShare" in error and complaint in error, error
