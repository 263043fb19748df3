#!/bin/bash
# Llama2-7B pre-training on stock Megatron-LM (core_v0.12.1) with mindspeed-ha.
#
# Same model and layout as MindSpeed-LLM's examples/mcore/llama2/pretrain_llama2_7b_ptd.sh
# (32 layers, hidden 4096, ffn 11008, 32 heads, seq 4096, RoPE, SwiGLU, RMSNorm, untied
# embeddings, no linear bias, bf16, TP=1 PP=2, distributed optimizer), launched with
# mindspeed-ha-run instead of torchrun and the four high-availability flags added.
#
# Environment (all optional except where noted):
#   MEGATRON_LM      Megatron-LM checkout holding pretrain_gpt.py (default: current directory)
#   DATA_PATH        Megatron indexed dataset prefix; unset -> --mock-data
#   TOKENIZER_MODEL  Llama2 tokenizer.model; unset -> NullTokenizer (vocab 32000, 4096 with TINY=1)
#   CKPT_DIR         --save/--load directory (default ./ckpt_llama2_7b, ./ckpt_llama2_tiny with TINY=1)
#   CKPT_FORMAT      --ckpt-format: torch (default; the format of the dying checkpoint) or
#                    torch_dist (Megatron's default)
#   NPROC            processes per node (default 8; 4 with TINY=1)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node layout (default 1, 0, localhost, 6000)
#   TP, PP           tensor/pipeline parallel sizes (default 1, 2)
#   TRAIN_ITERS      (default 5000; 10 with TINY=1)
#   TTP_ADDR         controller address: the master node's IP (default MASTER_ADDR)
#   GLOO_SOCKET_IFNAME  network interface of that address (default eth0; lo with TINY=1)
#   LAUNCHER         launcher command (default mindspeed-ha-run)
#   TINY=1           the same architecture at CPU size: 4 layers, hidden 64, ffn 172, 4 heads,
#                    seq 32, micro-batch 2, global batch 8, local transformer implementation,
#                    fusions off, gloo, fp32 (BF16=1 keeps bf16)
#   NO_REPLICA=0     keep optimizer replicas (default 1: --distributed-optimizer-no-replica)
#   LOG_DIR          where the log is written (default ./logs)
#   DRY_RUN=1        print the command (shell-quoted) instead of running it
# Extra arguments are appended to pretrain_gpt.py's: ./pretrain_llama2_7b_ptd.sh --seed 7

set -euo pipefail

TINY=${TINY:-0}
MEGATRON_LM=${MEGATRON_LM:-$PWD}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
TP=${TP:-1}
PP=${PP:-2}
CKPT_FORMAT=${CKPT_FORMAT:-torch}
LAUNCHER=${LAUNCHER:-mindspeed-ha-run}

export CUDA_DEVICE_MAX_CONNECTIONS=1
# The controller runs on the master node: TTP_ADDR is its IP (IPv4 or IPv6 literal).
export TTP_ADDR=${TTP_ADDR:-$MASTER_ADDR}

if [ "$TINY" = 1 ]; then
    NPROC=${NPROC:-4}
    TRAIN_ITERS=${TRAIN_ITERS:-10}
    CKPT_DIR=${CKPT_DIR:-./ckpt_llama2_tiny}
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
    VOCAB_SIZE=4096
    MODEL_ARGS=(
        --num-layers 4
        --hidden-size 64
        --ffn-hidden-size 172
        --num-attention-heads 4
        --seq-length 32
        --max-position-embeddings 32
        --micro-batch-size 2
        --global-batch-size 8
    )
    # CPU: megatron-core's own layers (no Transformer Engine), no fused kernels, gloo.
    # (--attention-backend local is not usable here: validate_args then requires
    # --spec local, which stock pretrain_gpt.py cannot import; the local layer spec uses
    # megatron-core's DotProductAttention whatever the backend says.)
    DEVICE_ARGS=(
        --transformer-impl local
        --no-persist-layer-norm
        --no-gradient-accumulation-fusion
        --no-masked-softmax-fusion
        --no-bias-swiglu-fusion
        --no-bias-dropout-fusion
        --no-rope-fusion
        --distributed-backend gloo
    )
    PRECISION_ARGS=()
    if [ "${BF16:-0}" = 1 ]; then
        PRECISION_ARGS=(--bf16)
    fi
    OUTPUT_ARGS=(
        --log-interval 1
        --save-interval "${SAVE_INTERVAL:-5}"
        --eval-interval 1000
        --eval-iters 0
    )
