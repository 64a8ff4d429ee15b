"""sglang-pd deployment layer: topology, argument rendering, launchers, router, KV transfer, evals, CLI."""
