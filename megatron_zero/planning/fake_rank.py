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
import weakref
import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

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
    """One parameter of a stage: its name, elements, whether an expert's, the optimizer group it joins
    (optimizer_setup.param_group_kind: decay, no_decay, or muon for the blocks' matrices Muon would take), and
    whether ZeRO gathers and holds it in FP8 (--fp8-param-gather: an FP8 layer's weight, fp8/param_gather.py),
    and the bytes the FP8 converter holds for the layer whose weight it is (its amax histories and scales, its
    FP8 weight)."""

    name: str
    numel: int
    expert: bool
    group: str
    fp8_gathered: bool = False
    fp8_bytes: int = 0  # what the FP8 converter holds for its layer (convert_fp8)


@dataclass(frozen=True)
class TracedRank:
    """What one rank's stage holds: its parameters (Param) in module order, and one
    micro-batch's activations: bytes saved for backward after the forward, and the peak over forward and
    backward (both above the model's own tensors)."""

    params: Tuple[Param, ...]
    saved_bytes: int
    peak_bytes: int


@dataclass(frozen=True)
class Conversion:
    """What the run's model converters (megatron_zero/model_converters.py) change in a stage that its memory
    shows: FP8's layers (`fp8`: the run's fp8/settings.Float8Settings, or None) and the output loss, fused by
    vocabulary chunks or the whole logits (--cross-entropy-loss-fusion)."""

    fp8: Optional[object] = None
    fused_loss: bool = True


NO_CONVERSION = Conversion()


def trace_rank(config, degrees: dict, pp_rank: int, micro_batch: int, dtype: torch.dtype,
               partition_method: str = "uniform", virtual_stages: int = 1, trace: bool = True,
               conversion: Conversion = NO_CONVERSION) -> TracedRank:
    """Build pipeline stage `pp_rank` of the layout `degrees` (build_parallel_state's keywords) on fake
    tensors, converted as `conversion` says (the run's FP8 layers, its output loss), and, if `trace`, run one
    micro-batch of `micro_batch` sequences forward and backward.

    Two choices follow the GPU the plan is for rather than this CPU: attention dropout under the `auto` or
    `flash` backend is drawn inside CUDA's flash kernel (no s x s mask: traced without it), and with
    expert parallelism the activations are traced at EP 1 (balanced routing gives an EP rank the same
    rows, N x top-k, for its E / EP experts as one rank gets for all E)."""
    params = stage_params(config, degrees, pp_rank, dtype, partition_method, virtual_stages, conversion)
    saved, peak = trace_activations(config, degrees, pp_rank, micro_batch, dtype, partition_method,
                                    virtual_stages, conversion=conversion) if trace else (0, 0)
    return TracedRank(params, saved, peak)


def stage_params(config, degrees: dict, pp_rank: int, dtype: torch.dtype, partition_method: str = "uniform",
                 virtual_stages: int = 1, conversion: Conversion = NO_CONVERSION) -> Tuple[Param, ...]:
    """Stage `pp_rank`'s parameters, built on fake tensors (converted as `conversion` says)."""
    return _build(config, degrees, pp_rank, dtype, partition_method, virtual_stages, None, conversion=conversion)[0]


def trace_activations(config, degrees: dict, pp_rank: int, micro_batch: int, dtype: torch.dtype,
                      partition_method: str = "uniform", virtual_stages: int = 1, marks: list = None,
                      conversion: Conversion = NO_CONVERSION) -> Tuple[int, int]:
    """(saved bytes, peak bytes) of one traced micro-batch of stage `pp_rank` (trace_rank's choices). `marks`, a
    list: the live bytes as each of the stage's blocks returns in the forward are appended to it (less the
    blocks' inputs, up to that one, that the forward does not keep: a block's net growth is a difference)."""
    if config.attention_backend in ("auto", "flash") and config.attention_dropout > 0:
        config = dataclasses.replace(config, attention_dropout=0.0)
    _, saved, peak = _build(config, {**degrees, "ep": 1, "etp": None}, pp_rank, dtype, partition_method,
                            virtual_stages, micro_batch, marks, conversion)
    return saved, peak


def convert(model, state, conversion: Conversion) -> Dict[int, Tuple[bool, int]]:
    """The fake stage converted as the trainer converts the run's (the output loss's converter; FP8's,
    convert_fp8); -> convert_fp8's account of the FP8 layers (empty without FP8)."""
    from ..model.output_loss_converter import OutputLossConverter
    OutputLossConverter(conversion.fused_loss).convert(model)
    return convert_fp8(model, state, conversion.fp8) if conversion.fp8 is not None else {}


