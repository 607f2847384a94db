"""Peak RSS and time of tools/convert_checkpoint.py conversions on a Llama-style model (default ~0.1B parameters;
--layers/--hidden/--ffn/--query-groups/--vocab to scale), against the size of the model and against torch's own
`torch.distributed.checkpoint.format_utils.dcp_to_torch_save` on the same torch_dist checkpoint in the same run.

    python bench/bench_checkpoint_convert.py [--layers 8 --hidden 1024 --vocab 32000] [--dir /tmp/x]
    python bench/bench_checkpoint_convert.py --layers 22 --hidden 2048 --ffn 5632 --query-groups 4   # 1.1B (TinyLlama)

Each conversion runs in its own process (its own ru_maxrss, imports included: the `import only` row is that
floor); the source is a universal checkpoint of random weights and Adam moments written first. The ratio
columns divide by the dcp_to_torch_save row (which reads the whole checkpoint into memory, then torch.saves
it); each output is removed once measured, so the disk holds the source, the torch_dist checkpoint and one
output at a time.
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
    p.add_argument("--ffn", type=int, default=None, help="SwiGLU width (default: Megatron's for --hidden)")
    p.add_argument("--query-groups", type=int, default=None, help="default: hidden / 256")
    p.add_argument("--dir", default=None)
    p.add_argument("--no-baseline", action="store_true",
                   help="skip dcp_to_torch_save (it holds the whole checkpoint: 13 GB at 1.1B); ratios are then nan")
    p.add_argument("--writers-only", action="store_true",
                   help="only universal -> torch_dist and universal -> dcp (the writers; no baseline, no readers)")
    a = p.parse_args()
    a.no_baseline = a.no_baseline or a.writers_only
    import torch

    from megatron_zero.checkpoint.interop.convert import config_args
    from megatron_zero.checkpoint.interop.to_universal import write_universal
    from megatron_zero.model.config import GPTConfig
    from megatron_zero.model.params import param_names, param_spec

    cfg = GPTConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_attention_heads=a.hidden // 64,
                    num_query_groups=a.query_groups or max(1, a.hidden // 256), ffn_hidden_size=a.ffn, seq_length=2048, max_position_embeddings=2048,
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
    td, out = os.path.join(root, "td"), os.path.join(root, "out")

    def convert(*argv, keep=False):
        r = _child([tool, *argv])
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
        return r
    rows = [("import only", _child(["import torch, torch.distributed.checkpoint"]))]
    rows.append(("universal -> torch_dist", convert("--from", "universal", "--to", "torch_dist", "--input", src,
                                                    "--output", td, keep=True)))
    baseline = ("from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                f"dcp_to_torch_save({os.path.join(td, 'iter_0000010')!r}, {os.path.join(root, 'out.pt')!r})")
    try:
        if a.no_baseline:
            raise SystemExit("skipped (--no-baseline)")
        rows.append(("dcp_to_torch_save (torch_dist)", _child([baseline])))
    except SystemExit as e:  # e.g. killed for memory: said in the table, the rest still measured
        print(f"dcp_to_torch_save failed: {str(e)[-500:]}")
        rows.append(("dcp_to_torch_save (torch_dist)", (float("nan"), float("nan"))))
    if os.path.exists(os.path.join(root, "out.pt")):
        os.remove(os.path.join(root, "out.pt"))
    if not a.writers_only:
        rows.append(("torch_dist -> universal", convert("--from", "torch_dist", "--to", "universal", "--input", td,
                                                        "--output", os.path.join(out, "x"), "--vocab-size",
                                                        str(a.vocab))))
    shutil.rmtree(td, ignore_errors=True)
    titan = os.path.join(root, "titan")
    rows.append(("universal -> dcp", convert("--from", "universal", "--to", "dcp", "--input", src,
                                                        "--output", titan, keep=True)))
    if not a.writers_only:
        rows.append(("dcp -> universal", convert("--from", "dcp", "--to", "universal", "--input",
                                                 os.path.join(titan, "step-10"),
                                                 "--output", os.path.join(out, "x"), "--vocab-size", str(a.vocab),
                                                 "--num-attention-heads", str(cfg.num_attention_heads))))
    shutil.rmtree(titan, ignore_errors=True)
    base_sec, base_rss = rows[2][1]
    print(f"model: {numel / 1e6:.1f}M parameters, {numel * 4 / 2**20:.0f} MiB per fp32 state (x3 with Adam), "
          f"largest tensor {largest:.0f} MiB")
    print(f"{'conversion':32s} {'seconds':>8s} {'peak RSS MiB':>13s} {'time / baseline':>16s} {'RSS / baseline':>15s}")
    for what, (sec, rss) in rows:
        print(f"{what:32s} {sec:8.1f} {rss:13.0f} {sec / base_sec:16.2f} {rss / base_rss:15.2f}")
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
