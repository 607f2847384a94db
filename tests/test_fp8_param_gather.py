"""--fp8-param-gather: ZeRO-1/2 all-gather the FP8 layers' weights in FP8, cast from the fp32 masters.

Default tier: one process in bf16, the FP8 weight each step is the master's cast within fp8_master_cast_bound
of the bf16 weight's cast (what the matmul casts without the flag), the FP8 weight is the layer's one copy
(the bytes of the model's tensors counted: 2 an element of the other weights, 1 of the FP8 layers') and a
checkpoint's state_dict republishes the bf16 weights from the masters; the MoE experts' weights gathered in FP8
too, and at EP2 against the one-process model with the flag; with an offloaded optimizer the FP8 weights are
cast from the fp32 masters (bit for bit); DP2 ZeRO-1 in bf16 moves the FP8 weights as 1 byte an element (the
collectives' bytes counted) with one all-reduce of the weights' amaxes, and leaves every rank each FP8 weight
bit-equal to the whole master's cast (failing with the amaxes not reduced over DP). `slow` (the training claim
the DP2 test covers for one step): DP2 at ZeRO-1, ZeRO-1 overlapped and ZeRO-2, TP2 x DP2 at ZeRO-1 and PP2 x
DP2 at ZeRO-2 overlapped, against the one-process FP8 model (fp32: a master is its weight, so the flag changes
no value; tensorwise) and, for delayed scaling, DP2 against DP1 with the flag; each run again with the weights'
amaxes not reduced over DP fails the check.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_zero.distributed import shm_comm
from megatron_zero.distributed.device import HOST
from megatron_zero.model import reference_model
from megatron_zero.testing import run_ranks
from megatron_zero.testing.collective_counter import CollectiveCounter
from megatron_zero.testing.live_bytes import storage_bytes
from megatron_zero.testing.tiny_gpt import tiny_llama_config
from megatron_zero.testing.tolerances import assert_losses_close, assert_within, fp8_master_cast_bound
from megatron_zero.zero import ZeroOptimizer
from megatron_zero.zero.partition import partition_group

torchao_float8 = pytest.importorskip("torchao.float8")
from megatron_zero.fp8.convert import Float8Converter, fp8_weight_gather  # noqa: E402  (needs torchao)
from megatron_zero.fp8.settings import Float8Settings  # noqa: E402

CPU = torch.device("cpu")
TOKENS = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(3))


def _bf16_model(recipe="tensorwise", param_gather=True):
    torch.manual_seed(0)
    model = reference_model(tiny_llama_config(num_layers=2, seq_length=16, max_position_embeddings=16))
    model.to(torch.bfloat16)
    Float8Converter(Float8Settings("hybrid", recipe, 0, True, param_gather=param_gather), CPU)(model)
    return model


def _fp8_layers(model):
    return [(n, m) for n, m in model.named_modules() if getattr(m, "fp8", None) is not None]


def holds_bytes(weight):
    """Whether a weight's storage holds its elements (not --fp8-param-gather's placeholder of its shape)."""
    return weight.untyped_storage().nbytes() >= weight.numel() * weight.element_size()


def _masters_by_param(opt):
    """id(param) -> this rank's fragments of its fp32 master, zero elsewhere (all of it at DP1)."""
    out = {}
    for gi, m in enumerate(opt.optimizer.weights()):
        for p, in_param, in_part, n in opt.impl.owned_ranges(gi):
            out.setdefault(id(p), torch.zeros(p.numel()))[in_param:in_param + n] = m[in_part:in_part + n].detach()
    return out


