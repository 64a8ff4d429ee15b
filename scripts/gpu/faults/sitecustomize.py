"""Arms a GPU check's fault or probe in every Python process that the check starts with it, and only there.

`scripts/gpu/gpu_pd_check.py` puts this folder first on the PYTHONPATH of the `sglang-pd up` it
starts, with PD_CHECK_KV_FAULT_FLAG naming a flag file (pd_check_kv_fault.py says what the fault
does while that file exists), and, in its TTFT breakdown stage, PD_CHECK_DELAY_DIR naming the folder
of the prefill's and the KV send's switchable delays (pd_check_delay.py).
`scripts/gpu/gpu_sbo_server.py --gemm-fault` does the same for its SBO server with
SBO_CHECK_GEMM_FAULT_FLAG (sbo_check_gemm_fault.py), and for every server it times with
SBO_CHECK_STEP_LOG (step_timer.py: the GPU time of each decode forward). No other process gets this
folder: the product has no fault switch.
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
if os.environ.get("SBO_CHECK_GEMM_FAULT_FLAG"):
    import sbo_check_gemm_fault

    sbo_check_gemm_fault.install()
if os.environ.get("PD_CHECK_DELAY_DIR"):
    import pd_check_delay

    pd_check_delay.install()
if os.environ.get("SBO_CHECK_STEP_LOG"):
    import step_timer

    step_timer.install()
