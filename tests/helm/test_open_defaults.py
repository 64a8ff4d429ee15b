"""The chart's defaults are the secure form, and each default that stays open is stated at the top of
values.yaml (`## - OPEN key=value: why`) with the value it really has; the secure ones are checked as
rendered: a generated worker key reaches every pod, the KV fence is on, the router bounds connections."""

from __future__ import annotations

import re
from typing import Any

import yaml

from .conftest import CHART, one

# The defaults that leave something open, as the header must state them.
EXPECTED_OPEN = {
    "rdma.mode": "hostNetwork",
    "router.apiKeySecret.name": "",
    "networkPolicy.enabled": False,
    "cache.type": "hostPath",
}
_OPEN_LINE = re.compile(r"^## - OPEN ([\w.]+)=(\S+): ")


def _get(values: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        values = values[part]
    return values


def _stated(text: str) -> dict[str, Any]:
    """The OPEN lines of the header (the comment block before the first value)."""
    header = text.split("\n\n", 1)[0]
    return {m[1]: yaml.safe_load(m[2]) for line in header.splitlines() if (m := _OPEN_LINE.match(line))}


def test_each_open_default_is_stated_at_the_top_with_its_value() -> None:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    stated = _stated(text)
    assert stated == EXPECTED_OPEN
    for key, value in stated.items():
        assert _get(values, key) == value, key
    # Control: a header whose value differs from the default, or that leaves one out, is caught.
    wrong = text.replace("## - OPEN networkPolicy.enabled=false:", "## - OPEN networkPolicy.enabled=true:")
    assert _stated(wrong)["networkPolicy.enabled"] != _get(values, "networkPolicy.enabled")
    assert _stated(text.replace("## - OPEN cache.type=hostPath:", "## - cache.type=hostPath:")) != EXPECTED_OPEN


def test_the_secure_defaults_render(render) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["workerKeySecret"]["generate"] is True and values["kvFirewall"]["enabled"] is True
    docs = render()
    assert one(docs, "Secret", "-worker-key")["data"]
    (router,) = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"]
    assert "--source-share" in router["command"] and "--body-min-rate" in router["command"]
    decode = one(docs, "LeaderWorkerSet", "-decode")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    (engine,) = decode["spec"]["containers"]
    assert "--no-kv-firewall" not in engine["command"]
    assert "SGLANG_PD_WORKER_API_KEY" in {e["name"] for e in engine["env"]}
