"""Checkpoints at another TP / PP / DP or ZeRO stage: how each parameter merges and splits (universal_info),
reading a ZeRO checkpoint's fragments by name (universal_source), converting to DeepSpeed's universal
layout (universal_convert) and loading a universal or plain checkpoint onto this layout (universal_load)."""
