"""The commit a device call runs, read from the tree it carries: recorded here, verified on the GPU machine.

A device call copies the working tree without `.git`, so the machine cannot ask git what it runs.
Here, before the call, `write` records HEAD and the git blob id of every file HEAD tracks in
`.tree-commit.json` at the repository root (untracked and not ignored, so it travels with the
tree). There, `verify` hashes each file as git does (sha1 of `blob <size>\\0` and the bytes) and
refuses a tree that differs from the recorded commit: a file changed or missing, or a file that was
untracked when the record was written. `--allow-dirty` runs it anyway and names the differences.

    python scripts/gpu/tree_commit.py write                        # here; delete the file after the call
    python scripts/gpu/tree_commit.py verify [--allow-dirty] [--out tree.json]     # on the GPU machine
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TREE_FILE = ".tree-commit.json"
SYMLINK, SUBMODULE = "120000", "160000"


class TreeError(RuntimeError):
    """The tree cannot be recorded, or is not the recorded commit; the message says which files and what to do."""


@dataclass
class TreeCheck:
    """What `verify` found: the recorded commit and how the tree differs from it."""

    commit: str
    written_at: str
    files: int
    modified: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    untracked: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.modified or self.missing or self.untracked)

    def label(self) -> str:
        """The commit as a report names it: the sha, marked when the tree differs from it."""
        return self.commit if self.clean else f"{self.commit} (dirty)"

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "clean": self.clean}


def blob_id(data: bytes) -> str:
    """git's object id of a blob with these bytes (`git hash-object`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _git(repo: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise TreeError(f"`git {' '.join(args)}` failed in {repo}: {exc}; run `write` in a git checkout") from exc


def write(repo: Path = REPO) -> Path:
    """Record HEAD and its files' blob ids in `repo/.tree-commit.json`."""
    if _git(repo, "ls-files", "--", TREE_FILE).strip():
        raise TreeError(f"{TREE_FILE} is tracked by git; it must never be: `git rm --cached {TREE_FILE}` and commit")
    files: dict[str, dict[str, str]] = {}
    for entry in _git(repo, "ls-tree", "-r", "-z", "--full-tree", "HEAD").split("\0"):
        if not entry:
            continue
        meta, path = entry.split("\t", 1)
        mode, _, blob = meta.split()
        if mode != SUBMODULE:
            files[path] = {"mode": mode, "blob": blob}
    untracked = [p for p in _git(repo, "ls-files", "-z", "--others", "--exclude-standard").split("\0") if p]
    record = {
        "commit": _git(repo, "rev-parse", "HEAD").strip(),
        "written_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "files": files,
        "untracked": sorted(p for p in untracked if p != TREE_FILE),
    }
    out = repo / TREE_FILE
    out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return out


def _content(path: Path, mode: str) -> bytes:
    # git stores a symlink as a blob of its target.
    return os.readlink(path).encode() if mode == SYMLINK else path.read_bytes()


def verify(repo: Path = REPO, *, allow_dirty: bool = False) -> TreeCheck:
    """Hash every recorded file in `repo`; TreeError when the tree is not the recorded commit and
    `allow_dirty` is false."""
    try:
        record = json.loads((repo / TREE_FILE).read_text())
    except FileNotFoundError as exc:
        raise TreeError(
            f"{repo / TREE_FILE} is missing: run `python scripts/gpu/tree_commit.py write` in the checkout "
            "before the device call, so the run can name its commit"
        ) from exc
    check = TreeCheck(commit=record["commit"], written_at=record["written_at"], files=len(record["files"]))
    for path, meta in sorted(record["files"].items()):
        full = repo / path
        if not full.exists() and not full.is_symlink():
            check.missing.append(path)
        elif blob_id(_content(full, meta["mode"])) != meta["blob"]:
            check.modified.append(path)
    check.untracked = [p for p in record.get("untracked", []) if (repo / p).exists()]
    if not check.clean and not allow_dirty:
        parts = [
            f"{name}: {', '.join(paths[:10])}"
            for name, paths in asdict(check).items()
            if isinstance(paths, list) and paths
        ]
        raise TreeError(
            f"the tree is not commit {check.commit} ({'; '.join(parts)}): commit the changes and write "
            f"{TREE_FILE} again, or pass --allow-dirty to run it anyway (the report then says so)"
        )
    return check


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("write", help=f"record HEAD in {TREE_FILE} (here, before the device call)")
    check = sub.add_parser("verify", help="check the tree against the record (on the GPU machine)")
    check.add_argument("--allow-dirty", action="store_true", help="run on a tree that differs, and say how")
    check.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args()
    try:
        if args.command == "write":
            out = write()
            record = json.loads(out.read_text())
            print(f"wrote {out}: commit {record['commit']}, {len(record['files'])} files")
            if record["untracked"]:
                print(f"note: untracked files travel too and make the tree dirty: {', '.join(record['untracked'])}")
            print(f"reminder: delete it after the device call (rm {TREE_FILE}); never commit it")
            return 0
        result = verify(allow_dirty=args.allow_dirty)
    except TreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.out is not None:
        args.out.write_text(json.dumps(result.as_dict(), indent=2) + "\n")
    print(f"tree: commit {result.label()}, {result.files} files checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
