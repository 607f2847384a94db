"""The training loop: arguments -> topology -> model stage and ZeRO optimizer -> data -> steps -> checkpoints.

`pretrain(argv)` is what pretrain_gpt.py runs on every rank. One iteration
trains on one global batch: each DP rank takes its slice, the pipeline schedule
runs its micro-batches (gradient accumulation), the tied embedding's gradients
are summed over the first and last stage, and the ZeRO optimizer steps.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict
from typing import Optional

import torch
import torch.distributed as dist

from .. import checkpoint as ckpt
from .. import config
from ..arguments import ArgumentError
from ..config.checkpointing import load_is_first_run
from ..checkpoint.compat import check_checkpoint_compat
from ..checkpoint.format import header_args
from ..checkpoint.storage.lock import hold_save_lock
from ..checkpoint.preflight import check_save_dir, checkpoint_bytes
from ..checkpoint.report import async_started_line, checkpoint_size, saved_line
from ..checkpoint.resume import refuse_foreign_load, refuse_fresh_start_over, resume_checkpoint
from ..checkpoint.export.save_16bit import save_16bit_model
from ..context_parallel import slice_batch_for_cp
from ..data import DataError, GlobalBatchSampler, build_tokenizer, build_train_valid_test_datasets, collate_gpt
from ..distributed.device import DeviceError, backend_for, select_device, to_device, use_device
from ..distributed.initialize import (LaunchError, another_rank_failed, init_distributed, is_peer_failure, lost_contact_line,
                          read_launch_env, record_peer_loss, report_failure, shutdown_distributed, stop_with_launcher)
from ..elastic.local_tier import LocalTier, resume_dir
from ..elastic.restart import note_resize, parse_for_launch
from ..elastic.straggler import straggler_report
from ..elastic.watchdog import watch_steps
from .exit_signal import INTERRUPTED, report_interrupt
from ..metrics.throughput import model_flops_per_iteration
from .schedule_resume import resume_schedule
from ..optimizer.lr_schedule import build_lr_schedule, decoupled_lr
from ..model.architecture import gpt_config
from ..model_converters import model_converters
from ..ops import require_fused_kernels, set_fusion_flags
from ..pipeline.gpt_stage import (activation_shape, build_gpt_stage, grad_reduce_arming, make_forward_step,
                                 stage_p2p, sync_tied_embedding_grads)
from ..pipeline.interleaved_schedule import schedule_for
from ..planning.cli import plan_from
from ..planning.startup import check_device_memory
from ..reliability.rerun import ResultFault, RerunMachine, TooManyRejected, hostnames
from ..pipeline.schedule import broadcast_loss, reduce_loss
from ..tensor_parallel.rng_state import get_rng_state, set_rng_state
from ..metrics.run_summary import RunSummary
from ..distributed.shm_comm import set_shared_memory_comm
from .stop_rules import RunStopped, StopRules
from .step_hooks import StepHooks
from ..data.prefetch import BatchPrefetcher
from ..tensor_parallel.random import model_parallel_seed
from ..metrics.timers import TimedCalls
from ..optimizer.muon import optimizer_switch
from ..optimizer.qk_clip import QKClip
from ..zero.build import build_optimizer, param_groups  # noqa: F401 (param_groups: training's name for it)
from ..distributed.topology import build_parallel_state
from ..metrics.training_log import TrainingLog
from .steps import LoopSteps, TrainState
from ..moe import reset_aux_losses, set_aux_loss_scale
from ..moe.expert_bias import ExpertBiasUpdate
from ..moe.metrics import MoEMetrics, logged_names
from ..model.mtp_metrics import MTPMetrics

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fusion_flags(sections: config.Config) -> dict:
    """Megatron's --no-*-fusion flags as megatron_zero.ops switches (the loss's is a model converter's)."""
    run = sections.runtime
    return dict(masked_softmax_fusion=run.masked_softmax_fusion, bias_gelu_fusion=run.bias_gelu_fusion,
                persist_layer_norm=run.persist_layer_norm, rope_fusion=run.rope_fusion,
                gradient_accumulation_fusion=run.gradient_accumulation_fusion)


