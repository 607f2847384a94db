#!/usr/bin/env bash
# A small Llama-style model (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied output layer,
# no linear biases) on the built-in corpus, on 4 CPU ranks as TP2 x PP2 with ZeRO-1.
# The architecture flags are Megatron-LM's; Megatron-DeepSpeed's spellings work too
# (--normalization rmsnorm, --use-rotary-position-embeddings, --num-key-value-heads 2).
#   bash examples/pretrain_llama.sh [more pretrain_gpt.py flags]
# Everything lands under runs/llama/ (override with OUT_DIR); NPROC=4 ranks by default.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh
out=${OUT_DIR:-runs/llama}
mkdir -p "$out"
export OMP_NUM_THREADS=1
[ -f "$out/corpus/pydoc_text_document.idx" ] || .venv/bin/python tools/build_corpus.py --output-dir "$out/corpus" | tail -2

NPROC=${NPROC:-4} bash scripts/pretrain_local.sh \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --zero-stage 1 \
    --num-layers 4 --hidden-size 256 --ffn-hidden-size 688 --num-attention-heads 8 \
    --group-query-attention --num-query-groups 2 \
    --normalization RMSNorm --norm-epsilon 1e-6 \
    --position-embedding-type rope --rotary-base 10000 \
    --swiglu --untie-embeddings-and-output-weights --disable-bias-linear \
    --seq-length 256 --max-position-embeddings 256 \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --micro-batch-size 4 --global-batch-size 16 --train-iters 30 \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0 \
    --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234 \
    --data-path "$out/corpus/pydoc_text_document" --split 949,50,1 --data-cache-path "$out/cache" \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$out/corpus/tokenizer.model" \
    --log-interval 5 --eval-interval 10 --eval-iters 2 \
    --save "$out/checkpoints" --save-interval 30 "$@"
