"""Arms the GPU check's KV-page fault in every Python process of the PD stack it starts, and only there.

`scripts/gpu/gpu_pd_check.py` puts this folder first on the PYTHONPATH of the `sglang-pd up` it
starts, with PD_CHECK_KV_FAULT_FLAG naming a flag file (pd_check_kv_fault.py says what the fault
does while that file exists). No other process gets this folder: the product has no fault switch.
Python imports the first `sitecustomize` on sys.path, so this one would hide one the machine
already has (Debian's and Ubuntu's Pythons ship one); it runs that one first.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _chain() -> None:
    """Run the `sitecustomize` that Python would have imported were this folder not on the path."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_pd_check_chained_sitecustomize"] = module
    spec.loader.exec_module(module)


_chain()
if os.environ.get("PD_CHECK_KV_FAULT_FLAG"):
    import pd_check_kv_fault  # beside this file, which Python found on sys.path

    pd_check_kv_fault.install()
