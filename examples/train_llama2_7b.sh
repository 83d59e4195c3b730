#!/usr/bin/env bash
# Llama-2 7B on one node of 8 GPUs (torchrun, NCCL), upstream-Megatron flags.
#   DATA_PREFIX=/data/my_text_document TOKENIZER=/models/llama2 bash examples/train_llama2_7b.sh
# Add --dcp --dcp-global-batch-tokens 4194304 --dcp-max-seq-len 131072 for adaptive layouts.
set -euo pipefail
cd "$(dirname "$0")/.."
# megatron-core's tensor-parallel layers overlap their weight-gradient GEMM with the gradient
# all-reduce / reduce-scatter (TP, --sequence-parallel) and its DDP overlaps bucket reduces
# (--overlap-grad-reduce), relying on kernels being issued to the GPU in order: one hardware
# queue (tensor_parallel/layers.py, distributed/param_and_grad_buffer.py). GPU runs only.
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama2_7b}
TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-tensorboard/llama2_7b}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --context-parallel-size 1
    --sequence-parallel
)

DATA_ARGS=(
    --data-path "${DATA_PREFIX:?set DATA_PREFIX to a preprocessed .bin/.idx prefix}"
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER:?set TOKENIZER to a local tokenizer dir}"
    --split 949,50,1 --reset-position-ids --reset-attention-mask --eod-mask-loss
)

EVAL_AND_LOGGING_ARGS=(
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt_dcp.py --yaml-cfg examples/llama2_7b.yaml \
    "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "$@"
