"""docs/fields.md is what scripts/gen_fields_doc.py writes from the topology models, and it names every field."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from sglang_pd.deploy.spec.topology import FIELDS_DOC, Topology

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
gen_fields_doc = importlib.import_module("gen_fields_doc")


def test_the_committed_page_is_the_generators_output() -> None:
    assert (REPO / FIELDS_DOC).read_text() == gen_fields_doc.render(), (
        f"{FIELDS_DOC} is out of date: run python scripts/gen_fields_doc.py"
    )


def test_every_field_of_every_section_has_a_row() -> None:
    page = gen_fields_doc.render()
    todo: list[tuple[str, type[BaseModel]]] = [("top level", Topology)]
    while todo:
        title, model = todo.pop()
        section = page.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
        for name, field in model.model_fields.items():
            assert f"| `{name}` |" in section, f"{title}.{name} has no row"
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                todo.append((name if title == "top level" else f"{title}.{name}", field.annotation))
    assert "| `gpu_memory_gib` | number > 0 | required |" in page
    assert "| `sbo` | `off` \\| `full` \\| `shared-only` | `off` |" in page


def test_check_mode_fails_on_a_stale_page(tmp_path: Path) -> None:
    # The control: --check passes on the committed page and fails on a copy with a row changed.
    ok = subprocess.run([sys.executable, "scripts/gen_fields_doc.py", "--check"], cwd=REPO, capture_output=True)
    assert ok.returncode == 0, ok.stderr
    stale = tmp_path / "repo"
    (stale / "docs").mkdir(parents=True)
    (stale / "scripts").mkdir()
    (stale / "scripts" / "gen_fields_doc.py").write_text((REPO / "scripts" / "gen_fields_doc.py").read_text())
    page = (
        (REPO / FIELDS_DOC)
        .read_text()
        .replace("| `page_size` | integer ≥ 1 | `64` |", "| `page_size` | integer | `16` |")
    )
    (stale / FIELDS_DOC).write_text(page)
    r = subprocess.run(
        [sys.executable, "scripts/gen_fields_doc.py", "--check"], cwd=stale, capture_output=True, text=True
    )
    assert r.returncode == 1 and f"{FIELDS_DOC} is out of date" in r.stderr
