"""GPU kernels (Triton) for sglang-pd: the sm_90 signal down-GEMM that brings SBO to Hopper."""
