"""Communication and topology: torch.distributed's start from the launcher's environment (initialize.py),
the parallel layout and its process groups (topology.py), the device each rank runs on, and the collectives
written here (reduce_scatter.py, shm_comm.py)."""
