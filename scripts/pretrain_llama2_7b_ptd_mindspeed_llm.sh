#!/bin/bash
# Llama2-7B pre-training on MindSpeed-LLM 2.3.0 (Ascend NPU) with mindspeed-ha.
#
# MindSpeed-LLM's examples/mcore/llama2/pretrain_llama2_7b_ptd.sh, adapted: the launcher is
# mindspeed-ha-run instead of torchrun, the four high-availability flags follow --bf16,
# TTP_ADDR and GLOO_SOCKET_IFNAME are exported, settings come from the environment, and the
# optimizer/RNG state is loaded on resume (upstream's --no-load-optim/--no-load-rng are
# dropped: they would discard what the dying checkpoint preserves).
# Run it from the MindSpeed-LLM root (it starts that repository's pretrain_gpt.py), or set
# MINDSPEED_LLM to that root.
#
# MindSpeed-LLM 2.3.0 defines the same four flags itself
# (mindspeed_llm/features_manager/high_availability/high_availability.py, which needs
# Huawei's mindio_ttp): with mindspeed-ha installed they are mindspeed-ha's and that
# feature stays off (MINDSPEED_HA_PROVIDER=mindio_ttp leaves them to MindSpeed-LLM instead).
#
# Runs in CI on CPU (tests/test_mindspeed_llm.py: TINY=1 CPU=1, 4 gloo ranks, a UCE and a
# killed rank recovered in place); on NPU it is untested until hardware is lent.
#
# Environment: NPUS_PER_NODE (8; 4 with TINY=1), NNODES, NODE_RANK, MASTER_ADDR,
# MASTER_PORT, TP, PP, DATA_PATH (unset -> --mock-data), TOKENIZER_MODEL (unset ->
# NullTokenizer), CKPT_LOAD_DIR, CKPT_SAVE_DIR, CKPT_FORMAT (torch), TRAIN_ITERS,
# TTP_ADDR (the master node's IP), GLOO_SOCKET_IFNAME (its interface), LAUNCHER
# (mindspeed-ha-run); TINY=1 keeps the architecture at a tiny size (4 layers, hidden 64,
# ffn 172, 4 heads, seq 32, micro-batch 2, global batch 8; still on NPU, still bf16);
# CPU=1 (with TINY=1) runs on CPU with gloo: MindSpeed's NPU fusions (fused RMSNorm, flash
# attention, fused SwiGLU and RoPE) and sequence parallelism are off (needs a CPU stand-in of
# torch_npu on PYTHONPATH, e.g. the project's tests/npu_double); LOG_DIR (./logs);
# DRY_RUN=1 prints the command instead of running it. Extra arguments are appended.

set -euo pipefail

export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True

TINY=${TINY:-0}
CPU=${CPU:-0}
MINDSPEED_LLM=${MINDSPEED_LLM:-.}
LOG_DIR=${LOG_DIR:-logs}
NPUS_PER_NODE=${NPUS_PER_NODE:-$([ "$TINY" = 1 ] && echo 4 || echo 8)}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
WORLD_SIZE=$((NPUS_PER_NODE * NNODES))

# mindspeed-ha: the controller's address (the master node, IPv4 or IPv6) and the
# interface gloo uses on this node.
export TTP_ADDR=${TTP_ADDR:-$MASTER_ADDR}
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-eth0}

CKPT_SAVE_DIR=${CKPT_SAVE_DIR:-./ckpt_llama2_$([ "$TINY" = 1 ] && echo tiny || echo 7b)}
CKPT_LOAD_DIR=${CKPT_LOAD_DIR:-$CKPT_SAVE_DIR}
CKPT_FORMAT=${CKPT_FORMAT:-torch}
TP=${TP:-1}
PP=${PP:-2}
LAUNCHER=${LAUNCHER:-mindspeed-ha-run}

if [ "$TINY" = 1 ]; then
    NUM_LAYERS=4; HIDDEN=64; FFN=172; HEADS=4; SEQ=32; MBS=2; GBS=8; VOCAB=4096
    TRAIN_ITERS=${TRAIN_ITERS:-10}; SAVE_INTERVAL=${SAVE_INTERVAL:-5}
