"""How K/V reach a context-parallel rank's queries, the values of `--cp-comm-type` (attention.py runs each).
Apart from attention.py so that the flags' checks (config/parallel.py) read them without loading torch."""

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
