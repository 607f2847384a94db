"""ZeRO checkpoint (any TP x PP x DP, stage 1/2/3, ours or DeepSpeed's) -> DeepSpeed's universal layout.

    convert_to_universal("<save>/global_step10", "<save>/global_step10_universal", merge_workers=2)

writes
    <out>/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt   {'param': full tensor, ['cat_dim'], ['vocab_tensor'],
                                                      ['param_n_sub_params']}
    <out>/zero/<param>/step.pt                        the optimizer step
    <out>/zero/optimizer_state.pt                     the unsharded optimizer state (param_groups, loss scaler…)
    <out>/mp_rank_*_model_states.pt                   copied from the source
    <out>/manifest.json                               every file above with its size and checksum
    <parent of out>/latest_universal                  the output's name

One pass, no intermediate files: each task maps one pipeline stage's optimizer files
(TP x DP of them, memory-mapped, so only the fragments of its parameters are read),
assembles a batch of parameters to their full form and writes them. Memory per worker is
about one parameter's three states plus the mapped pages of one batch. Tasks run in
`merge_workers` processes, each writing `extract_workers` parameters at a time (threads).
The output is written into `<out>.tmp-<id>` and renamed into place when complete.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import time
import uuid
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError
from ..interop.output_guard import check_output
from ..progress import Progress
from ..storage.checksum import file_checksum
from ..format import LATEST_UNIVERSAL, STATE_KEYS, SUB_PARAMS_KEY
from ..storage.manifest import write_manifest
from ..storage.tensor_io import save_file
from .universal_source import SourceCheckpoint, StageReader

BATCH_ELEMENTS = 4 << 20  # per task: bounds the mapped pages a worker touches before it unmaps them
_SRC: Optional[SourceCheckpoint] = None  # inherited by forked workers


def universal_record(full: torch.Tensor, rule) -> dict:
    record = {}
    if rule.cat_dim is not None:
        record["cat_dim"] = rule.cat_dim
    if rule.vocab:
        record["vocab_tensor"] = True
    if rule.sub_params > 1:
        record[SUB_PARAMS_KEY] = rule.sub_params
    record["param"] = full
    return record


def _save(obj, root: str, name: str) -> Dict[str, dict]:
    """save_file into root/name; its manifest entry {name: {'size', 'checksum'}}."""
    size, checksum = save_file(obj, os.path.join(root, name), fsync=False)
    return {name: {"size": size, "checksum": checksum}}


def _write_param(reader: StageReader, out: str, name: str) -> Dict[str, dict]:
    os.makedirs(os.path.join(out, "zero", name), exist_ok=True)
    files = {}
    for key in ("fp32",) if reader.src.head.get("weights_only") else STATE_KEYS:  # --no-save-optim: masters only
        full, rule = reader.assemble(name, key)
        files.update(_save(universal_record(full, rule), out, f"zero/{name}/{key}.pt"))
        del full
    step = reader.step(name)
    if step is not None:
        files.update(_save(step, out, f"zero/{name}/step.pt"))
    return files


def _convert_batch(pp: int, names: List[str], out: str, threads: int) -> Tuple[int, Dict[str, dict], List[str]]:
    torch.set_num_threads(1)
    files = {}
    with _SRC.stage(pp) as reader:
        if threads > 1 and len(names) > 1:
            with ThreadPoolExecutor(threads) as pool:
                for f in pool.map(lambda n: _write_param(reader, out, n), names):
                    files.update(f)
        else:
            for n in names:
                files.update(_write_param(reader, out, n))
        return len(names), files, list(reader.mismatched)


def param_numels(src: SourceCheckpoint) -> Dict[str, int]:
    """{parameter name: its elements summed over the TP slices of the pipeline stage that owns it}."""
    numel, owner = {}, dict(src.params)
    for pp in range(src.layout.pp):
        for t in range(src.layout.tp):
            for g in src.param_shapes[pp * src.layout.tp + t]:
                for n, s in g.items():
                    if owner.get(n) == pp:
                        numel[n] = numel.get(n, 0) + int(torch.Size(s).numel())
    return numel


def batches(src: SourceCheckpoint) -> List[Tuple[int, List[str]]]:
    out = []
    numel = param_numels(src)
    for pp in range(src.layout.pp):
        batch, size = [], 0
        for name, stage in src.params:
            if stage != pp:
                continue
            if batch and size + numel[name] > BATCH_ELEMENTS:
                out.append((pp, batch))
                batch, size = [], 0
            batch.append(name)
            size += numel[name]
        if batch:
            out.append((pp, batch))
    return out


def _optimizer_state(src: SourceCheckpoint) -> dict:
    if src.dense is not None:  # DeepSpeed's engine without ZeRO: a torch optimizer state per rank
        groups = src.files.load(src.model_files[0], mmap=False)["optimizer"]["param_groups"]
        return {"zero_stage": 0, "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups]}
    osd = src.files.load(src.zero_files[(0, 0)], mmap=False)["optimizer_state_dict"]
    if src.zero_stage == 3:
        base = osd.get("optimizer_state_dict", {})
        out = {k: v for k, v in osd.items() if k not in ("fp32_flat_groups", "optimizer_state_dict")}
        out["param_groups"] = base.get("param_groups", [])
        return out
    sharded = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
    out = {k: v for k, v in osd.items() if k not in sharded}
    out["param_groups"] = osd["base_optimizer_state"].get("param_groups", [])
    return out


def _copy_into(src: SourceCheckpoint, name: str, out: str) -> Dict[str, dict]:
    """Copy a source file; its manifest entry is the source's (so a bad copy is caught when read)."""
    dst = os.path.join(out, name)
    shutil.copyfile(src.files.path(name), dst)
    if src.files.manifest is not None:
        src.files.require(name)
        info = src.files.manifest["files"][name]
        return {name: {"size": info["size"], "checksum": info["checksum"]}}
    return {name: {"size": os.path.getsize(dst), "checksum": file_checksum(dst)}}


