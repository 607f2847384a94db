"""One rank of a layout, built by the code that trains it, on fake tensors: no weights are allocated.

A fake process group (torch's "fake" backend: collectives return at once) of the layout's model-parallel
size stands in for the cluster; build_parallel_state and build_gpt_stage run unchanged under
FakeTensorMode, so the planner's parameter counts are those of the model the run builds, and a traced
micro-batch's activations are those of its forward and backward. The data-parallel size never changes
what one rank's model holds, so the fake world is TP x PP x CP x EP ranks (EP taken from the DP ranks),
and ZeRO's partition of the real DP size is pure arithmetic (zero/partition.py).

Runs only where torch.distributed is not initialised (tools/plan.py; pretrain_gpt.py plans in a
subprocess).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, List, NamedTuple, Tuple

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..model.params import MOE_EXPERT_PREFIX
from ..ops.fusion_flags import set_fusion_flags
from ..zero.build import param_group_kind
from ..pipeline.gpt_stage import build_gpt_stage
from ..tensor_parallel.random import model_parallel_seed
from ..distributed.topology import build_parallel_state
from .live_bytes import LiveBytes

# the compiled kernels are not torch operators (a fake tensor has no data to hand them): the trace takes
# PyTorch's path, which saves at least what the fused kernels save (the prediction errs high, never low)
UNFUSED = dict(masked_softmax_fusion=False, bias_gelu_fusion=False, persist_layer_norm=False,
               layer_norm_fusion=False, rope_fusion=False)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """A fake default process group of `world_size` for the block."""
    if dist.is_initialized():
        raise RuntimeError("the planner builds its own fake process group: run it where torch.distributed "
                           "is not initialised")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


class BalancedExpertCounts(TorchDispatchMode):
    """Under fake tensors, the router's per-expert token counts (a bincount the layer reads on the host)
    have no values: plan them as balanced routing, each expert N / E of the N routed tokens (the load that
    --moe-aux-loss-coeff drives towards; a skewed batch holds more on its busiest expert)."""

    def __init__(self):
        super().__init__()
        self._counts = {}  # id(storage) -> (routed tokens, experts)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.bincount.default:
            ids, minlength = args[0], kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            out = torch.empty(minlength, dtype=torch.long, device=ids.device)
            self._counts[id(out.untyped_storage())] = (ids.numel(), minlength - 1)
            return out
        if func is torch.ops.aten._local_scalar_dense.default and id(args[0].untyped_storage()) in self._counts:
            routed, experts = self._counts[id(args[0].untyped_storage())]
            e = args[0].storage_offset()
            return 0 if e >= experts else routed // experts + (1 if e < routed % experts else 0)
        return func(*args, **kwargs)


@dataclass(frozen=True)
class RankKind:
    """A kind of rank whose memory differs from the others': its pipeline stage and name."""

    name: str
    pp_rank: int


def rank_kinds(pp: int) -> List[RankKind]:
    if pp == 1:
        return [RankKind("only stage", 0)]
    kinds = [RankKind("first stage", 0)]
    if pp > 2:
        kinds.append(RankKind("middle stage", 1))
    return kinds + [RankKind("last stage", pp - 1)]


class Param(NamedTuple):
    """One parameter of a stage: its name, elements, whether an expert's, and the optimizer group it joins
    (optimizer_setup.param_group_kind: decay, no_decay, or muon for the blocks' matrices Muon would take)."""

    name: str
    numel: int
    expert: bool
    group: str


@dataclass(frozen=True)
class TracedRank:
    """What one rank's stage holds: its parameters (Param) in module order, and one
    micro-batch's activations: bytes saved for backward after the forward, and the peak over forward and
    backward (both above the model's own tensors)."""

    params: Tuple[Param, ...]
    saved_bytes: int
    peak_bytes: int


def trace_rank(config, degrees: dict, pp_rank: int, micro_batch: int, dtype: torch.dtype,
               partition_method: str = "uniform", virtual_stages: int = 1, trace: bool = True) -> TracedRank:
    """Build pipeline stage `pp_rank` of the layout `degrees` (build_parallel_state's keywords) on fake
    tensors and, if `trace`, run one micro-batch of `micro_batch` sequences forward and backward.

    Two choices follow the GPU the plan is for rather than this CPU: attention dropout under the `auto` or
    `flash` backend is drawn inside CUDA's flash kernel (no s x s mask: traced without it), and with
    expert parallelism the activations are traced at EP 1 (balanced routing gives an EP rank the same
    rows, N x top-k, for its E / EP experts as one rank gets for all E)."""
    params = stage_params(config, degrees, pp_rank, dtype, partition_method, virtual_stages)
    saved, peak = trace_activations(config, degrees, pp_rank, micro_batch, dtype, partition_method,
                                    virtual_stages) if trace else (0, 0)
    return TracedRank(params, saved, peak)


