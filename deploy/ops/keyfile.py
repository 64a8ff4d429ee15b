"""The worker key for sglang in a config file that only this user can read, not on its command line.

sglang takes its API key as `--api-key` (ServerArgs.api_key; no environment variable reads it), and a
process's command line is readable by every local user (/proc/PID/cmdline, `ps`). sglang also reads
options from a YAML file named by `--config` (`prepare_server_args` in srt/server_args.py, 0.5.17 and
0.5.23: the file's `key: value` pairs become `--key value` ahead of the command line). So the launcher
writes `api-key: KEY` into a file of mode 0600, in a directory of mode 0700 of its own (in /dev/shm
where it exists, so the key never reaches a disk), passes `--config FILE`, and removes both when sglang
has exited.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["CONFIG_FLAG", "KEY_FILE_SHOWN", "KeyFile"]

CONFIG_FLAG = "--config"
# What `--dry-run` shows for the file's path: it exists only while sglang runs.
KEY_FILE_SHOWN = "<a 0600 file holding api-key, written at start>"
# sglang refuses a config file whose name does not end in .yaml or .yml (_validate_yaml_file).
_FILE_NAME = "worker-key.yaml"
_MEMORY_DIR = Path("/dev/shm")


class KeyFile:
    """`api-key: KEY` in a private file; `args()` are sglang's flags for it, `remove()` deletes it."""

    def __init__(self, key: str, parent: Path | None = None) -> None:
        """`parent`: where the private directory goes (default: /dev/shm when writable, else the
        system's temporary directory)."""
        if parent is None and _MEMORY_DIR.is_dir() and os.access(_MEMORY_DIR, os.W_OK):
            parent = _MEMORY_DIR
        # mkdtemp creates the directory with mode 0700, readable by this user alone.
        self.directory = Path(tempfile.mkdtemp(prefix="sglang-pd-key-", dir=parent))
        self.path = self.directory / _FILE_NAME
        # A JSON string is a YAML double-quoted scalar: the key is read back byte for byte.
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"api-key: {json.dumps(key)}\n")

    def args(self) -> list[str]:
        return [CONFIG_FLAG, str(self.path)]

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
