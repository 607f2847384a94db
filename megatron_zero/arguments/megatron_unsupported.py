"""Megatron-LM pretraining flags (megatron/training/arguments.py at d98e8a64dd) this build does not have, each
refused with its reason: part of flag_refusals.py's one table (REFUSED), kept apart to keep that file short.

Not listed (and refused as unknown flags, naming docs/coming_from_megatron.md): Megatron-LM's inference, RL, SFT,
distillation, vision, BERT/T5/biencoder, Mamba and hybrid models, in-process restart, fault injection, one-logger
and Transformer Engine tuning flags, none of which a GPT pretraining script needs.
"""
from typing import Dict

_ACTIVATIONS = "the MLP's activation here is GeLU, or SwiGLU with --swiglu"
_FSDP = "fully sharded data parallelism is ZeRO-3 here (--zero-stage 3)"
_SPLIT = "an uneven pipeline split is given here as --pipeline-partition (transformer layers per stage, e.g. 3,5)"
_FP32_STATE = "the master weights, their gradients and Adam's moments are fp32 here"
_OFFLOAD = "the optimizer is offloaded whole with --cpu-optimizer (ZeRO-Offload); a fraction of it is not available"
_WEIGHT_DECAY = "weight decay is constant here (--weight-decay)"
_CHECKPOINT_ARGS = ("the model flags are given on the command line; the checkpoint's are compared with them and a "
                    "difference is refused naming it")
_DOCUMENTS = ("documents packed into one sample attend to each other and count positions across it here, as by "
              "Megatron-LM's default")
_SPLIT_DATA = "give --data-path with --split (one blend split into train, validation and test)"

UNSUPPORTED: Dict[str, str] = {
    # model
    "--openai-gelu": _ACTIVATIONS, "--squared-relu": _ACTIVATIONS, "--quick-geglu": _ACTIVATIONS,
    "--rotary-interleaved": "RoPE here rotates the two halves of each head (Megatron-LM's default), not interleaved pairs",
    "--use-rope-scaling": "Llama 3.1's RoPE frequency scaling is not available (RoPE takes --rotary-base, --rotary-percent)",
    "--rope-scaling-factor": "Llama 3.1's RoPE frequency scaling is not available (RoPE takes --rotary-base, --rotary-percent)",
    "--rotary-seq-len-interpolation-factor": "RoPE position interpolation is not available",
    "--window-size": "attention here is full causal attention; sliding windows are not available",
    "--fp32-residual-connection": "the residual stream is kept in the training dtype here",
    "--apply-residual-connection-post-layernorm": "each residual is taken before its norm here (pre-norm, Megatron's "
                                                  "default)",
    "--apply-query-key-layer-scaling": "attention scores are not scaled by the layer number here (the softmax is fp32)",
    "--init-method-xavier-uniform": "weights are initialised normal with --init-method-std (output layers scaled by "
                                    "the depth), as Megatron's default",
    "--embedding-init-method-std": "the embedding is initialised with --init-method-std, as the other weights",
    # parallelism
    "--decoder-first-pipeline-num-layers": _SPLIT, "--decoder-last-pipeline-num-layers": _SPLIT,
    "--pipeline-model-parallel-layout": _SPLIT, "--account-for-embedding-in-pipeline-split": _SPLIT,
    "--account-for-loss-in-pipeline-split": _SPLIT,
    "--num-virtual-stages-per-pipeline-rank": "give --num-layers-per-virtual-pipeline-stage (--num-layers / "
                                              "(pipeline size x this number))",
    "--use-torch-fsdp2": _FSDP, "--use-megatron-fsdp": _FSDP, "--data-parallel-sharding-strategy": _FSDP,
    "--num-distributed-optimizer-instances": "the optimizer is sharded over the whole data-parallel group here",
    "--overlap-param-gather-with-optimizer-step": "the parameter all-gather overlaps the next forward here "
                                                  "(--overlap-param-gather), not the optimizer step",
    "--tp-comm-overlap": "tensor-parallel communication overlap is Transformer Engine's userbuffers, not used here",
    "--use-tp-pp-dp-mapping": "ranks are ordered TP, CP, DP, PP here (Megatron-Core's default order)",
    "--model-parallel-size": "give --tensor-model-parallel-size (Megatron-LM removed this spelling too)",
    "--use-sharp": "NCCL's SHARP groups are not configured here (NCCL's own environment variables still apply)",
    "--nccl-communicator-config-path": "per-group NCCL communicator settings are not available (NCCL's environment "
                                       "variables apply to every group)",
    "--enable-cuda-graph": "CUDA graphs come from --compile-layers --compile-mode reduce-overhead here",
    "--cuda-graph-impl": "CUDA graphs come from --compile-layers --compile-mode reduce-overhead here",
    "--cpu-offloading-num-layers": "activations are not offloaded to the host here (recompute them: "
                                   "--recompute-granularity)",
    # precision and optimizer
    "--use-precision-aware-optimizer": _FP32_STATE, "--main-grads-dtype": _FP32_STATE,
    "--main-params-dtype": _FP32_STATE, "--exp-avg-dtype": _FP32_STATE, "--exp-avg-sq-dtype": _FP32_STATE,
    "--fp16-lm-cross-entropy": "the cross-entropy is computed in fp32 here",
    "--optimizer-cpu-offload": _OFFLOAD, "--optimizer-offload-fraction": _OFFLOAD,
    "--start-weight-decay": _WEIGHT_DECAY, "--end-weight-decay": _WEIGHT_DECAY, "--weight-decay-incr-style": _WEIGHT_DECAY,
    "--lr-warmup-init": "the warm-up starts from a learning rate of 0 here (Megatron-LM's default)",
    "--sgd-momentum": "SGD is not available (--optimizer adam, adamw, muon or dist_muon)",
    "--lion-beta1": "Lion is not available (--optimizer adam, adamw, muon or dist_muon)",
    "--lion-beta2": "Lion is not available (--optimizer adam, adamw, muon or dist_muon)",
    # data
    "--eod-mask-loss": "every token counts in the loss here (no loss mask): the end-of-document token is predicted "
                       "like the others",
    "--reset-position-ids": _DOCUMENTS, "--reset-attention-mask": _DOCUMENTS,
    "--train-data-path": _SPLIT_DATA, "--valid-data-path": _SPLIT_DATA, "--test-data-path": _SPLIT_DATA,
    "--data-args-path": "give --data-path (its weights and prefixes) on the command line",
    "--per-split-data-args-path": _SPLIT_DATA,
    "--fim-data": "fill-in-the-middle samples are not available",
    "--eval-micro-batch-size": "evaluation runs at --micro-batch-size and --global-batch-size here",
    "--eval-global-batch-size": "evaluation runs at --micro-batch-size and --global-batch-size here",
    # checkpoints and logging
    "--use-dist-ckpt": "saves are in DeepSpeed's layout here (tools/convert_checkpoint.py --to torch_dist converts "
                       "one); a torch_dist checkpoint loads with --load as it is",
    "--use-checkpoint-args": _CHECKPOINT_ARGS, "--use-mp-args-from-checkpoint-args": _CHECKPOINT_ARGS,
    "--pretrained-checkpoint": "give --load with --finetune (the weights, a fresh optimizer at iteration 0)",
    "--non-persistent-global-ckpt-dir": "the non-persistent tier is node-local here (--non-persistent-ckpt-type "
                                        "local, --non-persistent-local-ckpt-dir)",
    "--log-num-zeros-in-grad": "the zeros in the gradient are not counted here",
}
