"""Test doubles and harnesses shared by tests/ and scripts/ (never shipped in the wheel)."""
