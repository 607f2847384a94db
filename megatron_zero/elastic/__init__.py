"""Losing a rank and going on: torchrun's restarts at the same or another world size (restart.py), the
node-local checkpoint tier (local_tier.py), and their flags (flags.py). docs/reliability.md says what to
launch and what happens."""
