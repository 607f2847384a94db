"""Peak RSS and time of tools/convert_checkpoint.py conversions on a Llama-style model (default ~0.1B parameters;
--layers/--hidden/--vocab to scale), against the size of the model: the converters read one layer at a time.

    python bench/bench_checkpoint_convert.py [--layers 8 --hidden 1024 --vocab 32000] [--dir /tmp/x]

Each conversion runs in its own process (its own ru_maxrss, imports included: the `import only` row is that
floor); the source is a universal checkpoint of random weights and moments written first.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


PEAK = ("import atexit, resource, runpy, sys; atexit.register(lambda: print('PEAK_RSS_KB', "
        "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)); sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__') if sys.argv[0].endswith('.py') else exec(sys.argv[0])")


def _child(argv):
    """(seconds, peak RSS MiB of that process alone)."""
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", PEAK] + argv, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    if "PEAK_RSS_KB" not in run.stderr or "error" in run.stderr:
        raise SystemExit(run.stderr)
    kb = int(run.stderr.rsplit("PEAK_RSS_KB", 1)[1].split()[0])
    return time.monotonic() - start, kb / 1024


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    import torch

    from megatron_zero.checkpoint.interop.convert import config_args
    from megatron_zero.checkpoint.interop.to_universal import write_universal
    from megatron_zero.model.config import GPTConfig
    from megatron_zero.model.params import param_names, param_spec

    cfg = GPTConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_attention_heads=a.hidden // 64,
                    num_query_groups=max(1, a.hidden // 256), seq_length=2048, max_position_embeddings=2048,
                    normalization="RMSNorm", position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                    untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=128)

    class Random:
        has_optimizer = True

        def full(self, name, which):
            return torch.randn(param_spec(name, cfg).full_shape), None, param_spec(name, cfg).sub_params

        def step(self, name):
            return 10

    names = param_names(cfg)
    numel = sum(torch.Size(param_spec(n, cfg).full_shape).numel() for n in names)
    largest = max(torch.Size(param_spec(n, cfg).full_shape).numel() for n in names) * 4 / 2**20
    root = a.dir or tempfile.mkdtemp(prefix="convert_bench_")
    src = os.path.join(root, "u", "src")
    write_universal(Random(), cfg, {"iteration": 10, "args": config_args(cfg),
                                    "universal_checkpoint_info": {"original_vocab_size": cfg.vocab_size}}, src, "bench")
    tool = os.path.join(ROOT, "tools", "convert_checkpoint.py")
    rows = [("import only", _child(["import torch, torch.distributed.checkpoint"]))]
    rows.append(("universal -> torch_dist", _child([tool, "--from", "universal", "--to", "torch_dist", "--input", src,
                                                   "--output", os.path.join(root, "td")])))
    rows.append(("torch_dist -> universal", _child([tool, "--from", "torch_dist", "--to", "universal", "--input",
                                                   os.path.join(root, "td"), "--output", os.path.join(root, "u2", "x"),
                                                   "--vocab-size", str(a.vocab)])))
    rows.append(("universal -> dcp (in memory)", _child([tool, "--from", "universal", "--to", "dcp", "--input", src,
                                                        "--output", os.path.join(root, "titan")])))
    print(f"model: {numel / 1e6:.1f}M parameters, {numel * 4 / 2**20:.0f} MiB per fp32 state (x3 with Adam), "
          f"largest tensor {largest:.0f} MiB")
    print(f"{'conversion':32s} {'seconds':>8s} {'peak RSS MiB':>13s}")
    for what, (sec, rss) in rows:
        print(f"{what:32s} {sec:8.1f} {rss:13.0f}")
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