else
    NUM_LAYERS=32; HIDDEN=4096; FFN=11008; HEADS=32; SEQ=4096; MBS=1; GBS=256; VOCAB=32000
    TRAIN_ITERS=${TRAIN_ITERS:-5000}; SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
fi

if [ -n "${TOKENIZER_MODEL:-}" ]; then
    TOKENIZER_ARGS="--tokenizer-type Llama2Tokenizer --tokenizer-model ${TOKENIZER_MODEL}"
else
    TOKENIZER_ARGS="--tokenizer-type NullTokenizer --vocab-size ${VOCAB}"
fi

if [ "$CPU" = 1 ]; then
    # no NPU: the fusions MindSpeed maps to NPU kernels are off, Megatron's too; gloo
    SEQUENCE_PARALLEL=""; FUSED_RMSNORM=""; FLASH_ATTN=""
    FUSED_SWIGLU_ROPE="--no-bias-swiglu-fusion --no-rope-fusion --no-bias-dropout-fusion --no-persist-layer-norm --transformer-impl local"
    BACKEND=gloo
else
    SEQUENCE_PARALLEL="--sequence-parallel"; FUSED_RMSNORM="--use-fused-rmsnorm"; FLASH_ATTN="--use-flash-attn"
    FUSED_SWIGLU_ROPE="--use-fused-swiglu --use-fused-rotary-pos-emb"
    BACKEND=nccl
fi

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

# The four HA flags follow --bf16. To keep optimizer replicas, drop
# --distributed-optimizer-no-replica (then UCE/worker repair copy state from a replica
# instead of reloading the last checkpoint).
GPT_ARGS="
    --use-mcore-models \
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    ${SEQUENCE_PARALLEL} \
    --num-layers ${NUM_LAYERS} \
    --hidden-size ${HIDDEN} \
    --ffn-hidden-size ${FFN} \
    --num-attention-heads ${HEADS} \
    ${TOKENIZER_ARGS} \
    --seq-length ${SEQ} \
    --max-position-embeddings ${SEQ} \
    --micro-batch-size ${MBS} \
    --global-batch-size ${GBS} \
    --make-vocab-size-divisible-by 1 \
    --lr 1.25e-6 \
    --train-iters ${TRAIN_ITERS} \
    --lr-decay-style cosine \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --attention-dropout 0.0 \
    --init-method-std 0.01 \
    --hidden-dropout 0.0 \
    --position-embedding-type rope \
    --normalization RMSNorm \
    ${FUSED_RMSNORM} \
    --swiglu \
    ${FLASH_ATTN} \
    --no-masked-softmax-fusion \
    --attention-softmax-in-fp32 \
    --min-lr 1.25e-7 \
    --weight-decay 1e-1 \
    --lr-warmup-fraction 0.01 \
    --clip-grad 1.0 \
    --adam-beta1 0.9 \
    --initial-loss-scale 65536 \
    --adam-beta2 0.95 \
    --no-gradient-accumulation-fusion \
    --use-distributed-optimizer \
    ${FUSED_SWIGLU_ROPE} \
    --overlap-grad-reduce \
    --bf16 \
    --enable-high-availability \
    --enable-hbmfault-repair \
    --enable-worker-reboot \
    --distributed-optimizer-no-replica
"

if [ -n "${DATA_PATH:-}" ]; then
    DATA_ARGS="
        --data-path $DATA_PATH \
        --split 949,50,1
    "
else
    DATA_ARGS="--mock-data"
fi

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval ${SAVE_INTERVAL} \
    --eval-interval 1000 \
    --eval-iters 10 \
    --ckpt-format ${CKPT_FORMAT}
"

CMD=($LAUNCHER $DISTRIBUTED_ARGS "$MINDSPEED_LLM/pretrain_gpt.py"
    $GPT_ARGS
    $DATA_ARGS
    $OUTPUT_ARGS
    --distributed-backend $BACKEND
    --load "$CKPT_LOAD_DIR"
    --save "$CKPT_SAVE_DIR"
    "$@")

if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi

mkdir -p "$LOG_DIR"
# Exit code 75: a dying checkpoint was saved; rerun to resume from it.
"${CMD[@]}" 2>&1 | tee "$LOG_DIR/train_llama2_7b.log"
