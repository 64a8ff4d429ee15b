"""The docs match the code (scripts/check_docs.py): relative links and their anchors, `make` targets and
variables, `sglang-pd` flags in README.md and docs/*.md, and the docs the code and chart cite. Each check is
also run on a planted mistake, so that a checker that finds nothing cannot pass."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from sglang_pd.deploy.spec.presets import PRESETS_DIR

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
check_docs = importlib.import_module("check_docs")


def test_the_docs_have_no_broken_link_unknown_make_variable_or_unknown_flag() -> None:
    assert check_docs.problems(check_docs.doc_files()) == []


def test_what_the_code_and_chart_cite_exists() -> None:
    found = [p for path in check_docs.source_files() for p in check_docs.citation_problems(path, REPO)]
    assert found == []


def test_every_preset_is_listed_in_the_readme_and_in_topology_md() -> None:
    readme = (REPO / "README.md").read_text()
    table = (REPO / "docs" / "topology.md").read_text()
    for preset in sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")):
        assert f"`{preset}`" in readme, f"README.md does not name the preset {preset}"
        assert f"| `{preset}` |" in table, f"docs/topology.md's preset table has no row for {preset}"


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A small repository: a Makefile, a README and one docs page, to plant mistakes in."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "Makefile").write_text("TOPOLOGY ?= local-cpu\nARGS ?=\nrun:\n\techo\n")
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Two words\n")
    return tmp_path


def _problems(root: Path, text: str) -> list[str]:
    (root / "README.md").write_text(text)
    return list(check_docs.problems([root / "README.md"], root=root))


def test_a_correct_page_passes(planted: Path) -> None:
    text = (
        "[page](docs/page.md#two-words) [self](#top)\n\n# Top\n\n"
        '`make run TOPOLOGY=local-cpu ARGS="--port 8080"` and `sglang-pd plan local-cpu --estimate --input-len 8`\n'
        "```bash\nsglang-pd up local-cpu --ports prefill-0=31000   # a comment --not-a-flag\n```\n"
        "Prose: sglang-pd is a deployment, make sure of it.\n"
    )
    assert _problems(planted, text) == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[gone](docs/missing.md)", "README.md:1: link to docs/missing.md, but docs/missing.md does not exist"),
        ("[anchor](docs/page.md#three-words)", "link to docs/page.md#three-words, but docs/page.md has no heading"),
        ("`make run IMAGE=x`", "README.md:1: make run IMAGE=...: the Makefile sets no IMAGE"),
        ("`make deploy`", "README.md:1: make deploy: the Makefile has no such target"),
        ('`make run ARGS="--prot 8080"`', "README.md:1: sglang-pd up has no option --prot"),
        ("```\nsglang-pd plan x --estimat\n```", "README.md:2: sglang-pd plan has no option --estimat"),
        ("`sglang-pd eval gsm8k --base-urll http://x`", "sglang-pd eval gsm8k has no option --base-urll"),
        ("`sglang-pd planx local-cpu`", "README.md:1: sglang-pd planx: no such verb"),
    ],
)
def test_a_planted_mistake_is_found(planted: Path, text: str, problem: str) -> None:
    found = _problems(planted, text)
    assert any(problem in p for p in found), found


def test_a_planted_citation_in_code_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# x\n\n## Ports and auth\n")
    (tmp_path / "docs" / "real.md").write_text("# Real\n")
    code = tmp_path / "mod.py"
    code.write_text(
        '"""See docs/real.md and README: Ports and auth; ROCm/ATOM docs/TBO.md is theirs."""\n'
        '# DESIGN.md "Layout", docs/gone.md, README "Reading the gate"\n'
    )
    found = check_docs.citation_problems(code, tmp_path)
    assert found == [
        "mod.py:2: cites DESIGN.md, which is not in the repository",
        "mod.py:2: cites docs/gone.md, which is not in the repository",
        "mod.py:2: cites the section 'Reading the gate' of README.md, which it lacks",
    ]
