"""Read a ZeRO-1/2/3 checkpoint (ours or DeepSpeed's) at any TP x PP x DP, without a process group.

    src = SourceCheckpoint("<save>/global_step10")
    src.layout, src.zero_stage, src.params          # [(name, pp stage)], each parameter once
    with src.stage(pp) as reader:                   # that stage's TP x DP optimizer files, memory-mapped
        full = reader.assemble(name, "fp32")        # the universal (full, unpadded) tensor

An MoE checkpoint's experts are parameters like the others, each under its global id, its
fragments in the ZeRO files of the DP ranks holding it (expert_source.py); at ZeRO-3 with expert
parallelism the files' `param_slice_mappings` say where (the expert groups are chunked over expert-DP).
Files are read through reader.py (checksums verified as read, safe unpickling; DeepSpeed's
classes load as stand-ins without deepspeed installed) and memory-mapped; a stage's files are
unmapped when its `with` block ends. The layout comes from the file names and the model-state
keys (`checkpoint_parallel_dimensions`, `layer_*` files, `args`).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch

from ...distributed.topology import Layout
from ...zero.partition import zero3_group_offsets
from ...model.sharding import merge_sub_params
from ..errors import CheckpointError
from ..format import (LAYER_FILE, MODEL_FILE, SUB_PARAMS_PATTERNS, UNIVERSAL_CHECKPOINT_INFO, ZERO3_MODEL_FILE, ZERO_FILE,
                     header_args, header_tp_pp)
from ..storage.commit import checkpoint_in
from ..storage.reader import Checkpoint, open_directory
from ..megatron_deepspeed import QKV_SUFFIXES, ours_names, qkv_heads, qkv_to_ours, writes_qkv_blocks
from .dense_source import DenseStates
from .expert_source import LocalExpertNames, expert_of, all_expert_shapes, expert_ids, partition_counts
from .universal_info import MergeRule, merge_rule



def _with_swiglu_patterns(info: dict, args) -> dict:
    """The checkpoint's pattern lists, plus SwiGLU's sub-parameter patterns when its args say --swiglu
    but its info predates that list (Megatron-DeepSpeed before it recorded them)."""
    args = vars(args) if args is not None and not isinstance(args, dict) else (args or {})
    if not args.get("swiglu") or SUB_PARAMS_PATTERNS in info:
        return info
    return {**info, SUB_PARAMS_PATTERNS: [r"\d+\.mlp\.dense_h_to_4h\.weight$", r"\d+\.mlp\.dense_h_to_4h\.bias$"]}


def _indexed(state, g):
    return state[g] if isinstance(state, (list, tuple)) or g in state else state[str(g)]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class SourceCheckpoint:
    def __init__(self, directory: str, strict: bool = True, verify: bool = True, files: Optional[Checkpoint] = None):
        """`files`: `directory` opened already (then `verify` is the opener's). A save directory (--save's, with
        `latest`) stands for the checkpoint `latest` names."""
        directory = checkpoint_in(directory) if files is None else directory
        self.files = files if files is not None else open_directory(directory, verify)
        self.directory, self.strict = directory, strict
        files = sorted(os.listdir(directory))
        self.zero_files: Dict[Tuple[int, int], str] = {}
        for f in files:
            m = ZERO_FILE.match(f)
            if m:
                self.zero_files[(int(m.group(2)), int(m.group(1)))] = f  # (mp, dp) -> name
        self.expert_ids = expert_ids(files)  # an MoE checkpoint's global expert ids (expert_source.py)
        self.model_files = {int(m.group(1)): f for f in files for m in [MODEL_FILE.match(f)] if m}
        self.layer_files = [f for f in files if LAYER_FILE.match(f)]
        self.saved_names: Dict[int, Dict[str, str]] = {}  # mp -> our name -> the name in its files
        self.dense = None  # dense_source.DenseStates: a checkpoint without ZeRO (stage 0 in DeepSpeed's engine)
        if not self.zero_files:
            self.dense = DenseStates.find(self)
            if self.dense is not None and self.expert_ids:
                raise CheckpointError(f"{directory} holds MoE expert files (layer_*_expert_*) but no ZeRO optimizer "
                                      "files; reshaping an MoE checkpoint without them is not implemented")
            if self.dense is None:
                raise CheckpointError(f"{directory} holds no ZeRO optimizer files (zero_pp_rank_*_mp_rank_*_optim_states"
                                      ".pt) and no optimizer state in its model-states files; it is not a checkpoint "
                                      "with an optimizer state")
            mps, dps = sorted(self.model_files), [0]
        else:
            mps = sorted({mp for mp, _ in self.zero_files})
            dps = sorted({dp for _, dp in self.zero_files})
        if mps != list(range(len(mps))) or dps != list(range(len(dps))) or (
                self.zero_files and len(self.zero_files) != len(mps) * len(dps)):
            raise CheckpointError(f"the ZeRO files in {directory} do not form a complete grid of model-parallel "
                                  f"ranks {mps} x data-parallel ranks {dps}; some are missing")
        zero3_models = {}
        for f in files:
            m = ZERO3_MODEL_FILE.match(f)
            if m and int(m.group(1)) == 0:
                zero3_models[int(m.group(2))] = f
        shape_files = {mp: self.model_files.get(mp) or zero3_models.get(mp) for mp in mps}
        missing = [mp for mp, f in shape_files.items() if f is None]
        if missing:
            raise CheckpointError(f"{directory} has no model-states file for model-parallel rank(s) {missing} "
                                  "(mp_rank_XX_model_states.pt), so the parameter shapes are unknown")
        self.param_shapes: Dict[int, List["OrderedDict[str, torch.Size]"]] = {}
        head = None
        for mp in mps:
            sd = self.files.load(shape_files[mp])
            if head is None:
                head = {k: v for k, v in sd.items() if k not in ("module", "optimizer", "param_shapes")}
            if self.dense is None:
                groups = [OrderedDict((n, torch.Size(s)) for n, s in g.items()) for g in sd["param_shapes"]]
                renamed = ours_names(head, [n for g in groups for n in g])
                back = {saved: ours for ours, saved in renamed.items()}
                self.saved_names[mp] = dict(renamed)
                self.param_shapes[mp] = all_expert_shapes(
                    [OrderedDict((back[n], s) for n, s in g.items()) for g in groups], self.expert_ids,
                    self.files.path(shape_files[mp]))
            del sd
        self.head = head
        self.info = _with_swiglu_patterns(head.get(UNIVERSAL_CHECKPOINT_INFO) or {}, head.get("args"))
        self.layout = Layout(*self._tp_pp(head, len(mps)), dp=len(dps))
        saved_args = header_args(head)  # experts split over another ETP than TP: their slices by ETP (distributed/topology.py)
        self.expert_tp = int(saved_args.get("expert_tensor_parallel_size") or self.layout.tp)
        self.expert_ep = int(saved_args.get("expert_model_parallel_size") or saved_args.get("moe_expert_parallel_size")
                             or 1)
        self.local_experts = None  # DeepSpeed's engine names experts in its ZeRO files by local id (expert_source.py)
        if self.expert_ids and self.zero_files and writes_qkv_blocks(head):  # written by Megatron-DeepSpeed (ours
            # writes its layout for dense models only: --save-megatron-deepspeed-layout refuses MoE)
            self.local_experts = LocalExpertNames(len(self.expert_ids), self.expert_ep,
                                                  self.files.path(shape_files[mps[0]]))
        if self.expert_tp != self.layout.tp:
            self.layout.check_expert_parallel(self.expert_ep, self.expert_tp)
        self.qkv_blocks = writes_qkv_blocks(head)  # Megatron-DeepSpeed's [Q; K; V] per TP rank
        if self.dense is not None:
            self.dense.read_layout(self, mps)
        self.zero_stage = self._zero_stage()
        self.params: List[Tuple[str, int]] = []
        seen = set()
        for pp in range(self.layout.pp):
            for g in self.param_shapes[pp * self.layout.tp]:
                for name in g:
                    if name not in seen:
                        seen.add(name)
                        self.params.append((name, pp))

    def saved_name(self, mp: int, name: str, dp: Optional[int] = None) -> Optional[str]:
        """The name our parameter `name` has in model-parallel rank mp's files (DP rank dp's ZeRO file: None
        when that file holds another EP rank's experts)."""
        if dp is not None and self.local_experts is not None:
            name = self.local_experts.on_rank(name, dp)
            if name is None:
                return None
        return self.saved_names.get(mp, {}).get(name, name)

    def _tp_pp(self, head: dict, mp_size: int) -> Tuple[int, int]:
        tp, pp = header_tp_pp(head)
        if not (tp and pp) and self.layer_files:  # the layer files name their TP ranks
            tp = len({LAYER_FILE.match(f).group(2) for f in self.layer_files})
        tp = tp or mp_size
        pp = pp or mp_size // tp
        if tp * pp != mp_size:
            raise CheckpointError(f"{self.directory}: TP {tp} x PP {pp} does not match its {mp_size} model-parallel "
                                  "ranks of ZeRO files")
        return tp, pp

    def _zero_stage(self) -> int:
        if self.dense is not None:
            return 0
        sd = self.files.load(self.zero_files[(0, 0)])
        return int(sd["optimizer_state_dict"].get("zero_stage", 1))

    @property
    def iteration(self) -> int:
        return int(self.head.get("iteration", self.head.get("global_steps", 0)) or 0)

    def original_vocab_size(self, name: str) -> Optional[int]:
        return self.info.get("original_vocab_size")

    def rule(self, name: str) -> MergeRule:
        return merge_rule(name, self.info)

    def stage(self, pp: int, threads: int = 1) -> "StageReader":
        if self.dense is not None:
            return DenseStageReader(self, pp)
        return StageReader(self, pp, threads)


