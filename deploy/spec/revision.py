"""A deployment's revision: one short hash of everything that decides whether a prefill's KV can go to a
decode and how both behave. Every worker carries it; the router pairs a prefill only with a decode of the
same revision (router/workers/pairs.py), so an upgrade never sends one revision's KV to another's decode.

What it hashes (`revision_document`):

- the image and the sglang version it holds (the chart's appVersion, `contract.SGLANG_VERSION`);
- the topology sections the renderer reads for the engines (render.py: `model`, `transfer`, `hardware`,
  `prefill`, `decode`), each role's sglang command and environment being a function of them; the counts
  (`prefill.instances`, `decode.groups`) are left out, since scaling changes no pod, and so are `name` and
  `router`, which no engine reads;
- the environment the chart adds to each role's pods (its `env`, `<role>.env` and fabric presets), and the
  model's config.json when the chart mounts one (`model.configFile`).

One revision covers both roles: a prefill and a decode can pair exactly when they were rendered from the
same inputs, so a change to either role moves both to the new revision and both roll (docs/upgrades.md).

The hash is over the inputs rather than the rendered argv because the chart, which labels the pods, cannot
run the renderer. Its template `sglang-pd.revision` (helm/sglang-pd/templates/_helpers.tpl) builds the same
document with Helm's `toJson`, which is Go's encoding/json: keys sorted, no spaces, `<`, `>`, `&`, U+2028 and
U+2029 escaped, numbers as float64. `canonical_json` writes that form, and tests/helm/test_revision_chart.py
holds the chart's label equal to `revision` here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from sglang_pd.deploy.common.contract import SGLANG_VERSION

__all__ = [
    "REVISION_LABEL",
    "canonical_json",
    "revision",
    "revision_document",
    "revision_problem",
    "split_revision",
    "topology_revision",
]

# The pod label that carries a worker's revision (the router's discovery reads it).
REVISION_LABEL = "sglang-pd/revision"
# The topology sections the renderer reads for an engine, and the keys of a role's section it does not.
ENGINE_SECTIONS = ("model", "transfer", "hardware", "prefill", "decode")
_COUNTS = {"prefill": "instances", "decode": "groups"}
# Hex characters kept: 64 bits, and short enough for a label value (63 characters at most).
_LENGTH = 16
# A Kubernetes label value: what a revision may be, from any source.
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")


# What Go's encoding/json escapes in strings beyond JSON's own escapes (HTML-safe output, JS line separators).
_GO_ESCAPED = ("<", ">", "&", "\u2028", "\u2029")


def _go_number(value: float) -> int | float:
    """A number as Go's float64 prints it: integral values without a fraction (1.0 -> 1)."""
    if math.isfinite(value) and value == int(value) and abs(value) < 1e21:
        return int(value)
    return value


def _go_form(value: Any) -> Any:
    """`value` as it is after Helm's YAML-to-JSON decoding: mapping keys are strings, numbers float64."""
    if isinstance(value, Mapping):
        return {str(k): _go_form(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_go_form(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return _go_number(float(value))
    return str(value)


def canonical_json(value: Any) -> str:
    """JSON as Helm's `toJson` (Go's encoding/json) writes it, so that the chart and Python hash equal bytes."""
    text = json.dumps(_go_form(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char in _GO_ESCAPED:
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text


def revision_document(
    topology: Mapping[str, Any],
    *,
    image: str,
    sglang_version: str = SGLANG_VERSION,
    env: Mapping[str, Mapping[str, str]] | None = None,
    model_config: str | None = None,
) -> dict[str, Any]:
    """What a revision hashes. `topology` is the mapping as written (the file, or the chart's value),
    `image` the engines' image reference, `env` the environment the chart adds per role
    (`{"prefill": {...}, "decode": {...}}`), `model_config` the text of a mounted config.json."""
    sections: dict[str, Any] = {}
    for name in ENGINE_SECTIONS:
        section = topology.get(name)
        if name in _COUNTS and isinstance(section, Mapping):
            section = {k: v for k, v in section.items() if k != _COUNTS[name]}
        sections[name] = section
    extra = env or {}
    document: dict[str, Any] = {
        "image": image,
        "sglang": sglang_version,
        "topology": sections,
        "env": {role: dict(extra.get(role) or {}) for role in ("prefill", "decode")},
    }
    if model_config:
        document["model_config"] = hashlib.sha256(model_config.encode()).hexdigest()
    return document


def revision(document: Mapping[str, Any]) -> str:
    """The revision of a `revision_document`: the first 16 hex characters of its canonical JSON's sha256."""
    return hashlib.sha256(canonical_json(document).encode()).hexdigest()[:_LENGTH]


def topology_revision(path: str | Path, *, image: str = "") -> str:
    """The revision of a topology file run without the chart (`sglang-pd up`, static workers)."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: a topology is a YAML mapping.")
    return revision(revision_document(data, image=image))


def revision_problem(value: str) -> str | None:
    """Why `value` cannot be a revision (it must be a Kubernetes label value); None when it can."""
    if _LABEL_VALUE.match(value):
        return None
    return (
        f"revision {value!r} is not valid: use 1-63 letters, digits, '-', '_' or '.', starting and ending "
        "with a letter or digit (as the pods' sglang-pd/revision label holds it)."
    )


def split_revision(option: str) -> tuple[str, str]:
    """`URL@REVISION` -> (URL, REVISION); a URL without `@` has revision "" (unknown). ValueError naming the
    fix when the revision is not valid."""
    url, at, rev = option.rpartition("@")
    if not at:
        return option, ""
    if not url:
        raise ValueError(
            f"worker {option!r} has no URL before '@'. Write URL@REVISION, e.g. http://10.0.0.5:30000@3f2a9c."
        )
    if (problem := revision_problem(rev)) is not None:
        raise ValueError(f"worker {option!r}: {problem}")
    return url, rev


def main(argv: list[str] | None = None) -> int:
    """`python -m sglang_pd.deploy.spec.revision TOPOLOGY [--image IMAGE]`: print the revision of workers run
    from a topology without the chart, for the router's `--prefill URL@REVISION` / `--decode URL@REVISION`."""
    parser = argparse.ArgumentParser(prog="python -m sglang_pd.deploy.spec.revision", description=main.__doc__)
    parser.add_argument("topology", metavar="TOPOLOGY", help="topology YAML file")
    parser.add_argument("--image", default="", help="the engines' image reference (default: none, a local run)")
    args = parser.parse_args(argv)
    try:
        print(topology_revision(args.topology, image=args.image))
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