def _bytes_held(model, fp8_held: bool) -> int:
    """What the model's weights should hold in bf16 with --fp8-param-gather at ZeRO-1/2: 2 bytes an element of
    every weight but the FP8 layers', 1 an element of those (their FP8 weight), their bf16 weight (2 more) only
    where `fp8_held`, else its placeholder's one element; and the buffers."""
    fp8 = [m.weight for _, m in _fp8_layers(model)]
    others = sum(p.numel() for p in model.parameters() if all(p is not w for w in fp8))
    return (2 * others + sum(w.numel() * (3 if fp8_held else 1) for w in fp8) + (0 if fp8_held else 2 * len(fp8))
            + storage_bytes(model.buffers()))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_weights_are_the_masters_cast_and_the_one_copy(recipe):
    """The FP8 layers' bf16 weights are not held between steps (one copy, the FP8 one: the bytes of the model's
    tensors counted); a checkpoint's state_dict holds them again, the masters in bf16, until the next step."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    from megatron_zero.testing.live_bytes import weight_bytes

    model = _bf16_model(recipe)
    opt = ZeroOptimizer(list(model.named_parameters()), stage=1, dtype="bf16", module=model, lr=1e-2,
                        fp8_gather=fp8_weight_gather(model, None, CPU))
    assert weight_bytes(model) == _bytes_held(model, True)  # a resume loads into them
    for step in range(2):
        loss = model(TOKENS[:, :-1], labels=TOKENS[:, 1:])
        opt.backward(loss)
        assert opt.step()[0]
        assert weight_bytes(model) == _bytes_held(model, False)
        fp8_numel = sum(m.weight.numel() for _, m in _fp8_layers(model))
        assert opt.memory_bytes()["params"] == 2 * (sum(p.numel() for p in model.parameters()) - fp8_numel) + fp8_numel
        masters = _masters_by_param(opt)
        for name, m in _fp8_layers(model):
            assert not holds_bytes(m.weight), name
            w8 = m.fp8.weight8
            dequant = w8.data.float() / w8.scale
            master = masters[id(m.weight)].view(m.weight.shape)
            dtype = w8.data.dtype
            if recipe == "tensorwise":  # the whole master's amax
                assert torch.equal(w8.scale, amax_to_scale(master.abs().max(), dtype)), name
            bf16 = master.to(torch.bfloat16)
            s_bf16 = amax_to_scale(bf16.float().abs().max(), dtype)
            without = to_fp8_saturated(bf16.float() * s_bf16, dtype).float() / s_bf16  # the matmul's own cast
            assert_within(dequant, without, fp8_master_cast_bound(master, w8.scale, s_bf16, dtype).float(),
                          f"{name} step {step}")
    opt.state_dict()  # a checkpoint's weights: the masters in bf16, a bf16 run's
    assert weight_bytes(model) == _bytes_held(model, True)
    masters = _masters_by_param(opt)
    for name, m in _fp8_layers(model):
        assert torch.equal(m.weight, masters[id(m.weight)].view(m.weight.shape).to(torch.bfloat16)), name
    opt.backward(model(TOKENS[:, :-1], labels=TOKENS[:, 1:]))
    assert opt.step()[0]
    assert weight_bytes(model) == _bytes_held(model, False)


def test_zero3_holds_an_fp8_weight_chunk_in_fp8_only():
    """ZeRO-3 at rest (every parameter released, threshold 0): the shards' bytes are 2 an element of the other
    parameters and 1 of the FP8 weights (their FP8 chunks), counted from the tensors."""
    model = _bf16_model()
    opt = ZeroOptimizer(list(model.named_parameters()), stage=3, dtype="bf16", module=model, lr=1e-2,
                        persistence_threshold=0, fp8_gather=fp8_weight_gather(model, None, CPU))
    opt.backward(model(TOKENS[:, :-1], labels=TOKENS[:, 1:]))
    assert opt.step()[0]
    fp8 = [m.weight for _, m in _fp8_layers(model)]
    params = [p for g in opt.impl.groups for p in g]
    fp8_numel = sum(w.ds_numel for w in fp8)
    held = storage_bytes([*opt.impl.shards, *(getattr(p, "ds_shard8", None) for p in params), *model.parameters()])
    assert held == 2 * (sum(p.ds_numel for p in params) - fp8_numel) + fp8_numel


def test_log_line_says_which_weights_are_gathered_in_fp8():
    from megatron_zero.testing.fp8_layouts import moe_config

    model = reference_model(moe_config())
    line = Float8Converter(Float8Settings("hybrid", "tensorwise", 0, True, param_gather=True), CPU)(model)
    assert line.endswith("; ZeRO all-gathers their weights in FP8")


def _assert_cast_from(masters, layers):
    """Each layer's FP8 weight is its whole fp32 master (`masters`: id(weight) -> flat fp32) cast with the
    master's own scale, bit for bit."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    for name, m in layers:
        w8 = m.fp8.weight8
        assert w8 is not None, f"{name}: no FP8 weight gathered"
        master = masters[id(m.weight)]
        scale = amax_to_scale(master.abs().max(), w8.data.dtype)
        assert torch.equal(w8.scale, scale), name
        assert torch.equal(w8.data.reshape(-1).view(torch.uint8),
                           to_fp8_saturated(master * scale, w8.data.dtype).view(torch.uint8)), name


