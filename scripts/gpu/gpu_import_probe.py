"""Name every module the servers would fail to import, in one pass (a pre-flight for a GPU machine).

An import stops at its first missing module, so finding what a machine without internet lacks one
server start at a time costs a start per module. This probe imports what sglang's server, its
DeepSeek model, its Mooncake PD path and our router import; whenever a top-level module is
missing it records the name and imports again in a fresh interpreter with a placeholder standing
in for it, so one run lists them all. It only reports: nothing it stands in is used to serve.

    python scripts/gpu/gpu_import_probe.py            # prints JSON: {"missing": [...], "failed": {...}}
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path

TARGETS = [
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.deepseek_v2",
    "sglang.srt.disaggregation.mooncake.conn",
    "sglang.srt.layers.attention.triton_backend",
    "sglang_pd.deploy.router.app",
    "sglang_pd.deploy.cli",
    "openai",
]


class _Placeholder(types.ModuleType):
    """Any attribute is a fresh class, so `from missing import Name` and subclassing go through."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        module = _Placeholder(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        return None


def first_missing(target: str, stand_ins: list[str]) -> tuple[str | None, str | None]:
    """Import `target` in a fresh interpreter with `stand_ins` stood in; the first missing module or error."""
    code = (
        "import importlib, sys, json\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from gpu_import_probe import _StandIn\n"
        "s = _StandIn(); s.names.update(sys.argv[2:]); sys.meta_path.append(s)\n"
        "try:\n"
        "    importlib.import_module(sys.argv[1]); print(json.dumps([None, None]))\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(json.dumps([(exc.name or '').split('.')[0] or None, f'{type(exc).__name__}: {exc}']))\n"
        "except Exception as exc:\n"
        "    print(json.dumps([None, f'{type(exc).__name__}: {exc}']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, target, *stand_ins], capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    if not lines:
        return None, f"exit {out.returncode}: {out.stderr.strip()[-500:]}"
    missing, error = json.loads(lines[-1])
    return missing, error


def main() -> None:
    stand_ins: list[str] = []
    failed: dict[str, str] = {}
    for target in TARGETS:
        for _ in range(40):
            missing, error = first_missing(target, stand_ins)
            if missing is None or missing in stand_ins:
                if error:
                    failed[target] = error
                break
            stand_ins.append(missing)
    print(json.dumps({"missing": sorted(stand_ins), "failed": failed}, indent=2))


if __name__ == "__main__":
    main()
