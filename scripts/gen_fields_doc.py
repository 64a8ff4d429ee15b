"""Write docs/fields.md, the topology file's field reference, from its pydantic models (deploy/spec/topology.py).

    python scripts/gen_fields_doc.py           # rewrite docs/fields.md
    python scripts/gen_fields_doc.py --check   # exit 1 when the committed page differs from the models

One table a section (the top level, then each nested model in the order a topology file lists them):
each key, its type with its bounds, its default, and the field's description. The page is never edited
by hand: tests/scripts/test_gen_fields_doc.py holds it equal to this output.
"""

from __future__ import annotations

import argparse
import enum
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from sglang_pd.deploy.spec.topology import FIELDS_DOC, Topology

REPO = Path(__file__).resolve().parents[1]
BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}


def _type(annotation: Any) -> str:
    """`annotation` as a reader of a YAML file would name it."""
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(f"`{a}`" for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        parts = [a for a in get_args(annotation) if a is not type(None)]
        shown = " or ".join(_type(a) for a in parts)
        return f"{shown} or null" if len(parts) < len(get_args(annotation)) else shown
    if origin is list:
        return f"list of {_type(get_args(annotation)[0])}"
    if origin is dict:
        key, value = get_args(annotation)
        return f"map of {_type(key)} to {_type(value)}"
    if getattr(annotation, "__metadata__", None) is not None:  # Annotated[...]
        base = _type(get_args(annotation)[0])
        return base + "".join(_bounds(m) for m in annotation.__metadata__)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(f"`{m.value}`" for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{_section_title(annotation)}](#{_anchor(annotation)})"
    names = {int: "integer", float: "number", str: "string", bool: "boolean", Path: "path"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(meta: Any) -> str:
    """Constraints pydantic keeps as metadata (Field(ge=1), ...), as `, ≥ 1`."""
    if isinstance(meta, FieldInfo):
        return "".join(_bounds(m) for m in meta.metadata)
    out = [f"{sign} {getattr(meta, name)}" for name, sign in BOUNDS.items() if getattr(meta, name, None) is not None]
    if getattr(meta, "pattern", None):
        out.append(f"matching `{meta.pattern}`")
    if getattr(meta, "max_length", None) is not None:
        out.append(f"at most {meta.max_length} characters")
    return "".join(f" {o}" if o[0] in "≥><≤" else f", {o}" for o in out)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        return "see its section" if isinstance(value, BaseModel) else f"`{value!r}`"
    value = field.default
    if value is PydanticUndefined or value is None:
        return "null" if value is None else "required"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _sections(model: type[BaseModel], path: str, out: list[tuple[str, type[BaseModel]]]) -> None:
    out.append((path, model))
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            _sections(annotation, f"{path}.{name}" if path else name, out)


_TITLES: dict[type[BaseModel], str] = {}


def _section_title(model: type[BaseModel]) -> str:
    return _TITLES.get(model, model.__name__)


def _anchor(model: type[BaseModel]) -> str:
    return _section_title(model).replace(".", "").replace(" ", "-").lower()


def render() -> str:
    sections: list[tuple[str, type[BaseModel]]] = []
    _sections(Topology, "", sections)
    _TITLES.clear()
    _TITLES.update({model: path or "top level" for path, model in sections})
    lines = [
        "# Topology fields",
        "",
        "<!-- Written by scripts/gen_fields_doc.py from deploy/spec/topology.py; do not edit by hand. -->",
        "",
        "Every key a topology file (YAML) may hold, by section. An unknown key is an error, so a typo never",
        "falls back to a default. Rules that relate keys of different sections (`sglang-pd plan` checks them)",
        "are in [topology.md](topology.md).",
        "",
    ]
    for path, model in sections:
        title = path or "top level"
        lines += [f"## {title}", ""]
        doc = (model.__doc__ or "").strip().splitlines()
        if doc and model is not Topology:
            lines += [doc[0], ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            kind = _type(field.annotation) + "".join(_bounds(m) for m in field.metadata)
            description = _cell(field.description or "")
            lines.append(f"| `{name}` | {_cell(kind)} | {_cell(_default(field))} | {description} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed page instead of writing it")
    args = parser.parse_args(argv)
    page = REPO / FIELDS_DOC
    text = render()
    if args.check:
        if not page.exists() or page.read_text() != text:
            print(f"{FIELDS_DOC} is out of date: run python scripts/gen_fields_doc.py", file=sys.stderr)
            return 1
        return 0
    page.write_text(text)
    print(f"wrote {FIELDS_DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
