"""The chart offers only the presets it runs: every preset its schema lists renders, the shipped copies are exactly
those, and the colocated one-node presets (for `sglang-pd up`) are neither listed nor shipped."""

from __future__ import annotations

import json

import pytest
import yaml

from .conftest import CHART, PRESETS, by_kind, helm_python, preset_values

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
# The schema also takes "" (the default: no preset named, so that a topology alone is not refused).
OFFERED: list[str] = [p for p in SCHEMA["properties"]["preset"]["enum"] if p]
ALL_PRESETS = sorted(p.stem for p in PRESETS.glob("*.yaml"))
COLOCATED = [p for p in ALL_PRESETS if yaml.safe_load((PRESETS / f"{p}.yaml").read_text())["hardware"].get("colocated")]


def test_the_schema_offers_the_shipped_copies_and_no_colocated_preset() -> None:
    assert sorted(p.stem for p in (CHART / "files" / "presets").glob("*.yaml")) == sorted(OFFERED)
    assert COLOCATED == ["single-h200", "single-h200-sbo"]
    assert sorted(OFFERED) == sorted(set(ALL_PRESETS) - set(COLOCATED))
    assert "" in SCHEMA["properties"]["preset"]["enum"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["preset"] == ""


@pytest.mark.parametrize("preset", OFFERED)
def test_every_offered_preset_renders(render, preset: str) -> None:
    docs = render(preset_values(preset))
    assert {d["metadata"]["name"] for d in by_kind(docs, "LeaderWorkerSet")} == {
        "demo-sglang-pd-prefill",
        "demo-sglang-pd-decode",
    }


@pytest.mark.parametrize("preset", COLOCATED)
def test_a_preset_the_chart_does_not_offer_is_refused_by_its_schema(chart, preset: str) -> None:
    with pytest.raises(helm_python.HelmError) as info:
        chart.render(preset_values(preset), name="demo", namespace="llm")
    assert "/preset" in str(info.value) and "value must be one of" in str(info.value)


def test_the_values_docs_list_the_offered_presets() -> None:
    doc = next(line for line in (CHART / "values.yaml").read_text().splitlines() if "@param preset " in line)
    listed = doc.split(":", 1)[1].split(".")[0]
    assert sorted(p.strip(" ,") for p in listed.replace(" or ", ",").split(",") if p.strip(" ,")) == sorted(OFFERED)
