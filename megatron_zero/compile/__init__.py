"""Compiled transformer layers (--compile-layers): torch.compile of each layer's forward, as torchtitan compiles
each block. layers.py holds the converter. What stays out of the graphs is marked by ops/eager.py (the kernels
and the collectives import it, so it lives below them); the flags are in megatron_zero/config/compile.py, since
they check through config/, whose imports reach those collectives."""
