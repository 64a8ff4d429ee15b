"""Topology presets shipped with sglang-pd."""
