"""ZeRO-3's gathered storage (zero/stage3_storage.py): the parameters of one gather share one storage, each a
16-byte aligned view, in the unit's order; a tensor saved for backward over several of them (grouped GEMM's
stacked view of the experts) is kept as a reference and rebuilt from the re-gathered parameters, as a view where
they are laid out as before, else as a copy; a storage is freed once its parameters are released, also when only
some of them are (the others move out)."""
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_zero.model.gpt import reference_model
from megatron_zero.moe.stacked_weights import expert_stride, stacked
from megatron_zero.testing.moe_train import moe_config
from megatron_zero.zero import ZeroOptimizer


def _moe_unit():
    """(stage, the unit index of the first MoE layer, its fc1 expert weights); the weights gathered per unit."""
    model = reference_model(moe_config())
    stage = ZeroOptimizer(list(model.named_parameters()), stage=3, module=model, persistence_threshold=0).impl
    layer = model._modules["2"]
    ui = next(i for i, u in enumerate(stage.units) if u is layer)
    fc1 = [e.dense_h_to_4h.weight for e in layer.mlp.deepspeed_moe.experts.deepspeed_experts.values()]
    return stage, ui, fc1


def test_a_unit_is_gathered_into_one_storage_with_its_experts_equally_spaced():
    stage, ui, fc1 = _moe_unit()
    stage.gather_unit(ui)
    params = stage.unit_params[ui]
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    assert all(p.data_ptr() % 16 == 0 for p in params)
    assert expert_stride(fc1) is not None
    stage.release_unit(ui)
    assert all(p.numel() == 0 for p in params)
    stage.remove_hooks()


def test_a_saved_stacked_view_is_rebuilt_from_the_regathered_experts():
    """Saved under the stage's hooks, released, then backward: the gradient through the saved [E, out, in] view
    is the weights' values, whether the experts come back in the same layout (a view) or not (a copy)."""
    stage, ui, fc1 = _moe_unit()
    for first_alone in (False, True):
        stage.gather_unit(ui)
        want = torch.stack([w.detach().clone() for w in fc1])
        c = torch.ones_like(want, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(stage._pack, stage._unpack):
            loss = (stacked(fc1) * c).sum()  # mul saves the view for c's gradient
        stage.release_unit(ui)
        assert all(w.numel() == 0 for w in fc1)
        if first_alone:  # the first expert comes back on its own: another layout, so the view is copied
            stage._gather(fc1[:1])
        (grad,) = torch.autograd.grad(loss, [c])
        assert torch.equal(grad, want)
        stage._drain()
    stage.remove_hooks()


def test_a_partial_release_frees_the_released_parameters_memory():
    """One parameter of a gathered unit still held elsewhere (gathered_params) when the unit is released: it moves
    to a storage of its own with its values, and the unit's storage is freed."""
    stage, ui, fc1 = _moe_unit()
    stage.gather_unit(ui)
    kept = fc1[1]
    value = kept.detach().clone()
    flight = StorageWeakRef(kept.untyped_storage())
    with stage.gathered_params([kept]):
        stage.release_unit(ui)
        assert flight.expired()
        assert torch.equal(kept.detach(), value)
        assert [p for p in stage.unit_params[ui] if p.numel()] == [kept]
    assert kept.numel() == 0 and not stage._storage
    stage.remove_hooks()
