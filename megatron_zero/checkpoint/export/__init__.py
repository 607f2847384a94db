"""Checkpoints out to other forms: one consolidated fp32 / 16-bit state dict or safetensors (consolidate), the
16-bit model written with each save (save_16bit), the standalone zero_to_fp32.py copied into each checkpoint
(standalone_zero_to_fp32), and Hugging Face import and export (hf/)."""
