"""sglang general plugin (entry point `sglang.srt.plugins`) wiring sglang-pd kernels into sglang.

Single-batch overlap (SBO) on Hopper: sglang (0.5.23, deployed, and 0.5.17, the GPU machine's)
refuses it on sm_90; these hooks enable its shared-expert half, and with our signal down-GEMM
(`sglang_pd.kernels.signal_gemm`) and a DeepEP that takes its signals its combine half, as
`SGLANG_PD_SBO_MODE` (rendered from the topology's `decode.sbo`) asks. `sglang-pd doctor` reports
what this machine can run and why not, and probes that each hook takes effect (`probes.py`).
"""

from sglang_pd.sglang_patches.plugin import register

__all__ = ["register"]
