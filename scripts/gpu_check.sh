#!/usr/bin/env bash
# GPU smoke checks in one go, for whoever has a GPU machine (about 5 minutes on one H100/H200).
#   bash scripts/gpu_check.sh            # writes logs under ${OUT:-gpu_check_out}
# Needs: CUDA torch, megatron-core; transformer-engine / flash-attn are used when importable.
# NCCL cannot place two ranks on one GPU, so multi-rank layouts run on as many GPUs as exist.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# megatron-core's tensor-parallel layers overlap their weight-gradient GEMM with the gradient
# all-reduce / reduce-scatter (TP, --sequence-parallel) and its DDP overlaps bucket reduces
# (--overlap-grad-reduce), relying on kernels being issued to the GPU in order: one hardware
# queue (tensor_parallel/layers.py, distributed/param_and_grad_buffer.py). GPU runs only.
export CUDA_DEVICE_MAX_CONNECTIONS=1
status=0
step() { echo "=== $1"; shift; "$@" 2>&1 | tee -a "$OUT/gpu_check.log"; local rc=${PIPESTATUS[0]}; echo "=== rc=$rc"; [ "$rc" = 0 ] || status=1; }

step "environment" python -c "
import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())
import megatron.core; print('megatron-core', megatron.core.__version__)
for m in ('transformer_engine', 'flash_attn'):
    try: __import__(m); print(m, 'importable')
    except Exception as e: print(m, 'missing:', type(e).__name__)
"
step "gpu-marked tests" python -m pytest -q -m gpu tests -p no:cacheprovider
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
COMMON=(--num-layers 4 --hidden-size 256 --num-attention-heads 8 --num-query-groups 4 --seq-length 1024
        --max-position-embeddings 1024 --position-embedding-type rope --normalization RMSNorm --swiglu
        --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --bf16 --demo-corpus
        --tokenizer-type ByteLevelTokenizer --split 98,2,0 --reset-position-ids --reset-attention-mask
        --micro-batch-size 2 --global-batch-size 16 --train-iters 30 --lr 1e-3 --lr-warmup-iters 3
        --log-interval 5 --eval-interval 1000 --eval-iters 0 --data-cache-path "$OUT/cache")
step "single GPU, local layers" python pretrain_gpt_dcp.py "${COMMON[@]}" --transformer-impl local --loss-log "$OUT/local.jsonl"
if python -c "import transformer_engine" 2>/dev/null; then
  step "single GPU, transformer-engine layers" python pretrain_gpt_dcp.py "${COMMON[@]}" --transformer-impl transformer_engine --loss-log "$OUT/te.jsonl"
fi
step "single GPU, --dcp adaptive (one-rank layouts, NCCL, overlapped pull/push)" python pretrain_gpt_dcp.py "${COMMON[@]}" --dcp --overlap-param-gather --overlap-grad-reduce \
    --dcp-global-batch-tokens 16384 --dcp-max-seq-len 1024 --loss-log "$OUT/dcp.jsonl"
step "memory: measured vs predicted per micro-batch" python scripts/gpu_memory_check.py "${COMMON[@]}"
if [ "$NGPU" -ge 2 ]; then
  step "2 GPUs, TP2 (NCCL)" torchrun --standalone --nproc_per_node 2 pretrain_gpt_dcp.py "${COMMON[@]}" --tensor-model-parallel-size 2 --sequence-parallel
  step "2 GPUs, CP2 (NCCL)" torchrun --standalone --nproc_per_node 2 pretrain_gpt_dcp.py "${COMMON[@]}" --context-parallel-size 2
fi
echo "gpu_check: $([ $status = 0 ] && echo PASS || echo FAIL) (logs in $OUT)"
exit $status
