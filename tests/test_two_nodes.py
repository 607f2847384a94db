"""Two torchrun "nodes" on this machine (scripts/torchrun_node.sh, what pretrain_slurm.sbatch runs per node
with LAUNCHER=torchrun: --nnodes 2, c10d rendezvous on localhost) train TP2 x PP2 and log the same losses
as one torchrun with 4 ranks (same layout, fp32, dropout 0: relative 1e-6)."""
import os
import subprocess
import sys

from megatron_zero.testing.multirank import free_port
from megatron_zero.testing.launch import losses_from_log, model_flags, torchrun
from conftest import ROOT

NODE = os.path.join(ROOT, "scripts", "torchrun_node.sh")


def test_two_nodes_match_one(builtin_corpus, tmp_path):
    data, tok = builtin_corpus
    argv = model_flags(data, tok, **{"tensor-model-parallel-size": 2, "pipeline-model-parallel-size": 2,
                                     "train-iters": 4, "eval-interval": 100, "data-cache-path": tmp_path / "cache"})
    one = torchrun(4, argv + ["--save", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr[-3000:]
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for node_rank in (0, 1):
        env = {**os.environ, "NNODES": "2", "NODE_RANK": str(node_rank), "NPROC_PER_NODE": "2",
               "RDZV_ENDPOINT": endpoint, "RDZV_ID": "two-node-test", "PYTHON": sys.executable,
               "OMP_NUM_THREADS": "1"}
        nodes.append(subprocess.Popen(["bash", NODE] + argv + ["--save", str(tmp_path / "two")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err[-3000:] for _, err in outs]
    two = [losses_from_log(out) for out, _ in outs]
    two = [x for x in two if x]  # the node that holds the last stage's writer rank prints the losses
    assert len(two) == 1 and len(two[0]) == 4, outs
    want = losses_from_log(one.stdout)
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(two[0], want)), (two[0], want)
    assert os.path.isfile(tmp_path / "two" / "latest")
