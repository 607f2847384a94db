"""One training step of a GPT pipeline stage the way training.py takes it, for parity tests: the 1F1B
schedule (interleaved for a stage of several model chunks) over the given micro-batches, the
tied-embedding sum, the ZeRO step, the loss from the last stage."""
from ..pipeline.gpt_stage import grad_reduce_arming, make_forward_step, sync_tied_embedding_grads
from ..pipeline.interleaved_schedule import schedule_for
from ..pipeline.schedule import broadcast_loss


def pipeline_train_step(model, optimizer, state, p2p, micro, **step_kwargs):
    """-> (loss on every rank, the step's global gradient norm); the step must not be skipped. `step_kwargs`
    go to the optimizer's step (lr=, decoupled_lr=)."""
    out = schedule_for(len(model.chunks))(make_forward_step(model, micro, state), len(micro), p2p, state.pp_rank,
                                          state.pp_size, backward_loss=optimizer.backward,
                                          before_last_backward=grad_reduce_arming(model, optimizer))
    sync_tied_embedding_grads(model, state)
    updated, norm = optimizer.step(**step_kwargs)
    assert updated
    loss = broadcast_loss(out, state.is_last_stage, state.layout.pp_group(state.rank)[-1], state.pp_group,
                          state.dp_group)
    return loss, norm
