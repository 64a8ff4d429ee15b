"""The commands that run a topology somewhere: `plan`, `launch` (a pod), `up` (this machine), `doctor`."""