else
    NPROC=${NPROC:-8}
    TRAIN_ITERS=${TRAIN_ITERS:-5000}
    CKPT_DIR=${CKPT_DIR:-./ckpt_llama2_7b}
    # The interface that carries TTP_ADDR on this node.
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-eth0}
    VOCAB_SIZE=32000
    MODEL_ARGS=(
        --num-layers 32
        --hidden-size 4096
        --ffn-hidden-size 11008
        --num-attention-heads 32
        --seq-length 4096
        --max-position-embeddings 4096
        --micro-batch-size 1
        --global-batch-size 256
    )
    DEVICE_ARGS=(--overlap-grad-reduce)
    if [ "$TP" -gt 1 ]; then
        DEVICE_ARGS+=(--sequence-parallel)
    fi
    PRECISION_ARGS=(--bf16)
    OUTPUT_ARGS=(
        --log-interval 1
        --save-interval "${SAVE_INTERVAL:-1000}"
        --eval-interval 1000
        --eval-iters 10
    )
fi

DISTRIBUTED_ARGS=(
    --nproc-per-node "$NPROC"
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)

GPT_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    "${MODEL_ARGS[@]}"
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.01
    --attention-softmax-in-fp32
    --make-vocab-size-divisible-by 1
    --lr 1.25e-6
    --min-lr 1.25e-7
    --lr-decay-style cosine
    --lr-warmup-fraction 0.01
    --weight-decay 1e-1
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.95
    --train-iters "$TRAIN_ITERS"
    --use-distributed-optimizer
    "${DEVICE_ARGS[@]}"
    "${PRECISION_ARGS[@]}"
)

# mindspeed-ha: master switch (dying checkpoint), UCE repair, worker reboot.
HA_ARGS=(
    --enable-high-availability
    --enable-hbmfault-repair
    --enable-worker-reboot
)
# No optimizer replicas: repairs restart from the latest periodic checkpoint, and a lost
# rank's optimizer shard exists nowhere else (the dying checkpoint then reports "no
# complete data", exit 76). To keep replicas (every optimizer shard on N ranks, memory
# 4 + 16*N/d bytes per parameter) set NO_REPLICA=0; --ha-replica-count N picks N
# (default 2, must divide d).
if [ "${NO_REPLICA:-1}" = 1 ]; then
    HA_ARGS+=(--distributed-optimizer-no-replica)
fi

if [ -n "${TOKENIZER_MODEL:-}" ]; then
    TOKENIZER_ARGS=(--tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL")
else
    TOKENIZER_ARGS=(--tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE")
fi
if [ -n "${DATA_PATH:-}" ]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1)
else
    DATA_ARGS=(--mock-data)
fi

# Optimizer and RNG state are loaded on resume (upstream's --no-load-optim/--no-load-rng
# would throw away exactly what the dying checkpoint preserves).
CKPT_ARGS=(
    --save "$CKPT_DIR"
    --load "$CKPT_DIR"
    --ckpt-format "$CKPT_FORMAT"
)

# $LAUNCHER unquoted on purpose: LAUNCHER="python -m mindspeed_ha.launcher" works too.
CMD=(
    $LAUNCHER "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_LM/pretrain_gpt.py"
    "${GPT_ARGS[@]}"
    "${HA_ARGS[@]}"
    "${TOKENIZER_ARGS[@]}"
    "${DATA_ARGS[@]}"
    "${OUTPUT_ARGS[@]}"
    "${CKPT_ARGS[@]}"
    "$@"
)

if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi

if [ ! -f "$MEGATRON_LM/pretrain_gpt.py" ]; then
    echo "pretrain_llama2_7b_ptd.sh: no pretrain_gpt.py in MEGATRON_LM=$MEGATRON_LM" >&2
    exit 2
fi
LOG_DIR=${LOG_DIR:-./logs}
mkdir -p "$LOG_DIR"
# Exit code 75: a dying checkpoint was saved; rerun this script to resume from it.
"${CMD[@]}" 2>&1 | tee "$LOG_DIR/train_llama2_7b$([ "$TINY" = 1 ] && echo _tiny).log"
