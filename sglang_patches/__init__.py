"""sglang general plugin (entry point `sglang.srt.plugins`) wiring sglang-pd kernels into sglang."""
