"""Losing a rank and going on: torchrun's restarts at the same or another world size (restart.py), the
node-local checkpoint tier (local_tier.py), the step watchdog (watchdog.py), the straggler report
(straggler.py). The tier's and the report's flags are in megatron_zero/config/elastic.py (arguments/__init__.py
registers them; restart.py imports arguments/__init__.py). docs/reliability.md says what to launch and what happens."""