class Trainer(LoopSteps):
    def __init__(self, cfg: config.Config, state, device: Optional[torch.device] = None):
        """`cfg`: the checked configuration (config.from_args(parse_args(...))), each part handed the section it
        reads; `state`: the rank's ParallelState; `device`: where this rank trains (None: from --device and
        LOCAL_RANK, select_device)."""
        self.sections, self.state = cfg, state
        par, run, data = self.sections.parallel, self.sections.runtime, self.sections.data
        self.device = device if device is not None else select_device(run.device, read_launch_env().local_rank)
        set_fusion_flags(**fusion_flags(self.sections))
        if run.require_fused_kernels:  # before anything is built: refuse in one sentence
            require_fused_kernels(self.device, offload=self.sections.optimizer.offload != "none")
        set_shared_memory_comm(run.shared_memory_all_reduce)
        model_parallel_seed(self.sections.training.seed, state.tp_rank, state.pp_rank, state.cp_rank)
        self.tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_file, data.merge_file,
                                         data.vocab_size, data.tiktoken_pattern, data.tiktoken_num_special_tokens,
                                         data.tokenizer_special_tokens)
        self.config = gpt_config(config.flat(cfg), self.tokenizer.vocab_size)
        if run.memory_plan_check:  # on a GPU: refuse a run whose predicted peak exceeds the device's memory
            check_device_memory(plan_from(self.sections, self.config, state.layout.world_size), self.device,
                                int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        self.model = build_gpt_stage(self.config, state, par.pipeline_partition_method, par.pipeline_partition,
                                     device=self.device, virtual_stages=par.virtual_pipeline_model_parallel_size)
        self.converters = model_converters(self.sections, state, self.device)  # FP8, the output loss, compile
        self.transforms = self.converters.convert(self.model)  # their log lines
        self.forward_backward = schedule_for(par.virtual_pipeline_model_parallel_size)
        self.optimizer = build_optimizer(self.model, self.sections.optimizer, state, self.device, self.sections.muon,
                                         self.converters)
        m = self.sections.muon  # QK-clip, or the max attention logit logged (optimizer/qk_clip.py)
        self.qk_clip = (QKClip(self.model, self.optimizer, state.dp_group, m.qk_clip, m.qk_clip_alpha,
                               m.qk_clip_threshold) if m.log_max_attention_logit else None)
        moe_layers = self.config.num_moe_layers()
        logged = logged_names(self.config)  # the MoE losses the flags compute (none: no MoE log line)
        self.moe_metrics = MoEMetrics(moe_layers, self.device, logged) if moe_layers and logged else None
        self.expert_bias = ExpertBiasUpdate.of_run(self.model, self.config, state)  # (moe/expert_bias.py)
        self.mtp_metrics = MTPMetrics.of(self.model, state, cfg.log.log_interval,
                                        cfg.training.train_iters, self.device)  # None: no MTP layers on this stage
        self.lr_schedule = build_lr_schedule(self.sections)
        self.batch = par.batch_schedule  # the global batch of each iteration, from the samples consumed
        self.progress = TrainState()
        self.p2p = stage_p2p(state, activation_shape(par.micro_batch_size, self.config, state.tp_size, state.cp_size),
                             DTYPES[self.sections.optimizer.params_dtype], self.device,
                             par.virtual_pipeline_model_parallel_size)
        writer_rank = state.layout.rank(state.pp_size - 1, 0, 0)
        self.is_writer = state.rank == writer_rank
        flops = model_flops_per_iteration(self.config, par.global_batch_size, state.tp_size)
        self.log = TrainingLog(cfg, state.layout.world_size, flops, next(self.model.parameters()).device,
                               self.is_writer, self._log)
        self.train_p2p = TimedCalls(self.p2p, self.log.timers("pipeline-p2p", 2))
        self.log.straggler = straggler_report(cfg.elastic, state, self.device)  # --log-straggler
        self.last_checkpoint = None  # the newest checkpoint loaded or saved: what a stopped run names
        self.hooks = StepHooks(cfg.compat, cfg.log.tensorboard_dir, self.device, state.rank,
                               self.optimizer.wait_params)  # --manual-gc, --profile, ...
        self.local_tier = LocalTier(cfg.elastic, cfg.checkpoint.async_save, state,
                                    state.layout.world_size)  # --non-persistent-save-interval
        rerun = cfg.rerun  # --rerun-mode, --iterations-to-skip, ...
        self.rerun = RerunMachine(rerun, self.sections.training.check_for_nan_in_loss_and_grad,
                                  self.optimizer.loss_scaler.dynamic, self.sections.training.seed, state.rank,
                                  state.layout.world_size, self.device,
                                  hostnames(state.layout.world_size) if rerun.rerun_mode != "disabled" else [])
        where = resume_dir(cfg.elastic, cfg.checkpoint.load, self._log)  # --load, or the local tier's newer copy
        resumed = bool(where) and self.load(where)
        if self.sections.checkpoint.save:
            if not resumed and not self.sections.checkpoint.overwrite_checkpoints:
                refuse_fresh_start_over(self.sections.checkpoint.save)
            self._check_save_dir()
        self._build_data()

    # ---- data ------------------------------------------------------------------------
    def _build_data(self):
        t, d, compat = self.sections.training, self.sections.data, self.sections.compat
        gbs = self.sections.parallel.global_batch_size
        evals = (t.train_iters // t.eval_interval + 1) * t.eval_iters
        sizes = [t.train_iters * gbs, evals * gbs if t.eval_iters else 0, t.eval_iters * gbs]
        self.train_ds, self.valid_ds, _ = build_train_valid_test_datasets(
            d.data_path, d.split, self.sections.model.seq_length, t.seed, sizes, cache_dir=d.data_cache_path,
            vocab_size=self.tokenizer.vocab_size, mock=compat.mock_data, mmap_bin=compat.mmap_bin_files)
        # reader threads touch numpy only (torch in a side thread crashes under torch.profiler on the CPU)
        self.prefetch = BatchPrefetcher(lambda idx: [self.train_ds[i] for i in idx], compat.num_workers)

    def _micro_batches(self, dataset, start: int, gbs: Optional[int] = None, next_gbs: Optional[int] = None):
        """This rank's collated micro-batches of the global batch of `gbs` samples (default: the schedule's at
        `start`) starting at sample `start`: its data replica's samples (training batches through --num-workers'
        read-ahead of the next global batch, of `next_gbs` samples; None: none is read ahead), cut to its
        context-parallel chunks of each sequence."""
        s, mbs = self.state, self.sections.parallel.micro_batch_size
        gbs = self.batch.global_batch_size(start) if gbs is None else gbs
        if not (s.is_first_stage or s.is_last_stage):
            return [{}] * (gbs // (mbs * self.batch.data_parallel_size))  # they take activations
        sampler = GlobalBatchSampler(start + gbs + (next_gbs or 0), start, mbs, gbs,
                                     s.data_parallel_rank, s.data_parallel_size, batch_size_at=self.batch.global_batch_size
                                     if dataset is self.train_ds else None)
        if dataset is self.train_ds:
            samples = self.prefetch.get(sampler.global_batch(start),
                                        sampler.global_batch(start + gbs) if next_gbs else None)
        else:
            samples = [[dataset[i] for i in idx] for idx in sampler.global_batch(start)]
        return [to_device(slice_batch_for_cp(collate_gpt(micro), s.cp_size, s.cp_rank), self.device)
                for micro in samples]

    # ---- one iteration ---------------------------------------------------------------
    def train_step(self, micro, votes=tuple, riders=None, gate=None):
        """One global batch -> (mean loss as a device tensor, lr, updated, grad norm). `votes()`, taken just
        before the optimizer step (ExitPolicy.votes: a signal received during this iteration's forward and
        backward counts), rides in the step's norm all-reduce; the sums are left in optimizer.summed_votes.
        `riders(loss)` and `gate` (reliability/rerun.py): the loss is reduced before the optimizer step, and
        the riders it gives are checked by the gate before the update."""
        s, timers = self.state, self.log.timers
        self.model.train()
        # the MoE losses weigh as the LM loss does (a CP rank's share of a sequence's, times CP as its LM loss)
        set_aux_loss_scale(self.optimizer.loss_scale * s.cp_size / len(micro))
        with timers("forward-backward", 1):
            step = timers.timed(make_forward_step(self.model, micro, s), "forward-compute", 2)
            step = self.log.straggler.timed(step) if self.log.straggler else step  # --log-straggler
            losses = self.forward_backward(step, len(micro), self.train_p2p, s.pp_rank, s.pp_size,
                                           backward_loss=self.optimizer.backward,
                                           before_last_backward=grad_reduce_arming(self.model, self.optimizer))
        self.hooks.after_forward_backward()
        with timers("embedding-grads-all-reduce", 2):
            sync_tied_embedding_grads(self.model, s, torch.bfloat16 if self.sections.optimizer.grad_reduce_in_bf16 else None)
        lr = self.lr_schedule.lr()
        self.decoupled_lr = decoupled_lr(self.lr_schedule, self.sections.optimizer)
        if gate is not None:
            with timers("loss-broadcast", 2):
                loss = reduce_loss(losses, s.is_last_stage, s.layout.pp_group(s.rank)[-1], s.pp_group, s.dp_group,
                                   self.device)
        with timers("optimizer", 1):
            updated, grad_norm = self.optimizer.step(lr=lr, decoupled_lr=self.decoupled_lr, votes=votes(),
                                                     riders=None if gate is None else riders(loss), gate=gate)
        self.expert_bias.step()  # after every step, a skipped one too (Megatron-Core's finalize_model_grads)
        self.converters.post_optimizer_hook(self.model)  # after every step too (model/converters.py)
        if gate is None:
            with timers("loss-broadcast", 2):
                loss = reduce_loss(losses, s.is_last_stage, s.layout.pp_group(s.rank)[-1], s.pp_group, s.dp_group,
                                   self.device)
        return loss, lr, updated, grad_norm

    @torch.no_grad()
    def evaluate(self):
        s, batches, gbs = self.state, self.sections.training.eval_iters, self.sections.parallel.global_batch_size
        self.model.eval()
        reset_aux_losses()
        total = 0.0
        for k in range(batches):
            micro = self._micro_batches(self.valid_ds, k * gbs, gbs)
            losses = self.forward_backward(make_forward_step(self.model, micro, s), len(micro), self.p2p,
                                           s.pp_rank, s.pp_size, forward_only=True)
            total += broadcast_loss(losses, s.is_last_stage, s.layout.pp_group(s.rank)[-1], s.pp_group,
                                    s.dp_group, self.device)
        reset_aux_losses()  # evaluation's MoE losses are not the training log's
        return total / max(1, batches)

    # ---- checkpoints -----------------------------------------------------------------
    def client_state(self, weights_only: bool = False) -> dict:
        return {"args": config.saved_args(self.sections), "iteration": self.progress.iteration,
                "train_state": asdict(self.progress), "lr_scheduler": self.lr_schedule.state_dict(),
                "rng_state": None if self.sections.compat.no_save_rng else get_rng_state(),
                "consumed_train_samples": self.progress.consumed_train_samples,
                **({"weights_only": True} if weights_only else {})}

    def save(self, weights_only: bool = False):
        """A checkpoint under --save; weights only (--no-save-optim) there, or under <save>/weights_only for
        --save-weights-interval's light saves (their own `latest`, so --load <save> resumes the full ones)."""
        c, no_save_optim = self.sections.checkpoint, self.sections.compat.no_save_optim
        self.log.flush(self.progress)  # the saved nan count includes every iteration run
        start = time.monotonic()
        save_dir = os.path.join(c.save, "weights_only") if weights_only and not no_save_optim else c.save
        tag = ckpt.save_checkpoint(save_dir, self.progress.iteration, self.state, self.model, self.optimizer,
                                   self.client_state(weights_only or no_save_optim), async_save=c.async_save,
                                   keep_last_k=c.keep_last_k, megatron_deepspeed=c.save_megatron_deepspeed_layout,
                                   converters=self.converters)
        seconds, directory = time.monotonic() - start, os.path.join(save_dir, tag)
        self.last_checkpoint = directory
        if self.is_writer:  # a synchronous save is committed on return: its manifest lists every file
            light = weights_only or no_save_optim
            self._log(async_started_line(directory, seconds, light) if c.async_save else
                      saved_line(directory, seconds, checkpoint_size(directory), light))
        if c.save_16bit_model:  # from the committed files, so an async save is waited for first
            ckpt.finalize_async_saves()
            dtype = self.sections.optimizer.params_dtype
            save_16bit_model(os.path.join(c.save, tag), torch.bfloat16 if dtype == "fp32" else DTYPES[dtype])

    def _check_save_dir(self):
        """--save writable and with room for a checkpoint, before the first iteration (rank 0 checks)."""
        c, s = self.sections.checkpoint, self.state
        local = sum(math.prod(getattr(p, "ds_shape", p.shape)) for p in self.model.parameters())
        counts = [local] if s.layout.world_size == 1 else [None] * s.layout.world_size
        if s.layout.world_size > 1:
            dist.all_gather_object(counts, local)
        one = checkpoint_bytes(sum(counts) // s.dp_size, DTYPES[self.sections.optimizer.params_dtype].itemsize)
        ahead = max(0, self.sections.training.train_iters - self.progress.iteration)
        planned = 1 + (ahead // c.save_interval if c.save_interval else 0)
        planned += len(self.batch.reached(ahead, self.progress.consumed_train_samples)) - 1  # saves where it grows
        outcome = [None]
        if s.rank == 0:
            try:
                check_save_dir(c.save, one, planned, c.keep_last_k)
            except ckpt.CheckpointError as e:
                outcome = [str(e)]
        if s.layout.world_size > 1:
            dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            raise ckpt.CheckpointError(outcome[0])

    def load(self, path) -> bool:
        """Resume from --load; False when it holds no checkpoint (a fresh start)."""
        c = self.sections.checkpoint
        if load_is_first_run(c):
            self._log(f"--load {path} does not exist yet; starting from scratch")
            return False

        switch = []  # the line saying the checkpoint's optimizer is another family (Adam / Muon), if it is

        def check(checkpoint):  # opened, or a Megatron-LM checkpoint's directory
            head = check_checkpoint_compat(checkpoint, config.flat(self.sections), self.config.vocab_size,
                                           self.config.padded_vocab_size, c.verify_checkpoint)
            self.last_checkpoint = getattr(checkpoint, "directory", checkpoint)
            switch[:] = [optimizer_switch(header_args(head), self.sections.muon.optimizer, self.last_checkpoint)]

        client = resume_checkpoint(path, self.state, self.model, self.optimizer,
                                   load_optimizer=not (c.no_load_optim or c.finetune),
                                   universal=c.universal_checkpoint, verify=c.verify_checkpoint, log=self._log,
                                   check=check, ckpt_format=c.ckpt_format, keep_optimizer=lambda: not any(switch),
                                   step=c.ckpt_step, converters=self.converters)
        if any(switch):
            self._log(switch[0])
        if client is None:
            refuse_foreign_load(path)
            self._log(f"no checkpoint under --load {path}; starting from scratch")
            return False
        if c.finetune or client.get("weights_only"):  # weights only (an import): fresh optimizer, iteration 0
            if client.get("weights_only"):
                self._log(f"--load {path} holds weights only: training starts from them at iteration 0 with a "
                          "fresh optimizer (as --finetune)")
            return True
        self.progress = TrainState(**client["train_state"])
        note_resize(client, self.sections.parallel, self._log)  # a restart at another world size: the micro-batches a step
        # --no-load-optim: the flags' schedule unchecked, as Megatron-LM, which then reads no scheduler state
        resume_schedule(self.lr_schedule, client["lr_scheduler"], c.override_opt_param_scheduler or c.no_load_optim,
                        c.use_checkpoint_opt_param_scheduler)
        if not c.no_load_rng and client.get("rng_state") is not None:
            set_rng_state(client["rng_state"])
        return True

    # ---- the loop --------------------------------------------------------------------
    def train(self) -> int:
        """The loop, as named steps (training/steps.py): each iteration maybe saves where the batch grows, skips a
        batch it is told to, steps, checks the run still learns, evaluates, saves and asks whether to exit."""
        p, t = self.progress, self.sections.training
        policy = self._exit_policy()
        if p.iteration >= t.train_iters:  # a resume of a finished run: say so, and leave the checkpoint alone
            return self._nothing_to_train(policy)
        self._announce()
        self.log.start()
        summary = RunSummary(p, self.sections.model.seq_length, self.log.flops / self.sections.parallel.global_batch_size,
                             self.state.layout.world_size, self.log.peak)
        rules = StopRules(t.max_consecutive_skipped_iterations, t.check_for_nan_in_loss_and_grad,
                          self.optimizer.loss_scaler.dynamic)
        self.saved_at, self.micro_batches_before = None, self.batch.num_micro_batches(p.consumed_train_samples)
        while p.iteration < t.train_iters:
            gbs = self.batch.global_batch_size(p.consumed_train_samples)
            self._save_where_the_batch_grows(gbs)
            if self.rerun.skips(p.iteration + 1):  # --iterations-to-skip, and the tracker file's
                self._skip_batch(p, gbs, f"iteration {p.iteration + 1} skipped as asked (--iterations-to-skip or the "
                                         "--result-rejected-tracker-filename): its global "
                                         f"batch of {gbs} samples consumed, not trained on", "skipped")
                continue
            stepped = self._step(gbs, policy)
            if stepped is None:  # rejected by the re-run machine: its batch skipped
                continue
            saves = self._saves_due()
            if any(saves):
                self.log.flush(p)  # the losses up to here, read before anything is saved of this state
            stop = rules.after_step(p.iteration, *stepped) or rules.after_losses(p.iteration,
                                                                                 self.log.first_nonfinite_loss)
            if stop:
                self._stop_learning(p.iteration, stop, policy)
            self._evaluate_if_due(summary)
            self._save_if_due(*saves)
            reason = policy.should_exit(p.iteration, self.optimizer.summed_votes)
            if reason:
                self._log(f"exiting after iteration {p.iteration}: {reason}")
                break
        return self._finish(rules, summary, policy)

    def _log(self, line: str):
        if self.is_writer:
            print(line, flush=True)


def pretrain(argv=None, args=None) -> int:
    """Train as the flags say (`args`: them checked, as pretrain_gpt.py does before it imports torch). Exit code 0
    when done (or stopped by a signal or Ctrl-C, saved); 2 on bad input, or a run that stopped learning
    (stop_rules.py): one sentence from the rank that found it, the other ranks quiet (also 2); 1 when a rank lost
    contact with another that said nothing; 130 when stopped at once by Ctrl-C; 17 when a rank computes wrong
    results reproducibly (--rerun-mode validate_results: reliability/rerun.py)."""
    lock = trainer = state = None
    try:
        launch = read_launch_env()
        if launch.source != "single":
            stop_with_launcher()
        cfg = config.from_args(parse_for_launch(argv, launch.rank, launch.world_size) if args is None else args)
        run = cfg.runtime
        device = select_device(run.device, launch.local_rank)
        backend = backend_for(device, run.distributed_backend)
        use_device(device)
        init_distributed(backend, run.distributed_timeout_minutes, device=device)
        lock = hold_save_lock(cfg.checkpoint.save) if cfg.checkpoint.save else None
        state = build_parallel_state(**cfg.parallel.degrees())
        trainer = Trainer(cfg, state, device)
        watch_steps(trainer, run.distributed_timeout_minutes, launch.world_size)  # a wait past its timeout ends
        code = trainer.train()
    except KeyboardInterrupt:  # Ctrl-C before training, or a second one during it (exit_signal.py)
        code = report_interrupt(getattr(trainer, "last_checkpoint", None))
    except (ArgumentError, LaunchError, DeviceError, DataError, ckpt.CheckpointError, RunStopped,
            TooManyRejected) as err:
        report_failure(str(err), lambda line: print(f"pretrain_gpt.py: error: {line}", file=sys.stderr, flush=True))
        code = 2
    except ResultFault as err:  # a rank computing wrong results: the job exits 17, the node to be excluded
        report_failure(str(err), lambda line: print(f"pretrain_gpt.py: error: {line}", file=sys.stderr, flush=True))
        code = ResultFault.exit_code
    except Exception as err:
        if not is_peer_failure(err):
            report_failure(f"{type(err).__name__}: {err}", lambda line: None)  # the traceback says it
            raise
        if another_rank_failed():
            code = 2  # that rank has said why
        else:
            lost = lost_contact_line(err)
            print(f"pretrain_gpt.py: error: {lost}", file=sys.stderr, flush=True)
            record_peer_loss(lost)  # the launcher names the rank that failed first, not this one
            code = 1
    finally:
        if lock is not None:
            lock.release()
        trainer = state = None  # their process groups are freed in shutdown_distributed
    if code == INTERRUPTED or code and dist.is_initialized() and dist.get_world_size() > 1:
        sys.stdout.flush()
        # peers may be gone: tearing the process group down would only wait on them; after Ctrl-C, at once (no
        # wait for a save's or the read-ahead's threads)
        os._exit(code)
    shutdown_distributed()
    return code