def test_moe_experts_weights_are_gathered_in_fp8_too():
    """The MoE experts' layers (each its own FP8 matmul, fp8/experts.py) get their FP8 weight from ZeRO's gather
    as the other layers do: the fp32 master's cast, the bf16 weight not held (one process, ZeRO-1)."""
    from megatron_zero.fp8.experts import is_expert
    from megatron_zero.testing.fp8_layouts import moe_config

    torch.manual_seed(0)
    model = reference_model(moe_config())
    model.to(torch.bfloat16)
    Float8Converter(Float8Settings("hybrid", "tensorwise", 0, True, param_gather=True), CPU)(model)
    experts = [(n, m) for n, m in _fp8_layers(model) if is_expert(m)]
    assert experts
    opt = ZeroOptimizer(list(model.named_parameters()), stage=1, dtype="bf16", module=model, lr=1e-2,
                        fp8_gather=fp8_weight_gather(model, None, CPU))
    opt.backward(model(TOKENS[:, :-1], labels=TOKENS[:, 1:]))
    assert opt.step()[0]
    _assert_cast_from(_masters_by_param(opt), experts)
    assert not any(holds_bytes(m.weight) for _, m in experts)


@pytest.mark.parametrize("stage", [1, 3])
def test_cpu_optimizer_casts_the_fp8_weights_from_the_fp32_masters(stage):
    """--cpu-optimizer on a GPU used to upload the stepped masters in bf16 and cast the FP8 weights from that
    upload (a double rounding); they are cast from the fp32 masters, bit for bit the whole master's cast.
    `cpu:0` stands in for the GPU: a device that is not the host, so ZeroOptimizer wires the offload as for one
    (the copies then synchronous)."""
    model = _bf16_model()
    opt = ZeroOptimizer(list(model.named_parameters()), stage=stage, dtype="bf16", module=model, lr=1e-2,
                        offload="cpu", device=torch.device("cpu", 0), persistence_threshold=0,
                        fp8_gather=fp8_weight_gather(model, None, torch.device("cpu", 0)))
    assert opt.device != HOST
    for _ in range(2):
        opt.backward(model(TOKENS[:, :-1], labels=TOKENS[:, 1:]))
        assert opt.step()[0]
    masters = {}  # id(weight) -> its whole fp32 master (DP1: every fragment is this rank's)
    for gi, m in enumerate(opt.optimizer.params):
        for p, in_param, in_part, n in opt.impl.owned_ranges(gi):
            masters.setdefault(id(p), torch.zeros(p.ds_numel if stage == 3 else p.numel()))[
                in_param:in_param + n] = m.detach()[in_part:in_part + n]
    if stage == 3:  # the FP8 weights are gathered with their units: this rank's FP8 chunk of each
        with opt.impl.gathered():
            _assert_cast_from(masters, _fp8_layers(model))
    else:
        _assert_cast_from(masters, _fp8_layers(model))


def _bytes_step():
    shm_comm.set_shared_memory_comm(False)
    model = _bf16_model()
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, stage=1, dtype="bf16",
                        module=model, fp8_gather=fp8_weight_gather(model, dist.group.WORLD, CPU))
    with CollectiveCounter() as seen:
        opt.backward(model(TOKENS[dist.get_rank():dist.get_rank() + 1, :-1],
                           labels=TOKENS[dist.get_rank():dist.get_rank() + 1, 1:]))
        assert opt.step()[0]
    fp8 = {n + ".weight" for n, _ in _fp8_layers(model)}
    mine = _masters_by_param(opt)
    weights = {n: (m.fp8.weight8.data.view(torch.uint8).clone(), m.fp8.weight8.scale.clone(),
                   mine.get(id(m.weight), torch.zeros(m.weight.numel())), not holds_bytes(m.weight))
               for n, m in _fp8_layers(model)}
    return seen.calls, [[(n, p.numel(), n in fp8) for n, p in g] for g in opt.named_groups], weights


