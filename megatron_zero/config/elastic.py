"""Flags of the node-local checkpoint tier (elastic/local_tier.py) and of the straggler report
(elastic/straggler.py), under Megatron-LM's names; ElasticConfig declares them, check_local_tier and
check_straggler check them."""
from __future__ import annotations

import argparse
from typing import Optional

from .errors import ArgumentError
from .fields import add_section_flags, flag, section


STRAGGLER = "straggler report (docs/reliability.md)"


@section("node-local checkpoint tier (docs/reliability.md)")
class ElasticConfig:
    """The node-local checkpoint tier (elastic/local_tier.py) and the straggler report (elastic/straggler.py)."""
    non_persistent_save_interval: Optional[int] = flag(
        "also save every N iterations to --non-persistent-local-ckpt-dir (fast local storage; only the newest copy "
        "is kept); a restart resumes from it when it is newer than --load's")
    non_persistent_ckpt_type: Optional[str] = flag(
        "where the non-persistent saves go: local (a directory on the ranks' host; Megatron-LM's global and "
        "in_memory kinds are not supported)", choices=["local"])
    non_persistent_local_ckpt_dir: Optional[str] = flag(
        "the directory of the non-persistent saves, on fast node-local storage (e.g. local NVMe)")
    log_straggler: bool = flag(
        "every --log-interval, one line with each rank's forward compute time per iteration (CUDA events on a GPU): "
        "the slowest and fastest ranks and the ranks over --straggler-factor times the median, with their hosts",
        False, group=STRAGGLER, action="store_true")
    straggler_minmax_count: int = flag("with --log-straggler: how many of the slowest and of the fastest ranks to "
                                       "name (default 1)", 1, group=STRAGGLER)
    straggler_factor: float = flag(
        "with --log-straggler: name a rank as a straggler when its forward compute time is over this many times the "
        "median of its pipeline stage's ranks (default 1.5)", 1.5, group=STRAGGLER)
    disable_straggler_on_startup: bool = flag("with --log-straggler: start with the report off "
                                              "(--straggler-ctrlr-port turns it on)", False, group=STRAGGLER,
                                              action="store_true")
    straggler_ctrlr_port: Optional[int] = flag(
        "with --log-straggler: rank 0 listens on this TCP port; each connection (e.g. curl host:PORT) turns the "
        "report on or off at the next log line (default: no listener)", group=STRAGGLER)


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, ElasticConfig)


def check(args) -> None:
    check_local_tier(args)
    check_straggler(args)


def check_local_tier(args) -> None:
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


def check_straggler(args) -> None:
    """One sentence (ArgumentError) for straggler flags without --log-straggler or out of range."""
    given = [flag for flag, on in (("--straggler-minmax-count", args.straggler_minmax_count != 1),
                                   ("--straggler-factor", args.straggler_factor != 1.5),
                                   ("--disable-straggler-on-startup", args.disable_straggler_on_startup),
                                   ("--straggler-ctrlr-port", args.straggler_ctrlr_port is not None)) if on]
    if given and not args.log_straggler:
        raise ArgumentError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect without "
                            "--log-straggler: add it, or leave them out")
    if args.straggler_minmax_count < 1:
        raise ArgumentError(f"--straggler-minmax-count {args.straggler_minmax_count} must be at least 1")
    if not args.straggler_factor > 1:
        raise ArgumentError(f"--straggler-factor {args.straggler_factor:g} must be above 1 (a rank is named when "
                            "its time is over this many times the median)")
    port = args.straggler_ctrlr_port
    if port is not None and not 0 < port < 65536:
        raise ArgumentError(f"--straggler-ctrlr-port {port} must be a TCP port, 1 to 65535")
    if args.disable_straggler_on_startup and port is None:
        raise ArgumentError("--disable-straggler-on-startup needs --straggler-ctrlr-port PORT: without it the "
                            "report could never be turned on")
