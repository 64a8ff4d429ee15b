"""A router process group: N serving processes on one port under one control process."""
