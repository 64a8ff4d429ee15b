"""Hook specifications: what each hook patches, in which sglang version, and the check that it is there.

An sglang upgrade that renames or reshapes a target must fail at start with a message naming
the version and the missing piece, not misbehave in the middle of a decode step.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_pd.deploy.common.contract import SGLANG_GPU_VERSION, SGLANG_VERSION
from sglang_pd.sglang_patches.status import distribution_version

__all__ = [
    "SGLANG_TARGET_VERSION",
    "SUPPORTED_SGLANG_VERSIONS",
    "HookSpec",
    "HookTargetMissing",
    "TargetUnimportable",
    "check_target",
]

#: The sglang release every hook below was written against and tested with.
SGLANG_TARGET_VERSION = SGLANG_VERSION
#: The releases the hooks are tested in (tests/sglang_patches/test_releases.py): the deployed one and
#: the GPU machine's (the last sglang pinned to torch 2.11).
SUPPORTED_SGLANG_VERSIONS = (SGLANG_VERSION, SGLANG_GPU_VERSION)


class HookTargetMissing(RuntimeError):
    """A hook's target (or a parameter it relies on) is not in the installed sglang."""


@dataclass(frozen=True)
class HookSpec:
    """One hook: `target` is the dotted path HookRegistry patches; `hook_type` a HookType name."""

    name: str
    target: str
    hook: Callable[..., Any]
    hook_type: str  # "around" | "after" | ...; resolved to sglang's HookType at registration
    params: tuple[str, ...] = ()  # parameters of the target the hook reads by name
    requires: tuple[str, ...] = ()  # other sglang names the hook calls
    sglang_version: str = SGLANG_TARGET_VERSION
    why: str = ""


class TargetUnimportable(ImportError):
    """The target's sglang module exists but fails to import here (a missing dependency, not a rename)."""


def _resolve(path: str) -> Any:
    """The object at `path`. A module that exists but raises on import is reported as such, not as
    "no attribute": on a machine without sglang's CUDA packages that is the usual cause."""
    parts = path.split(".")
    obj: Any = None
    for i in range(1, len(parts) + 1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name and obj is not None:
                break  # not a module: the rest of the path are attributes
            if exc.name == module_name:
                raise
            raise TargetUnimportable(f"sglang module {module_name} does not import here: {exc}") from exc
        except Exception as exc:
            raise TargetUnimportable(
                f"sglang module {module_name} does not import here: {type(exc).__name__}: {exc}"
            ) from exc
    else:
        return obj
    for attr in parts[i - 1 :]:
        obj = getattr(obj, attr)
    return obj


def check_target(spec: HookSpec) -> str | None:
    """None when the spec's target, parameters and requirements exist; else the message to fail with."""
    installed = distribution_version("sglang") or "(not installed)"
    problems: list[str] = []
    for path in (spec.target, *spec.requires):
        try:
            obj = _resolve(path)
        except TargetUnimportable as exc:
            problems.append(f"{path} cannot be checked: {exc} (install sglang's runtime dependencies)")
            continue
        except Exception as exc:  # ImportError, AttributeError, ValueError: all mean "not there"
            problems.append(f"{path} is missing ({type(exc).__name__}: {exc})")
            continue
        if path == spec.target and spec.params:
            try:
                have = set(inspect.signature(obj).parameters)
            except (TypeError, ValueError):
                have = set()
            lacking = [p for p in spec.params if p not in have]
            if lacking:
                problems.append(f"{path} has no parameter(s) {', '.join(lacking)}")
    if not problems:
        return None
    return (
        f"sglang-pd plugin: hook {spec.name!r} was written for sglang {spec.sglang_version}, but in the installed "
        f"sglang {installed} " + "; ".join(problems) + ". Install sglang=="
        f"{spec.sglang_version}, or update sglang_pd/sglang_patches for sglang {installed}; "
        "until then this hook is not applied (SBO on sm_90 stays refused)."
    )
