"""Offline tools, runnable as `python tools/<name>.py` or as the console scripts setup.py installs
(package `megatron_zero_tools`)."""
