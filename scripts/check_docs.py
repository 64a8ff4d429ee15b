"""Check that the docs match the code: relative links, `make` targets and variables, `sglang-pd` flags.

    python scripts/check_docs.py            # README.md and docs/*.md; exit 1 listing each problem

What it reads in each Markdown file:
- every relative link `[text](path#anchor)`: the path exists (from the file's folder), and an anchor into a
  Markdown file names one of its headings (GitHub's slugs);
- every `make TARGET VAR=...` in the text: the target is one of the Makefile's, each VAR one it sets
  (`ARGS="..."` holds `sglang-pd up` options, checked as below);
- every `sglang-pd VERB [SUBVERB] --flag ...` on one line: each flag is one the verb's parser accepts
  (deploy/cli.py builds it), `--help`/`-h` included.
And in the code and chart (tracked files under deploy/, helm/, kernels/, sglang_patches/, scripts/, and
pyproject.toml, Makefile): every `docs/NAME.md` or top-level `NAME.md` a comment or message cites exists,
and a section cited as README "Section" (or README: Section) is a heading of README.md.
tests/test_docs.py runs it on the repository and on planted mistakes.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
MAKE = re.compile(r"\bmake\s+([a-z][a-z0-9-]*)((?:\s+[A-Z][A-Z0-9_]*=(?:\"[^\"]*\"|'[^']*'|\S+))*)")
MAKE_VAR = re.compile(r"([A-Z][A-Z0-9_]*)=(\"[^\"]*\"|'[^']*'|\S+)")
# A command: `sglang-pd` where a shell command starts (a line or code span, after `$ `, `&&`, `;`, `|`), with
# or without a path (.venv/bin/sglang-pd); "sglang-pd knows" inside a quoted message is not one.
CLI = re.compile(r"(?:^\s*(?:\$\s+)?|[;&|(]\s*)(?:[\w./-]*/)?sglang-pd\s+([a-z][a-z0-9-]*)(?![\w:.-])([^`|;&\n]*)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9-]*)")


def split_code(text: str) -> tuple[str, list[tuple[int, str]]]:
    """The text with its code blanked out (for links), and each piece of code (fenced lines, inline spans)
    with its line number (for commands: prose such as "sglang-pd ships" is not one)."""
    prose: list[str] = []
    code: list[tuple[int, str]] = []
    fenced = False
    for n, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("")
            continue
        if fenced:
            code.append((n, line))
            prose.append("")
            continue
        code += [(n, m.group(2)) for m in INLINE_CODE.finditer(line)]
        prose.append(INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line))
    return "\n".join(prose), code


def doc_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*|_(?=\w)|(?<=\w)_", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = HEADING.match(line)
        if m and not fenced:
            base = slug(m.group(2))
            name, n = base, 1
            while name in out:  # GitHub numbers repeated headings
                name, n = f"{base}-{n}", n + 1
            out.add(name)
    return out


def link_problems(path: Path, root: Path) -> list[str]:
    problems = []
    text, _ = split_code(path.read_text())
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        line = text.count("\n", 0, m.start()) + 1
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{line}"
        if not dest.exists():
            problems.append(f"{where}: link to {target}, but {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: link to {target}, but {dest.relative_to(root)} has no heading #{anchor}")
    return problems


def makefile_names(makefile: Path) -> tuple[set[str], set[str]]:
    """The Makefile's targets and the variables it sets."""
    text = makefile.read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*)\s*:(?!=)", text, re.M))
    variables = set(re.findall(r"^([A-Z][A-Z0-9_]*)\s*(?:\?=|:=|\+=|=)", text, re.M))
    return targets, variables


def _parser_options(words: list[str]) -> tuple[set[str], str] | None:
    """The option strings of `sglang-pd WORDS...`'s parser (descending into sub-verbs) and its name."""
    from sglang_pd.deploy.cli import build_parser

    parser = build_parser(words[0])
    name: list[str] = []
    for word in words:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            break
        parser = sub.choices[word]
        name.append(word)
    if not name:
        return None
    return set(parser._option_string_actions), " ".join(name)