def test_dp2_zero1_gathers_the_fp8_weights_as_one_byte_an_element():
    """Also: every rank ends with each FP8 weight exactly the whole fp32 master's cast (the scale from the
    amax over both ranks' fragments, the bytes of both), its bf16 weight not held."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    dp = 2
    ranks = run_ranks(_bytes_step, dp, timeout=300)
    for name, (data, scale, _, _) in ranks[0][2].items():
        master = sum(r[2][name][2] for r in ranks)  # the fragments are disjoint
        dtype = torch.float8_e4m3fn
        assert torch.equal(scale, amax_to_scale(master.abs().max(), dtype)), name
        assert torch.equal(data.view(-1), to_fp8_saturated(master * scale, dtype).view(torch.uint8)), name
        assert all(torch.equal(r[2][name][0], data) and r[2][name][3] for r in ranks), name
    for calls, groups, _ in ranks:
        want = bf16 = 0
        for group in groups:
            part = partition_group([(n, k) for n, k, _ in group], dp)
            is_fp8 = [f for _, _, f in group]
            rows = [sum(n * (1 if is_fp8[i] else 2) for i, _, _, n in part.param_ranges(r)) for r in range(dp)]
            want += sum(-(-row // 16) * 16 for row in rows)  # each rank's row, its own length (16-byte aligned)
            bf16 += part.padded_numel * 2
        # gloo: rows of one length in one all_gather, of several one broadcast a row (NCCL: its all_gather)
        gathered = [b[0] for name, b in calls if name in ("c10d::allgather_", "c10d::broadcast_")]
        assert sum(gathered) == want < bf16 * 0.8, (gathered, want, bf16)
        assert not [b for name, b in calls if name == "c10d::_allgather_base_"]  # no bf16 gather of the flat buffer
        fp8_numel = sum(n for g in groups for _, n, f in g if f)
        assert want - sum(2 * n for g in groups for _, n, f in g if not f) in range(fp8_numel, fp8_numel + 16 * dp * 2)
        amaxes = [sum(b) for name, b in calls if name == "c10d::allreduce_"]
        assert amaxes.count(4 * len([f for g in groups for _, _, f in g if f])) == 1  # one fp32 amax per weight


def _zero3_gathers(param_gather):
    """The all-gathers' input bytes of one DP2 ZeRO-3 step (every parameter gathered per unit: threshold 0)."""
    shm_comm.set_shared_memory_comm(False)
    model = _bf16_model(param_gather=param_gather)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, stage=3, dtype="bf16",
                        module=model, persistence_threshold=0, prefetch=False,
                        fp8_gather=fp8_weight_gather(model, dist.group.WORLD, CPU))
    r = dist.get_rank()
    with CollectiveCounter() as seen:
        opt.backward(model(TOKENS[r:r + 1, :-1], labels=TOKENS[r:r + 1, 1:]))
        assert opt.step()[0]
    chunks = sum(-(-m.weight.ds_numel // 2) for _, m in _fp8_layers(model))  # each rank's chunk of each
    return [b[1] for name, b in seen.calls if name == "c10d::_allgather_base_"], chunks


def _zero3_both():
    return _zero3_gathers(False), _zero3_gathers(True)


@pytest.mark.slow
def test_dp2_zero3_gathers_the_fp8_weight_chunks_as_one_byte_an_element():
    """ZeRO-3: the same per-unit gathers, each smaller by one byte per FP8 weight element it carries, every FP8
    weight gathered twice (its unit's forward and backward)."""
    for (without, _), (with_flag, chunks) in run_ranks(_zero3_both, 2, timeout=300):
        assert len(with_flag) == len(without) > 0
        saved = [a - b for a, b in zip(without, with_flag)]
        assert all(0 <= s <= a // 2 for s, a in zip(saved, without)), (without, with_flag)
        assert sum(saved) == 2 * chunks, (saved, chunks)


def _runs(**layout):
    from megatron_zero.testing.fp8_layouts import fp8_layout_run
    return (fp8_layout_run(param_gather=True, **layout),
            fp8_layout_run(param_gather=True, broken_gather=True, **layout))


def _check(run, ref_losses, ref_norms, rtol):
    assert_losses_close(run["losses"], ref_losses, rtol, "loss")
    assert_losses_close(run["norms"], ref_norms, rtol, "gradient norm")


@pytest.mark.slow
@pytest.mark.parametrize("stage, overlap, tp, pp", [(1, False, 1, 1), (1, True, 1, 1), (2, False, 1, 1),
                                                    (1, False, 2, 1), (2, True, 1, 2), (3, False, 1, 1)])
def test_dp2_tensorwise_matches_one_process(stage, overlap, tp, pp):
    """TP2 too: the weights' amaxes over DP, then over TP (each TP rank holds a shard of the weight); and PP2
    (each stage gathers its own layers' weights over its DP group)."""
    from megatron_zero.testing.fp8_layouts import GLOBAL_BATCH, config, reference_run
    from megatron_zero.testing.tolerances import fp8_same_scale_rtol

    rtol = fp8_same_scale_rtol(config(), GLOBAL_BATCH * config().seq_length)
    losses, norms, _ = reference_run(Float8Settings("hybrid", "tensorwise", emulate=True), 2)
    extra = {"persistence_threshold": 0} if stage == 3 else {}  # ZeRO-3: every weight gathered by its unit
    for good, broken in run_ranks(_runs, 2 * tp * pp, timeout=600, stage=stage, overlap=overlap, tp=tp, pp=pp,
                                  **extra):
        _check(good, losses, norms, rtol)
        with pytest.raises(AssertionError):
            _check(broken, losses, norms, rtol)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_dp2_delayed_matches_one_process(stage):
    """Delayed scaling with the flag (each weight's amax recorded once a step, at the cast after the
    optimizer's step): DP2 ZeRO-1 against the one-process model casting its weights the same way (both DP
    replicas' micro-batches as one: one history entry for both), losses, norms and every final scale; at
    ZeRO-1 and ZeRO-3."""
    import dataclasses

    from megatron_zero.testing.fp8_layouts import GLOBAL_BATCH, config, delayed_settings, reference_run
    from megatron_zero.testing.tolerances import fp8_same_scale_rtol

    rtol = fp8_same_scale_rtol(config(), GLOBAL_BATCH * config().seq_length)
    losses, norms, scales = reference_run(dataclasses.replace(delayed_settings(), param_gather=True), 2)
    for good, broken in run_ranks(_runs, 2, timeout=600, recipe="delayed", stage=stage,
                                  **({"persistence_threshold": 0} if stage == 3 else {})):
        _check(good, losses, norms, rtol)
        assert len(good["scales"]) == len(scales)
        for got, want in zip(good["scales"], scales):
            assert_within(got, want, rtol * want.abs(), "scale")
        with pytest.raises(AssertionError):
            _check(broken, losses, norms, rtol)


def _ep2_moe(stage):
    """An MoE model at EP2 (delayed scaling) with the flag: every FP8 layer's weight gathered in FP8, the
    experts' by the expert half over expert-DP, and no bf16 copy held at ZeRO-1; against the one-process model
    with the flag's casts (the experts' weights cast once a step too)."""
    import dataclasses

    from megatron_zero.testing.fp8_layouts import GLOBAL_BATCH, delayed_settings, moe_config, reference_run
    from megatron_zero.testing.tolerances import fp8_same_scale_rtol

    rtol = fp8_same_scale_rtol(moe_config(), GLOBAL_BATCH * moe_config().seq_length)
    losses, norms, _ = reference_run(dataclasses.replace(delayed_settings(), param_gather=True), 2, moe={})
    for good, broken in run_ranks(_runs, 2, timeout=600, recipe="delayed", stage=stage, ep=2, moe={},
                                  **({"persistence_threshold": 0} if stage == 3 else {})):
        _check(good, losses, norms, rtol)
        layers = good["fp8_gathered"]
        assert any(expert for expert, _ in layers.values()), layers
        assert all(gathered for _, gathered in layers.values()), layers
        with pytest.raises(AssertionError):
            _check(broken, losses, norms, rtol)


def test_ep2_moe_experts_gathered_in_fp8():
    _ep2_moe(1)


@pytest.mark.slow
def test_ep2_moe_experts_gathered_in_fp8_zero3():
    """The default-tier test_ep2_moe_experts_gathered_in_fp8 at ZeRO-3 (each unit's gather packs the experts'
    FP8 chunks)."""
    _ep2_moe(3)
