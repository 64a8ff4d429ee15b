"""Keep the Helm chart in step with the Python package: the values schema and the shipped presets.

- `helm/sglang-pd/values.schema.json`: the chart's own keys are written by hand; `$defs` and the
  `topology` property come from `sglang_pd.deploy.spec.topology.Topology`, so `helm install` rejects a
  bad topology with the same field rules as `sglang-pd plan`; `preset` lists the presets the chart runs.
- `helm/sglang-pd/files/presets/*.yaml`: copies of the `deploy/spec/presets/*.yaml` the chart runs: all but
  the colocated ones (`hardware.colocated: true`, e.g. `single-h200`), whose prefill and decode share one
  node's GPUs as `sglang-pd up` runs them; the chart gives each instance and group pods of its own.
- `helm/sglang-pd/files/topology-defaults.yaml`: the models' defaults for the keys templates read
  (ports, counts), so a topology that omits them renders as `sglang-pd launch` will run it.
- `helm/sglang-pd/files/topology-fields.yaml`: the topology's keys, nested as its models are, each leaf with
  the JSON types its field takes, so that the chart names an unknown key or a value of the wrong type in a
  topology given as a string (`--set-file topology=FILE`), which Helm's schema check cannot look inside.
- `helm/sglang-pd/files/topology-required.yaml`: the topology's required top-level fields, so that the chart
  names a missing one in a topology given as a string before a template reads it.
- `helm/sglang-pd/files/model-sizes.yaml`: the checkpoint size sglang-pd estimates from each
  shipped config.json (`estimate_weight_bytes`), from which the chart derives startup budgets.

    python scripts/sync_chart.py          # rewrite them
    python scripts/sync_chart.py --check  # exit 1 when one is stale (tests/helm runs this)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from sglang_pd.deploy.spec.topology import Topology, estimate_weight_bytes

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "sglang-pd"
SCHEMA = CHART / "values.schema.json"
PRESETS = REPO / "deploy" / "spec" / "presets"
CHART_PRESETS = CHART / "files" / "presets"
DEFAULTS = CHART / "files" / "topology-defaults.yaml"
MODEL_SIZES = CHART / "files" / "model-sizes.yaml"
FIELDS = CHART / "files" / "topology-fields.yaml"
REQUIRED = CHART / "files" / "topology-required.yaml"
# The preset the chart runs when neither `preset` nor `topology` is set ("sglang-pd.presetName").
DEFAULT_PRESET = "deepseek-r1-h200-1p1d"
# The topology keys the chart's templates read; their defaults come from the pydantic models.
READ_BY_TEMPLATES = {
    "model": ["served_name", "page_size", "context_length"],
    "prefill": ["instances", "nodes", "port", "bootstrap_port", "attn_dp_size", "max_running_requests"],
    "decode": ["groups", "nodes", "port", "attn_dp_size", "max_running_requests"],
    "transfer": ["backend", "protocol", "ib_devices"],
    "router": ["port"],
}


def _strip_titles(node: Any) -> Any:
    # pydantic adds a `title` to every property; Helm's error messages are clearer without them.
    if isinstance(node, dict):
        return {k: _strip_titles(v) for k, v in node.items() if k != "title" and not (k == "format" and v == "path")}
    if isinstance(node, list):
        return [_strip_titles(v) for v in node]
    return node


def chart_presets() -> list[Path]:
    """The shipped presets the chart offers: every one but those whose roles share one node's GPUs."""
    return [p for p in sorted(PRESETS.glob("*.yaml")) if not yaml.safe_load(p.read_text())["hardware"].get("colocated")]


