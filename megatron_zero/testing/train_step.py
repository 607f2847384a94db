"""One training step of a GPT pipeline stage the way training/trainer.py takes it, for parity tests: the 1F1B
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


def train_steps(model, optimizer, state, p2p, batch, steps: int, global_batch: int, step_kwargs=None):
    """`steps` pipeline_train_steps of the global batches batch(step) -> (tokens, labels), each [global_batch, s]:
    this DP rank's rows, one sample a micro-batch. step_kwargs(step): that step's optimizer arguments.
    -> (losses, gradient norms)."""
    per_rank = global_batch // state.dp_size
    mine = slice(state.dp_rank * per_rank, (state.dp_rank + 1) * per_rank)
    losses, norms = [], []
    for step in range(steps):
        tokens, labels = batch(step)
        micro = [{"tokens": tokens[mine][j:j + 1], "labels": labels[mine][j:j + 1]} for j in range(per_rank)]
        loss, norm = pipeline_train_step(model, optimizer, state, p2p, micro,
                                         **(step_kwargs(step) if step_kwargs else {}))
        losses.append(loss)
        norms.append(norm)
    return losses, norms
