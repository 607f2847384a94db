#!/usr/bin/env bash
# The main job (README, first command): set up .venv if needed, then
#   1. build the built-in corpus (Python's pydoc topics -> JSONL -> SentencePiece -> indexed dataset),
#   2. train a small GPT on 4 CPU ranks as TP2 x PP2 with ZeRO-1, stopping and checkpointing at iteration 30
#      of its 50 (one schedule for both runs: a resume checks it against the checkpoint's),
#   3. convert that checkpoint to a universal checkpoint (tools/ds_to_universal.py),
#   4. resume it on a different layout, TP1 x PP1 x DP4 with ZeRO-2, for 20 more iterations,
#   5. print the loss before and after the reshape, and a sample of generated text,
#   6. draw both runs' loss on one plot, the resume marked (runs/demo/loss.png; its set-up installs matplotlib).
# Everything lands under runs/demo/ (override with DEMO_DIR).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh --demo  # training's requirements and matplotlib, for the loss curve
py=.venv/bin/python
out=${DEMO_DIR:-runs/demo}
rm -rf "$out/checkpoints" "$out/tensorboard" "$out"/*.log
mkdir -p "$out"
export OMP_NUM_THREADS=1

echo "== 1. built-in corpus"
$py tools/build_corpus.py --output-dir "$out/corpus" | tail -4
common=(--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256
        --micro-batch-size 4 --global-batch-size 16 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine
        --lr-warmup-iters 5 --lr-decay-iters 50 --train-iters 50 --weight-decay 0.01 --clip-grad 1.0
        --hidden-dropout 0.0 --attention-dropout 0.0 --seed 1234
        --data-path "$out/corpus/pydoc_text_document" --split 949,50,1 --data-cache-path "$out/cache"
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$out/corpus/tokenizer.model"
        --log-interval 5 --eval-interval 10 --eval-iters 2)

echo "== 2. train the first 30 of 50 iterations on 4 ranks: TP=2 x PP=2 x DP=1, ZeRO-1"
NPROC=4 bash scripts/pretrain_local.sh "${common[@]}" --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 2 --zero-stage 1 --exit-interval 30 --save "$out/checkpoints" \
    --save-interval 30 --tensorboard-dir "$out/tensorboard/tp2_pp2" 2>&1 | tee "$out/train.log"

echo "== 3. convert global_step30 to a universal checkpoint"
$py tools/ds_to_universal.py --input_folder "$out/checkpoints/global_step30" \
    --output_folder "$out/checkpoints/global_step30_universal" --num_extract_workers 2 --num_merge_workers 2

echo "== 4. resume on 4 ranks: TP=1 x PP=1 x DP=4, ZeRO-2, 20 more iterations"
NPROC=4 bash scripts/pretrain_local.sh "${common[@]}" --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 1 --zero-stage 2 --load "$out/checkpoints" \
    --universal-checkpoint --save "$out/checkpoints" --tensorboard-dir "$out/tensorboard/tp1_dp4" 2>&1 |
    tee "$out/resume.log"

echo "== 5. the loss across the reshape"
before=$(grep -o "iteration *30/.*lm loss: [0-9.E+-]*" "$out/train.log" | grep -o "lm loss: .*" || true)
after=$(grep -o "iteration *35/.*lm loss: [0-9.E+-]*" "$out/resume.log" | grep -o "lm loss: .*" || true)
first=$(grep -o "iteration *5/.*lm loss: [0-9.E+-]*" "$out/train.log" | grep -o "lm loss: .*" || true)
echo "iteration  5 (TP2 x PP2):        $first"
echo "iteration 30 (TP2 x PP2):        $before"
echo "iteration 35 (TP1 x DP4, resumed from universal): $after"
$py tools/generate_text.py --load "$out/checkpoints" --tokenizer-model "$out/corpus/tokenizer.model" \
    --prompt "The import statement" --max-new-tokens 40 --greedy || true

echo "== 6. the loss curve"
plot=(tools/plot_loss.py "$out/tensorboard/tp2_pp2" "$out/tensorboard/tp1_dp4" --output "$out/loss.png"
      --labels "TP2 x PP2 (ZeRO-1)" "TP1 x DP4 (ZeRO-2), resumed from the universal checkpoint")
if $py -c "import matplotlib" 2>/dev/null; then
    $py "${plot[@]}"
    echo "loss curve: $out/loss.png"
else
    echo "no loss curve: matplotlib is not installed; $py -m pip install matplotlib (or pip install" \
         "'megatron_zero[plot]'), then: $py $(printf '%q ' "${plot[@]}")"
fi
echo "demo finished; TensorBoard logs in $out/tensorboard"
