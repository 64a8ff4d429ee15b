"""The commit a GPU run names comes from the tree it carries (scripts/gpu/tree_commit.py): recorded
with git here, verified by hashing there; a tree that differs is refused unless the run allows it."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts/gpu"))
tree_commit = importlib.import_module("tree_commit")


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("print('a')\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(bytes(range(256)))
    (tmp_path / "link").symlink_to("a.py")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def test_blob_ids_are_gits(repo: Path) -> None:
    for path in ("a.py", "sub/b.bin"):
        assert tree_commit.blob_id((repo / path).read_bytes()) == _git(repo, "hash-object", path).strip()
    assert tree_commit.blob_id(b"x") != tree_commit.blob_id(b"x\n")


def test_a_clean_tree_names_its_commit(repo: Path) -> None:
    tree_commit.write(repo)
    (repo / "ignored").mkdir()
    (repo / "ignored" / "build.o").write_text("not part of the commit")  # ignored paths do not count
    check = tree_commit.verify(repo)
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert check.clean and check.label() == head and check.files == 4  # a.py, sub/b.bin, link, .gitignore


def test_a_modified_file_is_refused_and_named(repo: Path) -> None:
    tree_commit.write(repo)
    (repo / "sub" / "b.bin").write_bytes(b"changed")
    with pytest.raises(tree_commit.TreeError, match=r"modified: sub/b\.bin.*--allow-dirty"):
        tree_commit.verify(repo)
    check = tree_commit.verify(repo, allow_dirty=True)
    assert not check.clean and check.modified == ["sub/b.bin"] and check.label().endswith("(dirty)")


def test_a_missing_file_a_retargeted_link_and_an_untracked_file_are_refused(repo: Path) -> None:
    (repo / "new.py").write_text("import os\n")  # untracked when the record is written: it travels too
    tree_commit.write(repo)
    (repo / "a.py").unlink()
    (repo / "link").unlink()
    (repo / "link").symlink_to("sub/b.bin")
    check = tree_commit.verify(repo, allow_dirty=True)
    assert check.missing == ["a.py"] and check.modified == ["link"] and check.untracked == ["new.py"]
    with pytest.raises(tree_commit.TreeError, match=r"missing: a\.py"):
        tree_commit.verify(repo)


def test_without_the_record_the_run_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(tree_commit.TreeError, match=r"tree_commit\.py write"):
        tree_commit.verify(tmp_path)


def test_the_record_is_never_tracked(repo: Path) -> None:
    tree_commit.write(repo)
    _git(repo, "add", "-f", tree_commit.TREE_FILE)
    with pytest.raises(tree_commit.TreeError, match="must never be"):
        tree_commit.write(repo)


def test_this_repository_does_not_track_or_ignore_the_record() -> None:
    # Not tracked: a commit cannot hold its own sha. Not ignored: it must travel with the tree.
    assert _git(REPO, "ls-files", "--", tree_commit.TREE_FILE).strip() == ""
    ignored = subprocess.run(["git", "check-ignore", "-q", tree_commit.TREE_FILE], cwd=REPO)
    assert ignored.returncode == 1


def test_the_command_line_writes_reminds_and_verifies(repo: Path, tmp_path: Path) -> None:
    script = REPO / "scripts/gpu/tree_commit.py"
    # The script finds its repository from its own path, so run a copy placed in `repo`.
    (repo / "scripts" / "gpu").mkdir(parents=True)
    (repo / "scripts" / "gpu" / "tree_commit.py").write_text(script.read_text())
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "two")
    run = [sys.executable, "scripts/gpu/tree_commit.py"]
    written = subprocess.run([*run, "write"], cwd=repo, capture_output=True, text=True, check=True)
    assert "reminder: delete it after the device call" in written.stdout
    out = tmp_path / "tree.json"
    ok = subprocess.run([*run, "verify", "--out", str(out)], cwd=repo, capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(out.read_text())["clean"] is True
    (repo / "a.py").write_text("print('b')\n")
    refused = subprocess.run([*run, "verify"], cwd=repo, capture_output=True, text=True)
    assert refused.returncode == 2 and "modified: a.py" in refused.stderr