def convert_to_universal(input_folder: str, output_folder: str, merge_workers: int = 2, extract_workers: int = 1,
                         strict: bool = True, progress: bool = True, verify: bool = True, force: bool = False) -> dict:
    """Convert; returns {'params', 'bytes', 'seconds', 'layout', 'zero_stage', 'mismatched'}.

    Every source file read is verified against the source's manifest (verify=False: not); the
    output gets a manifest of its own, listing every file it holds. Refused where the latest_universal beside
    it names a newer universal checkpoint (interop/output_guard.py), unless `force`."""
    global _SRC
    start = time.monotonic()
    src = SourceCheckpoint(input_folder, strict=strict, verify=verify)
    output_folder = os.path.normpath(output_folder)
    if os.path.exists(output_folder):
        raise CheckpointError(f"the output folder {output_folder} already exists; choose a new one or remove it")
    check_output("universal", output_folder, src.iteration, force)
    tmp = f"{output_folder}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(os.path.join(tmp, "zero"))
    tasks = batches(src)
    states = 1 if src.head.get("weights_only") else len(STATE_KEYS)
    bar = Progress("ds_to_universal", len(src.params), progress,
                   total_bytes=4 * states * sum(param_numels(src).values()), unit="parameters")
    mismatched, files = [], {}
    _SRC = src
    try:
        def collect(results):
            for n, written, bad in results:
                bar.update(n, sum(f["size"] for f in written.values()))
                files.update(written)
                mismatched.extend(bad)

        if merge_workers > 1 and len(tasks) > 1:
            src.files.verify(sorted(src.zero_files.values()))  # once here, not once per forked task
            with ProcessPoolExecutor(min(merge_workers, len(tasks)), mp_context=mp.get_context("fork")) as pool:
                futures = [pool.submit(_convert_batch, pp, names, tmp, extract_workers) for pp, names in tasks]
                collect(f.result() for f in futures)
        else:
            collect(_convert_batch(pp, names, tmp, extract_workers) for pp, names in tasks)
        bar.close()
        total_bytes = sum(f["size"] for f in files.values())
        if mismatched and strict:
            raise CheckpointError(f"TP-replicated parameters differ across TP ranks in {input_folder}: "
                                  f"{', '.join(mismatched)}; pass --no_strict to take TP rank 0's copy")
        for name in mismatched:
            print(f"warning: {name}; TP rank 0's copy was kept", file=sys.stderr)
        files.update(_save(_optimizer_state(src), tmp, "zero/optimizer_state.pt"))
        copied = sorted(src.model_files.values()) or sorted(
            f for f in os.listdir(src.directory) if f.endswith("_model_states.pt") and not f.startswith("layer_"))
        for f in copied:
            files.update(_copy_into(src, f, tmp))
        write_manifest(tmp, files, {"universal": True, "source": os.path.abspath(src.directory),
                                    "iteration": src.iteration})
        os.rename(tmp, output_folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _SRC = None
    root, name = os.path.split(output_folder)
    with open(os.path.join(root or ".", LATEST_UNIVERSAL), "w") as f:
        f.write(name)
    return {"params": len(src.params), "bytes": total_bytes, "seconds": time.monotonic() - start, "tensors": bar.done,
            "layout": str(src.layout), "zero_stage": src.zero_stage, "mismatched": mismatched, "iteration": src.iteration,
            "directory": output_folder}
