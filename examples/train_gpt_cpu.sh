#!/usr/bin/env bash
# A small GPT on CPU ranks (gloo), Megatron-style flag groups. Runs anywhere:
#   bash examples/train_gpt_cpu.sh [extra flags...]
# Data: the standard-library demo corpus (built once), or pass --data-path PREFIX.
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-4}

DISTRIBUTED_ARGS=(--standalone --nproc_per_node "$NPROC")

GPT_MODEL_ARGS=(
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 352
    --num-attention-heads 8 --group-query-attention --num-query-groups 4
    --seq-length 256 --max-position-embeddings 256
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
    --hidden-dropout 0.0 --attention-dropout 0.0
)

TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 16 --train-iters 60
    --lr 3.0e-3 --min-lr 3.0e-4 --lr-decay-style cosine --lr-warmup-iters 5
    --weight-decay 0.1 --clip-grad 1.0 --seed 1234
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --context-parallel-size 1
    --use-distributed-optimizer
)

DATA_ARGS=(
    --demo-corpus --tokenizer-type ByteLevelTokenizer --split 98,2,0
    --reset-position-ids --reset-attention-mask
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 5 --eval-interval 30 --eval-iters 2
    --save checkpoints/gpt_cpu --save-interval 30
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt_dcp.py \
    "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "$@"