def convert_fp8(model, state, fp8) -> Dict[int, Tuple[bool, int]]:
    """The run's FP8 converter (fp8/convert.py) applied to the fake stage as the trainer applies it, then, under
    --fp8-param-gather, ZeRO's FP8 side of the weight gather made as zero/build.py's weight_gathers makes it
    (its FP8 weights, 1 byte an element, and their scales). -> per converted layer's weight (by id): whether
    ZeRO gathers it in FP8, and the bytes the two made for the layer (delayed scaling's amax histories and
    scales, its FP8 weight: the tensors its `fp8` holds), which together are every byte they made."""
    from ..fp8.convert import Float8Converter
    from ..model.converters import ModelConverters
    from ..zero.build import weight_gathers
    device = next(model.parameters()).device
    converter = Float8Converter(fp8, device, state.cp_group if state.cp_size > 1 else None, None,
                                state.expert_dp_group, device_check=False)  # planned for the run's GPU
    with LiveBytes() as live:
        converter.convert(model)
        weight_gathers(ModelConverters([converter]), model, None, None, device)
    layers = {id(m.weight): (m.fp8.param_gather, _held_bytes(m.fp8)) for m in model.modules()
              if getattr(m, "fp8", None) is not None}
    if sum(n for _, n in layers.values()) != live.current:
        raise RuntimeError(f"the FP8 converter made {live.current} bytes, its layers hold "
                           f"{sum(n for _, n in layers.values())}: planning/fake_rank.py's _held_bytes misses some")
    return layers


def _held_bytes(obj, depth: int = 2) -> int:
    """The storage bytes of the tensors an object holds in its attributes, and theirs `depth` levels down."""
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if depth == 0 or not hasattr(obj, "__dict__"):
        return 0
    return sum(_held_bytes(v, depth - 1) for v in vars(obj).values())


def _build(config, degrees, pp_rank, dtype, partition_method, virtual_stages, micro_batch, marks=None,
           conversion: Conversion = NO_CONVERSION):
    tp, pp, cp, ep = degrees["tp"], degrees["pp"], degrees["cp"], degrees["ep"]
    world = tp * pp * cp * ep
    old_flags = set_fusion_flags(**UNFUSED)
    try:
        with fake_world(world, pp_rank * (world // pp)):
            state = build_parallel_state(**{**degrees, "cp_a2a": degrees.get("cp_a2a", 0)})
            model_parallel_seed(config.seed, state.tp_rank, state.pp_rank, state.cp_rank)  # dropout's RNG streams
            with FakeTensorMode(allow_non_fake_inputs=True):  # full recompute saves the real RNG state
                default_dtype = torch.get_default_dtype()
                torch.set_default_dtype(dtype)  # fake parameters cannot be cast after they are made: built in
                stage_config = dataclasses.replace(config, params_dtype=dtype)  # the dtype ZeRO casts them to
                try:
                    model = build_gpt_stage(stage_config, state, partition_method, device=torch.device("cpu"),
                                            virtual_stages=virtual_stages)
                finally:
                    torch.set_default_dtype(default_dtype)
                converted = convert(model, state, conversion)
                params = tuple(Param(n, p.numel(), MOE_EXPERT_PREFIX in n, param_group_kind(n, p.shape, muon=True),
                                     *converted.get(id(p), (False, 0))) for n, p in model.named_parameters())
                saved = peak = 0
                if micro_batch:
                    saved, peak = _trace_micro_batch(model, state, config, micro_batch, dtype, marks)
                if conversion.fp8 is not None:
                    from ..fp8.delayed import histories
                    list(histories(model))  # delayed scaling's amaxes still waiting: recorded here, in the fake world
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
    live, forward, returns = LiveBytes(), [True], []

    def returned(block, args, output):  # the live bytes as a block returns, and its input (not again in a
        if forward[0]:                  # backward's recomputation)
            x = args[0]
            returns.append((live.current, weakref.ref(x.untyped_storage()), x.untyped_storage().nbytes()))

    hooks = [b.register_forward_hook(returned) for b in (model.blocks if marks is not None else [])]
    with routing, live:
        out = model(inputs, labels=tokens if state.is_last_stage else None,
                    tokens=tokens if state.is_last_stage else None)  # (multi-token prediction embeds them)
        forward[0] = False
        saved = live.current - out.untyped_storage().nbytes()
        if marks is not None:  # a block's input no longer alive (not saved: a bf16 input its norm casts to fp32)
            dead = 0           # went once its output took its place: the marks' differences are net of it
            for current, storage, nbytes in returns:
                dead += nbytes if storage() is None else 0
                marks.append(current - dead)
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
