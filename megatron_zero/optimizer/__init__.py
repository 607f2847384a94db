"""Optimizers other than AdamW that ZeroOptimizer steps on its flat fp32 partitions: Muon (`muon.py`: which
parameters take it and one matrix's orthogonalized update; `newton_schulz.py`: the iteration; `muon_zero.py`: the
step over ZeRO's partitions, each matrix orthogonalized once by the rank that owns it, `muon_ownership.py`), and
QK-clip (`qk_clip.py`)."""