def wanted_schema(current: dict[str, Any]) -> dict[str, Any]:
    topo = _strip_titles(Topology.model_json_schema())
    defs = topo.pop("$defs")
    defs["Topology"] = topo
    props = dict(current["properties"])
    props["preset"] = {
        "type": "string",
        "description": "Shipped topology to run instead of `topology` (setting both is refused); empty with no "
        f"topology: {DEFAULT_PRESET} (the colocated one-node presets, such as single-h200, are for "
        "`sglang-pd up` and not offered here)",
        "enum": ["", *sorted(p.stem for p in chart_presets())],
    }
    # if/then rather than anyOf: Helm then reports only the topology's own problem (the bad key or type),
    # not one line per alternative that did not match.
    props["topology"] = {
        "description": "Your own topology (deploy/spec/presets/*.yaml format), used whole; empty: the preset. "
        "A string is a whole topology file (--set-file topology=FILE), whose keys the chart checks itself.",
        "type": ["object", "string"],
        "if": {"type": "object", "minProperties": 1},
        "then": {"$ref": "#/$defs/Topology"},
    }
    return {**current, "properties": props, "$defs": defs}


def wanted_defaults() -> str:
    doc = {}
    for section, keys in READ_BY_TEMPLATES.items():
        model = Topology.model_fields[section].annotation
        fields = model.model_fields  # type: ignore[union-attr]
        doc[section] = {k: fields[k].get_default(call_default_factory=True) for k in keys}
    header = "# Generated by scripts/sync_chart.py from sglang_pd.deploy.spec.topology: do not edit.\n"
    return header + yaml.safe_dump(doc, sort_keys=False)


def _json_types(prop: dict[str, Any], defs: dict[str, Any]) -> list[str]:
    """The JSON types a property of the topology's schema takes (its enums' and references' included)."""
    if "$ref" in prop:
        return _json_types(defs[prop["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in prop:
        return sorted({t for alt in prop["anyOf"] for t in _json_types(alt, defs)})
    kind = prop["type"]
    return sorted(kind) if isinstance(kind, list) else [kind]


def _fields(model: type[BaseModel], schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out[name] = _fields(sub, defs[sub.__name__], defs)
        else:
            out[name] = _json_types(schema["properties"][name], defs)
    return out


def wanted_fields() -> str:
    header = "# Generated by scripts/sync_chart.py from sglang_pd.deploy.spec.topology.Topology: do not edit.\n"
    schema = Topology.model_json_schema()
    return header + yaml.safe_dump(_fields(Topology, schema, schema["$defs"]), sort_keys=True)


def wanted_required() -> str:
    header = "# Generated by scripts/sync_chart.py from sglang_pd.deploy.spec.topology.Topology: do not edit.\n"
    return header + yaml.safe_dump(sorted(k for k, f in Topology.model_fields.items() if f.is_required()))


def wanted_model_sizes() -> str:
    sizes = {p.name: estimate_weight_bytes(json.loads(p.read_text())) for p in sorted(PRESETS.glob("*config.json"))}
    header = (
        "# Generated by scripts/sync_chart.py: checkpoint bytes estimated from each shipped config.json "
        "(sglang_pd.deploy.spec.topology.estimate_weight_bytes); do not edit.\n"
    )
    return header + yaml.safe_dump(sizes, sort_keys=True)


def wanted_presets() -> dict[str, str]:
    return {p.name: p.read_text() for p in chart_presets()}


def main(argv: list[str]) -> int:
    current = json.loads(SCHEMA.read_text())
    schema = wanted_schema(current)
    presets = wanted_presets()
    shipped = {p.name: p.read_text() for p in sorted(CHART_PRESETS.glob("*.yaml"))}
    generated = {
        DEFAULTS: wanted_defaults(),
        MODEL_SIZES: wanted_model_sizes(),
        FIELDS: wanted_fields(),
        REQUIRED: wanted_required(),
    }
    if "--check" in argv:
        stale = [str(SCHEMA)] if schema != current else []
        stale += [str(CHART_PRESETS)] if presets != shipped else []
        stale += [str(path) for path, text in generated.items() if not path.exists() or path.read_text() != text]
        if stale:
            print(f"stale: {', '.join(stale)}; run python scripts/sync_chart.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(json.dumps(schema, indent=2) + "\n")
    for path, text in generated.items():
        path.write_text(text)
    CHART_PRESETS.mkdir(parents=True, exist_ok=True)
    for name in set(shipped) - set(presets):
        (CHART_PRESETS / name).unlink()
    for name, text in presets.items():
        (CHART_PRESETS / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
