"""See before you launch: memory per rank and step time of a layout, predicted without allocating it.

    fake_rank.py      one rank of a layout, built by the model code itself on fake tensors in a fake world
    live_bytes.py     live tensor bytes and their peak over a region (fake or real tensors)
    probe.py          a stage of many alike blocks from probes of one and two blocks (the exact trace's numbers)
    memory.py         per rank kind: weights, gradients, optimizer state (ZeRO's partition math), activations
                      (a traced micro-batch), buffers, peak; per node host memory under offload
    time_model.py     step time: compute, exposed communication, pipeline bubble; MFU, tokens/s (named constants)
    host_step.py      an offloaded optimizer's host step: PCIe both ways, the CPU AdamW on the node's cores
    search.py         every layout of a cluster that fits, ranked by predicted tokens/s
    report.py         the table and the JSON of tools/plan.py
"""
