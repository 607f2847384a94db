"""Compiled transformer layers (--compile-layers): torch.compile of each layer's forward, as torchtitan compiles
each block. layers.py holds the converter, flags.py the flags."""
