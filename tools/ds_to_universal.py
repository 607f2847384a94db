#!/usr/bin/env python
"""Convert a ZeRO-1/2/3 checkpoint (ours or DeepSpeed's, any TP x PP x DP) to DeepSpeed's universal layout.

    python tools/ds_to_universal.py --input_folder <save>/global_step10 \
        --output_folder <save>/global_step10_universal [--num_merge_workers 2] [--num_extract_workers 2]

An MoE checkpoint (expert parallelism, DeepSpeed-MoE's expert files) converts with every expert's fp32
master and Adam moments under its global id (docs/moe.md). DeepSpeed's flags. The conversion is one pass with no intermediate files, so
--keep_temp_folder has nothing to keep (accepted for compatibility). --no_strict keeps TP
rank 0's copy of a TP-replicated parameter whose copies differ, with a warning, instead of
stopping. --inject_missing_state is accepted: a checkpoint without universal_checkpoint_info
converts anyway (every unknown parameter is then concatenated on dim 0, as DeepSpeed does).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.checkpoint.errors import CheckpointError  # noqa: E402
from megatron_zero.checkpoint.progress import rate  # noqa: E402
from megatron_zero.checkpoint.storage.reader import add_verify_flag  # noqa: E402
from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal  # noqa: E402


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input_folder", required=True, help="the ZeRO checkpoint folder (e.g. <save>/global_step10)")
    p.add_argument("--output_folder", required=True, help="the universal checkpoint folder to create")
    p.add_argument("--num_extract_workers", type=int, default=4,
                   help="parameters each worker process reads and writes at a time (threads)")
    p.add_argument("--num_merge_workers", type=int, default=2, help="worker processes")
    p.add_argument("--keep_temp_folder", action="store_true", help="accepted for compatibility: no temporary files")
    p.add_argument("--no_strict", dest="strict", action="store_false",
                   help="keep TP rank 0's copy of TP-replicated parameters that differ across TP ranks")
    p.add_argument("--inject_missing_state", action="store_true", help="accepted for compatibility")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--force", action="store_true",
                   help="write even where the latest_universal beside the output names a newer universal checkpoint "
                        "(it then names this one)")
    add_verify_flag(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_arguments(argv)
    try:
        s = convert_to_universal(args.input_folder, args.output_folder, merge_workers=args.num_merge_workers,
                                 extract_workers=args.num_extract_workers, strict=args.strict,
                                 progress=not args.quiet, verify=args.verify_checkpoint, force=args.force)
    except CheckpointError as e:
        print(f"ds_to_universal.py: error: {e}", file=sys.stderr)
        return 2
    print(f"converted {s['params']} parameters of a ZeRO-{s['zero_stage']} {s['layout']} checkpoint "
          f"({s['bytes'] / 2**20:.1f} MiB) into {args.output_folder} in {s['seconds']:.1f} s, "
          f"{rate(s['bytes'], s['seconds'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
