"""The commit protocol: a checkpoint is either whole or absent.

    <save>/<tag>.tmp-<id>/      every rank writes here (files fsynced)
    rank 0, once all ranks are done:  manifest.json (fsync) -> fsync dir
          -> rename to <save>/<tag> -> fsync <save>
          -> `latest` and `latest_checkpointed_iteration.txt` via tmp + rename -> fsync <save>
          -> delete checkpoints beyond keep_last_k and stale temporary directories

A crash before the rename leaves only a `.tmp-` directory (ignored, later removed); a
crash after it leaves a complete checkpoint that `latest` may not name yet. `latest`
always names a directory that was complete before it was written.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from typing import List, Optional, Tuple

from ..errors import CheckpointError, crash_point
from ..format import LATEST, LATEST_ITERATION
from .manifest import MANIFEST, merge_parts
from .tensor_io import fsync_dir

_TMP = re.compile(r"^(?P<tag>.+)\.(tmp|old)-[0-9a-f]+$")


def new_save_id() -> str:
    return uuid.uuid4().hex[:12]


def tmp_dir(save_dir: str, tag: str, save_id: str) -> str:
    return os.path.join(save_dir, f"{tag}.tmp-{save_id}")


def _write_text_atomic(directory: str, name: str, text: str) -> None:
    tmp = os.path.join(directory, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, name))


def commit(save_dir: str, tag: str, tmp: str, world_size: int, meta: dict, iteration: Optional[int] = None,
           save_latest: bool = True, keep_last_k: Optional[int] = None) -> str:
    """Rank 0: turn a finished temporary directory into <save>/<tag> and point `latest` at it."""
    crash_point("before_manifest")
    merge_parts(tmp, world_size, dict(meta, tag=tag))
    fsync_dir(tmp)
    crash_point("before_rename")
    final = os.path.join(save_dir, tag)
    old = None
    if os.path.exists(final):  # re-saving a tag: move the old one aside, then drop it
        old = os.path.join(save_dir, f"{tag}.old-{new_save_id()}")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(save_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    crash_point("before_latest")
    if save_latest:
        _write_text_atomic(save_dir, LATEST, tag)
        if iteration is not None:
            _write_text_atomic(save_dir, LATEST_ITERATION, str(iteration))
        fsync_dir(save_dir)
    crash_point("after_latest")
    remove_stale(save_dir, keep_tmp=None)
    if keep_last_k is not None:
        prune(save_dir, keep_last_k)
    return final


def committed_tags(save_dir: str) -> List[str]:
    """Complete checkpoints (a directory holding manifest.json), oldest first by iteration, then mtime."""
    tags = []
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if _TMP.match(name) or not os.path.isfile(os.path.join(path, MANIFEST)):
            continue
        m = re.search(r"(\d+)$", name)
        tags.append((int(m.group(1)) if m else -1, os.path.getmtime(path), name))
    return [name for _, _, name in sorted(tags)]


def prune(save_dir: str, keep_last_k: int) -> List[str]:
    """Delete all but the newest `keep_last_k` committed checkpoints (never the one `latest` names)."""
    if keep_last_k < 1:
        raise CheckpointError(f"keep_last_k must be at least 1, got {keep_last_k}")
    latest = read_latest(save_dir, required=False)
    tags = committed_tags(save_dir)
    doomed = [t for t in tags[:-keep_last_k] if t != latest]
    for t in doomed:
        # rename first so a crash mid-delete never leaves a half-deleted dir that looks committed
        trash = os.path.join(save_dir, f"{t}.old-{new_save_id()}")
        os.rename(os.path.join(save_dir, t), trash)
        shutil.rmtree(trash, ignore_errors=True)
    if doomed:
        fsync_dir(save_dir)
    return doomed


def stale_dirs(save_dir: str) -> List[str]:
    """Leftovers of crashed saves (`<tag>.tmp-*`, `<tag>.old-*`)."""
    return [os.path.join(save_dir, n) for n in sorted(os.listdir(save_dir))
            if _TMP.match(n) and os.path.isdir(os.path.join(save_dir, n))]


def remove_stale(save_dir: str, keep_tmp: Optional[str]) -> None:
    """Remove leftovers of crashed saves other than `keep_tmp`."""
    for path in stale_dirs(save_dir):
        if path != keep_tmp:
            shutil.rmtree(path, ignore_errors=True)


def latest_tag(load_dir: str) -> Tuple[Optional[str], Optional[str]]:
    """(the tag `latest` names, None), or (None, what is wrong with `latest` as a phrase: "<path> does not
    exist", "<path> holds 40 bytes that are not UTF-8 text", ... ) when it names none."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.exists(path):
        return None, f"{path} does not exist"
    with open(path, "rb") as f:
        raw = f.read(4096)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None, f"{path} holds {len(raw)}{'+' if len(raw) == 4096 else ''} bytes that are not UTF-8 text"
    if not tag:
        return None, f"{path} is empty"
    if os.path.basename(tag) != tag or tag in (".", "..") or not tag.isprintable() or len(tag) > 255:
        return None, f"{path} holds {tag[:60]!r}, which is not a directory name"
    return tag, None


def checkpoint_in(path: str) -> str:
    """`path` if it is one checkpoint; for a save directory (the one --load takes: `latest` beside the checkpoint
    directories, no checkpoint files of its own) the checkpoint `latest` names, as --load reads it."""
    if not os.path.isfile(os.path.join(path, LATEST)) or any(n.endswith("_states.pt") for n in os.listdir(path)):
        return path
    return os.path.join(path, read_latest(path))


def read_latest(load_dir: str, required: bool = True) -> Optional[str]:
    """The tag `latest` names; without a `latest`, None (required=False) or one sentence; one sentence naming
    the file when it holds no directory name (empty, not UTF-8 text, a path, control characters)."""
    tag, problem = latest_tag(load_dir)
    if tag is not None:
        return tag
    if not os.path.exists(os.path.join(load_dir, LATEST)):
        if required:
            raise CheckpointError(f"there is no checkpoint to resume from: {problem}")
        return None
    raise CheckpointError(f"{problem}; it should hold the name of a checkpoint directory in {load_dir}, "
                          "such as global_step100")
