"""Other frameworks' checkpoints, read and written with torch's public APIs only (no Megatron-Core, no torchtitan
at run time): Megatron-Core torch_dist (`torch_dist.py`, names in `mcore_names.py`), through torch.distributed.checkpoint
(`dcp_reader.py`). Each reader offers the per-parameter interface `reshape/universal_load.py:load_from` takes, so a
foreign checkpoint loads at any TP x PP x DP and ZeRO stage the way a universal checkpoint does."""
