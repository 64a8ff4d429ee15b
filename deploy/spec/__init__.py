"""The topology spec: the pydantic models of a PD deployment, loading, the cross-role rules and the shipped presets."""
