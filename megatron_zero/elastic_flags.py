"""Flags of the node-local checkpoint tier (elastic/local_tier.py), under Megatron-LM's names; declared here,
registered from arguments.py (FEATURES) and checked by check_local_tier_flags."""
from __future__ import annotations

import argparse

from .config.errors import ArgumentError


def add_local_tier_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("node-local checkpoint tier (docs/reliability.md)")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="also save every N iterations to --non-persistent-local-ckpt-dir (fast local storage; "
                        "only the newest copy is kept); a restart resumes from it when it is newer than --load's")
    g.add_argument("--non-persistent-ckpt-type", choices=["local"], default=None,
                   help="where the non-persistent saves go: local (a directory on the ranks' host; "
                        "Megatron-LM's global and in_memory kinds are not supported)")
    g.add_argument("--non-persistent-local-ckpt-dir", type=str, default=None,
                   help="the directory of the non-persistent saves, on fast node-local storage (e.g. local NVMe)")


def check_local_tier_flags(args) -> None:
    """One sentence (ArgumentError) for flags of the tier that cannot work together."""
    interval, kind, where = (args.non_persistent_save_interval, args.non_persistent_ckpt_type,
                             args.non_persistent_local_ckpt_dir)
    if interval is None and kind is None and where is None:
        return
    if interval is None or interval < 1:
        raise ArgumentError(f"--non-persistent-save-interval {interval} must be at least 1 with "
                         "--non-persistent-ckpt-type or --non-persistent-local-ckpt-dir" if interval is not None else
                         "--non-persistent-ckpt-type and --non-persistent-local-ckpt-dir need "
                         "--non-persistent-save-interval N: how often to save to the local tier")
    if kind != "local" or not where:
        raise ArgumentError("--non-persistent-save-interval needs --non-persistent-ckpt-type local and "
                         "--non-persistent-local-ckpt-dir DIR (a directory on fast node-local storage)")