def stage_params(config, degrees: dict, pp_rank: int, dtype: torch.dtype, partition_method: str = "uniform",
                 virtual_stages: int = 1) -> Tuple[Param, ...]:
    """Stage `pp_rank`'s parameters, built on fake tensors."""
    return _build(config, degrees, pp_rank, dtype, partition_method, virtual_stages, None)[0]


def trace_activations(config, degrees: dict, pp_rank: int, micro_batch: int, dtype: torch.dtype,
                      partition_method: str = "uniform", virtual_stages: int = 1, marks: list = None) -> Tuple[int, int]:
    """(saved bytes, peak bytes) of one traced micro-batch of stage `pp_rank` (trace_rank's choices). `marks`, a
    list: the live bytes as each of the stage's blocks returns in the forward are appended to it."""
    if config.attention_backend in ("auto", "flash") and config.attention_dropout > 0:
        config = dataclasses.replace(config, attention_dropout=0.0)
    _, saved, peak = _build(config, {**degrees, "ep": 1, "etp": None}, pp_rank, dtype, partition_method,
                            virtual_stages, micro_batch, marks)
    return saved, peak


def _build(config, degrees, pp_rank, dtype, partition_method, virtual_stages, micro_batch, marks=None):
    tp, pp, cp, ep = degrees["tp"], degrees["pp"], degrees["cp"], degrees["ep"]
    world = tp * pp * cp * ep
    old_flags = set_fusion_flags(**UNFUSED)
    try:
        with fake_world(world, pp_rank * (world // pp)):
            state = build_parallel_state(**{**degrees, "cp_a2a": degrees.get("cp_a2a", 0)})
            model_parallel_seed(config.seed, state.tp_rank, state.pp_rank, state.cp_rank)  # dropout's RNG streams
            with FakeTensorMode(allow_non_fake_inputs=True):  # full recompute saves the real RNG state
                default_dtype = torch.get_default_dtype()
                torch.set_default_dtype(dtype)  # fake parameters cannot be cast after they are made
                try:
                    model = build_gpt_stage(config, state, partition_method, device=torch.device("cpu"),
                                            virtual_stages=virtual_stages)
                finally:
                    torch.set_default_dtype(default_dtype)
                params = tuple(Param(n, p.numel(), MOE_EXPERT_PREFIX in n, param_group_kind(n, p.shape, muon=True))
                               for n, p in model.named_parameters())
                saved = peak = 0
                if micro_batch:
                    saved, peak = _trace_micro_batch(model, state, config, micro_batch, dtype, marks)
    finally:
        set_fusion_flags(**{k: getattr(old_flags, k) for k in UNFUSED})
    return params, saved, peak


def _trace_micro_batch(model, state, config, micro_batch: int, dtype, marks=None) -> Tuple[int, int]:
    seq = config.seq_length // state.cp_size
    tokens = torch.zeros(micro_batch, seq, dtype=torch.long)
    if state.is_first_stage:
        inputs = tokens
    else:
        seq_local = seq // state.tp_size if config.sequence_parallel and state.tp_size > 1 else seq
        inputs = torch.zeros(micro_batch, seq_local, config.hidden_size, dtype=dtype, requires_grad=True)
    for p in model.parameters():  # the optimizer takes each gradient into its own buffers (memory.py counts those)
        p.register_post_accumulate_grad_hook(_drop_grad)
    routing = BalancedExpertCounts() if config.num_experts else contextlib.nullcontext()  # a mode costs per operator
    live, forward = LiveBytes(), [True]
    hooks = [b.register_forward_hook(lambda *_: marks.append(live.current) if forward[0] else None)
             for b in (model.blocks if marks is not None else [])]  # (not again in a backward's recomputation)
    with routing, live:
        out = model(inputs, labels=tokens if state.is_last_stage else None,
                    tokens=tokens if state.is_last_stage else None)  # (multi-token prediction embeds them)
        forward[0] = False
        saved = live.current - out.untyped_storage().nbytes()
        if state.is_last_stage:
            out.backward()
        else:
            out.backward(torch.ones_like(out))
        del out
    for h in hooks:
        h.remove()
    return saved, live.peak


def _drop_grad(param) -> None:
    param.grad = None
