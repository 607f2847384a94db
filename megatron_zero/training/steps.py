"""The training loop's named steps (Trainer.train in training/trainer.py strings them together): the start-up lines, one
step (through the re-run machine where it is on), the stop rules' stop, evaluation, the save policy (where the
global batch grows, --save-interval, --save-weights-interval, the local tier), a skipped batch, and the end of
the run. A mix-in of Trainer: each step reads the trainer's state and sections."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .. import checkpoint as ckpt
from ..config.compat import lr_increment
from ..config.model import transformer_impl_line
from .exit_signal import ExitPolicy, ctrl_c_line
from ..metrics.logger import format_eval_line
from ..ops import kernel_report
from ..reliability.rerun import ResultFault, TooManyRejected
from .stop_rules import RunStopped
from ..metrics.training_log import architecture_name


@dataclass
class TrainState:
    """Where the run is: what Megatron-LM's checkpoints record of the loop."""
    iteration: int = 0
    consumed_train_samples: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0


class LoopSteps:
    def _exit_policy(self) -> ExitPolicy:
        t, c = self.sections.training, self.sections.checkpoint
        return ExitPolicy(t.exit_signal_handler, t.exit_duration_in_mins, t.exit_interval, device=self.device,
                          ctrl_c=True, announce=ctrl_c_line(bool(c.save)) if self.is_writer else None)

    def _nothing_to_train(self, policy) -> int:
        """A resume of a finished run: said, the checkpoint left alone."""
        p, t = self.progress, self.sections.training
        limit = (f"--train-iters {t.train_iters}; raise --train-iters above {p.iteration}"
                 if t.train_samples is None else
                 f"--train-samples {t.train_samples} ({t.train_iters} iterations); raise --train-samples above "
                 f"{p.consumed_train_samples}")
        self._log(f"nothing to train: the checkpoint loaded from --load {self.sections.checkpoint.load} is at "
                  f"iteration {p.iteration}, at or past {limit} to train on")
        policy.restore()
        self.hooks.close()
        self.log.close()
        return 0

    def _announce(self):
        """What trains, on what, from where; the kernels; the model converters."""
        s, p, o = self.state, self.progress, self.sections.optimizer
        experts = "" if self.config.num_experts is None else (
            f" with {self.config.num_experts} experts per MoE layer" + (f" (EP={s.ep_size})" if s.ep_size > 1 else ""))
        self._log(f"training a {self.config.num_layers}-layer {architecture_name(self.config)} model{experts} on "
                  f"{s.layout}, "
                  f"ZeRO-{o.zero_stage}, {o.params_dtype}, from iteration {p.iteration}"
                  f" ({p.consumed_train_samples} samples consumed), "
                  f"{self.batch.num_micro_batches(p.consumed_train_samples)} micro-batches per step"
                  + (f" (global batch {self.batch.global_batch_size(p.consumed_train_samples)}, growing to "
                     f"{self.batch.final})" if self.batch.varies else ""))
        self._log(kernel_report())
        if self.sections.model.transformer_impl is not None:
            self._log(transformer_impl_line(self.sections.model))
        for line in self.transforms:
            self._log(line)

    def _save_where_the_batch_grows(self, gbs: int):
        """As Megatron-LM: a checkpoint where the number of micro-batches per step changes."""
        p = self.progress
        now = self.batch.num_micro_batches(p.consumed_train_samples)
        if now == self.micro_batches_before:
            return
        self.micro_batches_before = now
        self._log(f"the global batch grows to {gbs} ({now} micro-batches per step) at "
                  f"iteration {p.iteration} ({p.consumed_train_samples} samples consumed)")
        if self.sections.checkpoint.save and self.saved_at != p.iteration:
            self.hooks.before_eval_or_save()
            self.save()
            self.saved_at = p.iteration

    def _step(self, gbs: int, policy) -> Optional[tuple]:
        """One iteration's step, counted and logged: (updated, grad norm), or None when the re-run machine
        rejected it (its batch skipped)."""
        p, t = self.progress, self.sections.training
        self.hooks.before_step(p.iteration)
        last = p.iteration + 1 >= t.train_iters
        micro = self._micro_batches(self.train_ds, p.consumed_train_samples, gbs,
                                    None if last else self.batch.global_batch_size(p.consumed_train_samples + gbs))
        if self.rerun.enabled:  # checked, and re-run where a check fails (reliability/rerun.py)
            outcome = self._validated_step(p.iteration + 1, micro, policy)
            if outcome.rejected:
                self._skip_batch(p, gbs, self.rerun.rejection_line(p.iteration + 1, gbs, outcome.rejected))
                self.hooks.after_step(p.iteration)
                return None
            loss, lr, updated, grad_norm = outcome.result
        else:
            loss, lr, updated, grad_norm = self.train_step(micro, policy.votes)
        p.iteration += 1
        p.consumed_train_samples += gbs
        if updated:  # as Megatron-LM (and DeepSpeed): a skipped step does not advance the schedule
            # 1, or this step's samples / tokens
            self.lr_schedule.step(lr_increment(self.sections.compat.lr_schedule_unit, gbs, self.sections.model.seq_length))
        else:
            p.skipped_iterations += 1
        self.hooks.after_step(p.iteration)
        self.log.iteration(p, gbs, loss, lr, grad_norm, self.optimizer.loss_scale, updated,
                           self.optimizer.params_norm, self.decoupled_lr)
        if self.moe_metrics is not None:
            self._log_moe(p, len(micro))
        if self.mtp_metrics is not None:  # the stage holding the MTP layers: each depth's loss
            self.mtp_metrics.after_iteration(self.model.mtp, len(micro), p, self.log.scalars, self._log)
        if self.qk_clip is not None and (p.iteration % self.sections.log.log_interval == 0 or p.iteration == t.train_iters):
            self._log_max_attention_logit(p)
        return updated, grad_norm

    def _saves_due(self) -> tuple:
        """(a full save, a weights-only save) due after this iteration (--save-interval, --save-weights-interval)."""
        p, c = self.progress, self.sections.checkpoint
        full = bool(c.save and c.save_interval and p.iteration % c.save_interval == 0)
        every = self.sections.compat.save_weights_interval
        weights = bool(not full and c.save and every and p.iteration % every == 0)
        return full, weights

    def _save_if_due(self, full: bool, weights: bool):
        p = self.progress
        if full or weights:
            self.hooks.before_eval_or_save()
            self.save(weights_only=weights)
            if full:
                self.saved_at = p.iteration
        self.local_tier.after_step(self, p.iteration, persistent_saved=full)

    def _evaluate_if_due(self, summary):
        p, t = self.progress, self.sections.training
        if not (t.eval_iters and self.valid_ds is not None and p.iteration % t.eval_interval == 0):
            return
        self.hooks.before_eval_or_save()
        val = self.evaluate()
        self.log.scalars.scalar("lm loss validation", val, p.iteration, p.consumed_train_samples)
        self.log.scalars.scalar("lm loss validation ppl", math.exp(min(20.0, val)), p.iteration,
                                p.consumed_train_samples)
        self._log(format_eval_line(p.iteration, val))
        summary.validated(p.iteration, val)

    def _finish(self, rules, summary, policy) -> int:
        """The losses since the last log line, the stop rules on them, the last save, the summary line."""
        p, c = self.progress, self.sections.checkpoint
        self.log.flush(p)
        stop = rules.after_losses(p.iteration, self.log.first_nonfinite_loss)
        if stop:  # (after a signal or --exit-interval) not saved on the way out
            self._stop_learning(p.iteration, stop, policy)
        if c.save and self.saved_at != p.iteration:
            self.save()
        ckpt.finalize_async_saves()
        self._log(summary.line(p, self.log.last_loss, self.last_checkpoint))
        if self.rerun.summary():
            self._log(self.rerun.summary())
        policy.restore()
        self.hooks.close()
        self.prefetch.close()
        self.log.close()
        return 0

    def _validated_step(self, iteration: int, micro, policy):
        """The step through the re-run machine; a fault that stops the run saves nothing more."""
        try:
            return self.rerun.run_step(iteration, lambda riders, gate: self.train_step(micro, policy.votes, riders,
                                                                                        gate))
        except (ResultFault, TooManyRejected):
            ckpt.finalize_async_saves()  # taken before the fault: committed
            policy.restore()
            self.log.close()
            raise

    def _skip_batch(self, p: TrainState, gbs: int, line: str, kind: Optional[str] = None):
        """An iteration not trained on: counted, its global batch consumed, the schedule not stepped (as
        Megatron-LM's --iterations-to-skip)."""
        p.iteration += 1
        p.consumed_train_samples += gbs
        if kind:
            self.rerun.counts[kind] += 1
        self._log(line)

    def _stop_learning(self, iteration: int, why: str, policy):
        """Stop a run that has stopped learning, saving nothing more: an async save in flight was taken
        before any rule fired (stop_rules.py), so it is committed and named."""
        ckpt.finalize_async_saves()
        policy.restore()
        self.log.close()
        last = (f"the last checkpoint is {self.last_checkpoint}" if self.last_checkpoint else
                "no checkpoint was saved or loaded before it")
        raise RunStopped(f"training stopped after iteration {iteration} because it has stopped learning: {why}; "
                         f"{last}, and nothing after it was saved")

    def _log_moe(self, p: TrainState, num_micro_batches: int):
        """The MoE losses: added up each iteration, reported (a collective) at each log line."""
        s, log_interval = self.state, self.sections.log.log_interval
        self.moe_metrics.iteration(num_micro_batches)
        if p.iteration % log_interval != 0 and p.iteration != self.sections.training.train_iters:
            return
        sp_group = s.tp_group if self.sections.parallel.sequence_parallel and s.tp_size > 1 else None  # each TP rank's tokens' share
        values = self.moe_metrics.report(s.pp_group, s.dp_group, s.data_parallel_size, sp_group)
        for name, value in values.items():
            self.log.scalars.scalar(name, value, p.iteration, p.consumed_train_samples)
        self._log(f" iteration {p.iteration:8d} | " + " | ".join(f"{k}: {v:.6E}" for k, v in values.items()) + " |")

    def _log_max_attention_logit(self, p: TrainState):
        """--log-max-attention-logit (on with --qk-clip): the last step's max over the model (a collective)."""
        value = self.qk_clip.report(self.state.mp_group)
        self.log.scalars.scalar("max-attention-logit", value, p.iteration, p.consumed_train_samples)
        self._log(f" iteration {p.iteration:8d} | max attention logit: {value:.6E} |")