class StageReader:
    """One pipeline stage's optimizer files (TP x DP), memory-mapped; assembles full tensors from them."""

    def __init__(self, src: SourceCheckpoint, pp: int, threads: int = 1):
        self.src, self.pp, self.threads = src, pp, threads
        lay = src.layout
        self.mps = [pp * lay.tp + t for t in range(lay.tp)]
        self.opt = {}  # (tp, dp) -> optimizer_state_dict
        for t, mp in enumerate(self.mps):
            for d in range(lay.dp):
                self.opt[(t, d)] = src.files.load(src.zero_files[(mp, d)])["optimizer_state_dict"]
        self.group_of = [{n: g for g, shapes in enumerate(src.param_shapes[mp]) for n in shapes} for mp in self.mps]
        self.mismatched: List[str] = []
        self._z3 = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.opt.clear()
        self._z3.clear()

    def names(self) -> List[str]:
        return [n for n, pp in self.src.params if pp == self.pp]

    def split(self, name: str) -> int:
        """How many slices `name` was saved in: ETP for an expert's, else TP."""
        src = self.src
        return src.expert_tp if src.expert_tp != src.layout.tp and expert_of(name) is not None else src.layout.tp

    def holders(self, name: str, tp: int) -> List[Tuple[int, int]]:
        """The (tp, dp) files that may hold slice `tp` of `name`, in the order its fragments concatenate:
        the DP ranks of TP rank tp, or for an expert split by ETP other than TP its expert-DP group's ranks
        (etp = tp, in expert-DP order; only its EP rank's hold it)."""
        src, lay = self.src, self.src.layout
        if self.split(name) == lay.tp:
            return [(tp, d) for d in range(lay.dp)]
        etp, ep = src.expert_tp, src.expert_ep
        out = []
        for edp in range(lay.tp * lay.dp // (etp * ep)):
            for e in range(ep):
                _, d, t = lay.coords(lay.expert_rank(self.pp, tp, e, edp, ep, etp))
                out.append((t, d))
        return out

    def local_shape(self, name: str, tp: int) -> torch.Size:
        if self.split(name) != self.src.layout.tp:
            tp = 0  # ETP slices of one shape, listed beside every expert (expert_source.py)
        mp = self.mps[tp]
        return self.src.param_shapes[mp][self.group_of[tp][name]][name]

    def _flat(self, osd: dict, g: int, key: str) -> torch.Tensor:
        if self.src.zero_stage == 3:
            if key == "fp32":
                return osd["fp32_flat_groups"][g]
            return _indexed(osd["optimizer_state_dict"]["state"], g)[key]
        if key == "fp32":
            return osd["single_partition_of_fp32_groups"][g]
        return _indexed(osd["base_optimizer_state"]["state"], g)[key]

    def _fragments(self, name: str, tp: int, d: int) -> Tuple[int, int]:
        """(start, numel) of `name` in DP rank d's flat group."""
        g = self.group_of[tp][name]
        if self.src.zero_stage == 3 and "param_slice_mappings" not in self.opt[(tp, d)]:
            key = (tp, g)
            if key not in self._z3:
                shapes = self.src.param_shapes[self.mps[tp]][g]
                self._z3[key] = zero3_group_offsets([(n, _numel(s)) for n, s in shapes.items()], self.src.layout.dp)
            off, per = self._z3[key][name]
            numel = _numel(self.local_shape(name, tp))
            return off, max(0, min(per, numel - d * per))
        saved = self.src.saved_name(self.mps[tp], name, d)
        frag = None if saved is None else self.opt[(tp, d)]["param_slice_mappings"][g].get(saved)
        return (0, 0) if frag is None else (int(frag.start), int(frag.numel))

    def tp_slice(self, name: str, key: str, tp: int) -> torch.Tensor:
        """TP rank tp's piece of `name` (its local shape), in our layout."""
        local = self.saved_slice(name, key, tp)
        if self.src.qkv_blocks and name.endswith(QKV_SUFFIXES):
            return qkv_to_ours(local.float(), *qkv_heads(self.src.head, self.src.layout.tp))
        return local

    def saved_slice(self, name: str, key: str, tp: int) -> torch.Tensor:
        """TP rank tp's piece of `name` as saved, gathered from every DP rank's fragment."""
        shape = self.local_shape(name, tp)
        pieces = []
        for t, d in self.holders(name, tp):
            start, n = self._fragments(name, t, d)
            if n:
                g = self.group_of[t][name]
                osd = self.opt[(t, d)]
                pieces.append(self._flat(osd, g, key).narrow(0, start, n))
                if self.src.zero_stage < 3 and partition_counts(osd)[min(g, len(partition_counts(osd)) - 1)] == 1:
                    break  # not partitioned (ZeRO 0): every rank holding the group holds it whole
        total = sum(p.numel() for p in pieces)
        if total != _numel(shape):
            raise CheckpointError(f"the fragments of {name} ({key}) on TP rank {tp}, stage {self.pp} hold {total} "
                                  f"elements over {self.src.layout.dp} DP ranks, but its shape {tuple(shape)} has "
                                  f"{_numel(shape)}: the optimizer files of {self.src.directory} are inconsistent")
        if len(pieces) == 1:
            return pieces[0].view(shape)  # a view of the mapped file: nothing copied yet
        flat = torch.empty(total, dtype=torch.float32)
        pos = 0
        for p in pieces:
            flat.narrow(0, pos, p.numel()).copy_(p)
            pos += p.numel()
        return flat.view(shape)

    def assemble(self, name: str, key: str) -> Tuple[torch.Tensor, MergeRule]:
        """The universal tensor of `name` for state `key` (fp32, exp_avg, exp_avg_sq) and its merge rule."""
        rule = self.src.rule(name)
        tp = self.split(name)
        if rule.cat_dim is None:
            full = self.tp_slice(name, key, 0)
            if rule.average and tp > 1:
                full = sum(self.tp_slice(name, key, t).float() for t in range(tp)) / tp
            elif key == "fp32" and tp > 1:
                for t in range(1, tp):
                    if not torch.equal(full, self.tp_slice(name, key, t)):
                        self.mismatched.append(f"{name} (TP rank {t} differs from TP rank 0)")
                        break
        elif tp == 1:
            full = self.tp_slice(name, key, 0)
        elif rule.sub_params > 1:
            full = merge_sub_params([self.tp_slice(name, key, t) for t in range(tp)], rule.cat_dim, rule.sub_params)
        else:
            shapes = [self.local_shape(name, t) for t in range(tp)]
            dim = rule.cat_dim
            if any(len(s) <= dim for s in shapes):
                raise CheckpointError(f"{name} has shape {tuple(shapes[0])} but its merge rule concatenates TP "
                                      f"slices on dim {dim}")
            out_shape = list(shapes[0])
            out_shape[dim] = sum(s[dim] for s in shapes)
            full = torch.empty(out_shape, dtype=torch.float32)
            pos = 0
            for t, s in enumerate(shapes):
                full.narrow(dim, pos, s[dim]).copy_(self.tp_slice(name, key, t))
                pos += s[dim]
        if rule.vocab:
            vocab = self.src.original_vocab_size(name)
            if vocab is None:
                raise CheckpointError(f"{name} is a vocabulary tensor but universal_checkpoint_info in "
                                      f"{self.src.directory} records no original_vocab_size")
            full = full.narrow(0, 0, int(vocab))
        return full, rule

    def step(self, name: str):
        g = self.group_of[0][name]
        osd = self.opt[(0, 0)]
        state = osd["optimizer_state_dict"]["state"] if self.src.zero_stage == 3 else osd["base_optimizer_state"]["state"]
        if not state:  # a weights-only checkpoint (--no-save-optim): no optimizer step
            return None
        return _indexed(state, g).get("step")


class DenseStageReader(StageReader):
    """StageReader over a dense checkpoint: a TP slice is the rank's whole tensor, no DP fragments."""

    def __init__(self, src, pp: int):
        self.src, self.pp, self.threads = src, pp, 1
        self.mps = [pp * src.layout.tp + t for t in range(src.layout.tp)]
        self.group_of = [{n: g for g, shapes in enumerate(src.param_shapes[mp]) for n in shapes} for mp in self.mps]
        self.mismatched: List[str] = []
        self.opt, self._z3 = {}, {}

    def saved_slice(self, name: str, key: str, tp: int) -> torch.Tensor:
        mp, dense = self.mps[tp], self.src.dense
        if key == "fp32":
            return dense.weights[mp][name].float()
        st = dense.state[mp].get(dense.index[mp][name], {})
        if key not in st:  # a parameter the optimizer has not stepped yet
            return torch.zeros(self.local_shape(name, tp), dtype=torch.float32)
        return st[key].float()

    def step(self, name: str):
        dense = self.src.dense
        return dense.state[self.mps[0]].get(dense.index[self.mps[0]][name], {}).get("step")