def flag_problems(where: str, command: str) -> list[str]:
    """Flags of one `sglang-pd ...` command line that its parser does not accept."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        words = command.split()
    words = [w for w in words if w]
    if not words:
        return []
    found = _parser_options(words)
    if found is None:
        return [f"{where}: sglang-pd {words[0]}: no such verb"]
    options, name = found
    problems = []
    for word in words:
        m = FLAG.match(word)
        if m and m.group(1).split("=")[0] not in options:
            problems.append(f"{where}: sglang-pd {name} has no option {m.group(1)}")
    return problems


def make_problems(path: Path, root: Path, targets: set[str], variables: set[str]) -> list[str]:
    problems = []
    _, code = split_code(path.read_text())
    for line, snippet in code:
        for m in MAKE.finditer(snippet):
            problems += _make_command(f"{path.relative_to(root)}:{line}", m, targets, variables)
    return problems


def _make_command(where: str, m: re.Match[str], targets: set[str], variables: set[str]) -> list[str]:
    if m.group(1) not in targets:
        return [f"{where}: make {m.group(1)}: the Makefile has no such target"]
    problems = []
    for var, value in MAKE_VAR.findall(m.group(2)):
        if var not in variables:
            problems.append(f"{where}: make {m.group(1)} {var}=...: the Makefile sets no {var}")
        elif var == "ARGS":
            problems += flag_problems(where, "up " + value.strip("\"'"))
    return problems


def cli_problems(path: Path, root: Path) -> list[str]:
    problems = []
    _, code = split_code(path.read_text())
    for line, snippet in code:
        for m in CLI.finditer(snippet):
            rest = m.group(2).split(" # ")[0].split("  #")[0]
            problems += flag_problems(f"{path.relative_to(root)}:{line}", f"{m.group(1)} {rest}")
    return problems


CITED_DOC = re.compile(r"(?<![\w/.-])((?:docs/)?[A-Za-z][\w-]*\.md)\b")
CITED_README = re.compile(r"((?:[\w-]+/)*)README(?:\.md)?(?::\s*([A-Z][\w ]*\w)|,?\s+\"([^\"]+)\")")
OTHER_PROJECT = re.compile(r"(?:[\w-]+/[\w.-]+|DeepEP|Mooncake|sglang|FlashMLA|DeepGEMM|NVIDIA)(?:'s)?\s*$")
CODE_PARTS = ("deploy", "helm", "kernels", "sglang_patches", "scripts", "pyproject.toml", "Makefile")


def source_files(root: Path = REPO) -> list[Path]:
    """The tracked files where code and chart cite the docs."""
    import subprocess

    listed = subprocess.run(
        ["git", "ls-files", "-z", *CODE_PARTS], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    own = Path(__file__).name  # this checker names the patterns it looks for
    return [
        root / name
        for name in listed.split("\0")
        if name and not name.endswith((".json", ".safetensors")) and Path(name).name != own
    ]


def citation_problems(path: Path, root: Path) -> list[str]:
    try:
        text = path.read_text()
    except (UnicodeDecodeError, FileNotFoundError):
        return []
    problems = []
    for n, line in enumerate(text.splitlines(), start=1):
        where = f"{path.relative_to(root)}:{n}"
        for m in CITED_DOC.finditer(line):
            name = m.group(1)
            # Ours: a docs/ page or a top-level NAME.md. Another project's file ("ROCm/ATOM docs/TBO.md",
            # "DeepEP's README") is told apart by its owner's name before it.
            if OTHER_PROJECT.search(line[: m.start()]) or not (name.startswith("docs/") or name[:-3].isupper()):
                continue
            if not (root / name).exists():
                problems.append(f"{where}: cites {name}, which is not in the repository")
        for m in CITED_README.finditer(line):
            if not m.group(1) and OTHER_PROJECT.search(line[: m.start()]):
                continue
            readme = root / m.group(1) / "README.md"
            section = m.group(2) or m.group(3)
            if not readme.exists():
                problems.append(f"{where}: cites {readme.relative_to(root)}, which is not in the repository")
            elif slug(section) not in anchors(readme) and f"**{section}" not in readme.read_text():
                problems.append(f"{where}: cites the section {section!r} of {readme.relative_to(root)}, which it lacks")
    return problems


def problems(files: list[Path], root: Path = REPO, makefile: Path | None = None) -> list[str]:
    targets, variables = makefile_names(makefile or root / "Makefile")
    out: list[str] = []
    for path in files:
        out += link_problems(path, root)
        out += make_problems(path, root, targets, variables)
        out += cli_problems(path, root)
    return out


def main() -> int:
    found = problems(doc_files())
    for path in source_files():
        found += citation_problems(path, REPO)
    for p in found:
        print(p, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
