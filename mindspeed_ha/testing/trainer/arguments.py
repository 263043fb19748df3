"""Megatron-LM-shaped command line (core_v0.12.1 flag names, defaults and arg attributes).

Only the subset a GPT pre-training run on megatron-core needs is implemented; every flag
keeps Megatron-LM's name, default and ``args.<attr>`` spelling so that patches written
for ``megatron.training.arguments`` apply here too. Accepted but ignored:
``--eval-iters``, ``--eval-interval`` (no validation pass is run).

Ours (not in Megatron-LM): ``--loss-log FILE`` (JSON lines, one per iteration).
"""

from __future__ import annotations

from mindspeed_ha.errors import ArgumentError  # noqa: F401  (one error tree)
import argparse
import os
from typing import Optional, Sequence

_GLOBAL_ARGS = None


def get_args():
    """The parsed, validated arguments (Megatron-LM's ``get_args``)."""
    if _GLOBAL_ARGS is None:
        raise RuntimeError("arguments are not initialized (call initialize_megatron first)")
    return _GLOBAL_ARGS


def set_args(args) -> None:
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def _add_network_size_args(p):
    g = p.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--no-persist-layer-norm", action="store_true")
    return p


def _add_regularization_args(p):
    g = p.add_argument_group(title="regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-08)
    g.add_argument("--optimizer", type=str, default="adam", choices=["adam"])
    return p


def _add_training_args(p):
    g = p.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=100, help="accepted, ignored")
    g.add_argument("--eval-interval", type=int, default=1000, help="accepted, ignored")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    return p


def _add_initialization_args(p):
    g = p.add_argument_group(title="initialization")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data-parallel-random-init", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--init-method-xavier-uniform", action="store_true")
    g.add_argument("--te-rng-tracker", action="store_true", default=False)
    g.add_argument("--inference-rng-tracker", action="store_true", default=False)
    return p


def _add_learning_rate_args(p):
    g = p.add_argument_group(title="learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--lr-decay-style", type=str, default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--min-lr", type=float, default=0.0)
    return p


def _add_checkpointing_args(p):
    g = p.add_argument_group(title="checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true", default=None)
    g.add_argument("--no-save-rng", action="store_true", default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--no-load-optim", action="store_true", default=None)
    g.add_argument("--no-load-rng", action="store_true", default=None)
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--ckpt-format", default="torch", choices=["torch", "torch_dist", "zarr", "torch_dcp"])
    return p


def _add_distributed_args(p):
    g = p.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo", "hccl"],
                   help="default: nccl on CUDA, hccl on NPU, gloo otherwise")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--local-rank", type=int, default=int(os.getenv("LOCAL_RANK", "0")))
    return p


def _add_data_args(p):
    g = p.add_argument_group(title="data and dataloader")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default="969, 30, 1")
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--tokenizer-type", type=str, default="ByteLevelTokenizer",
                   choices=["ByteLevelTokenizer"])
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--num-workers", type=int, default=0)
    return p


def _add_mindspeed_ha_args(p):
    g = p.add_argument_group(title="mindspeed-ha trainer")
    g.add_argument("--loss-log", type=str, default=None,
                   help="append one JSON line per iteration (last PP stage, TP0, DP0)")
    return p


def parse_args(extra_args_provider=None, ignore_unknown_args=False, args: Optional[Sequence[str]] = None):
    """Parse Megatron-LM-style arguments.

    Args:
        extra_args_provider: ``fn(parser) -> parser`` adding more flags (Megatron-LM's hook).
        ignore_unknown_args: ignore flags no group declares.
        args: argv to parse (default ``sys.argv[1:]``); for tests.
    """
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    for add in (_add_network_size_args, _add_regularization_args, _add_training_args,
                _add_initialization_args, _add_learning_rate_args, _add_checkpointing_args,
                _add_distributed_args, _add_data_args, _add_mindspeed_ha_args):
        parser = add(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        parsed, _ = parser.parse_known_args(args)
    else:
        parsed = parser.parse_args(args)
    parsed.rank = int(os.getenv("RANK", "0"))
    parsed.world_size = int(os.getenv("WORLD_SIZE", "1"))
    return parsed


def _require(cond, flag, accepted):
    if not cond:
        raise ArgumentError(f"{flag}: invalid value; accepted: {accepted}")


def _pad_vocab(orig: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return ((orig + multiple - 1) // multiple) * multiple


def validate_args(args, defaults={}):
    """Check and complete ``args`` in place (Megatron-LM's ``validate_args``); returns it.

    Raises:
        ArgumentError: a value out of range; the message names the flag.
    """
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for flag, name in (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
                       ("--num-attention-heads", "num_attention_heads"),
                       ("--seq-length", "seq_length"), ("--micro-batch-size", "micro_batch_size"),
                       ("--train-iters", "train_iters"), ("--lr", "lr")):
        _require(getattr(args, name) is not None, flag, "required")
    for flag, name in (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
                       ("--num-attention-heads", "num_attention_heads"),
                       ("--seq-length", "seq_length"), ("--micro-batch-size", "micro_batch_size"),
                       ("--train-iters", "train_iters"),
                       ("--tensor-model-parallel-size", "tensor_model_parallel_size"),
                       ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
                       ("--num-distributed-optimizer-instances", "num_distributed_optimizer_instances"),
                       ("--make-vocab-size-divisible-by", "make_vocab_size_divisible_by"),
                       ("--log-interval", "log_interval"),
                       ("--distributed-timeout-minutes", "distributed_timeout_minutes")):
        _require(getattr(args, name) >= 1, flag, "an integer >= 1")
    _require(args.seed > 0, "--seed", "an integer > 0")
    _require(args.lr >= 0 and args.min_lr >= 0, "--lr/--min-lr", "a float >= 0")
    _require(args.lr_warmup_iters >= 0, "--lr-warmup-iters", "an integer >= 0")
    for flag, v in (("--hidden-dropout", args.hidden_dropout), ("--attention-dropout", args.attention_dropout)):
        _require(0.0 <= v < 1.0, flag, "a float in [0, 1)")
    _require(0.0 <= args.adam_beta1 < 1.0, "--adam-beta1", "a float in [0, 1)")
    _require(0.0 <= args.adam_beta2 < 1.0, "--adam-beta2", "a float in [0, 1)")
    _require(args.ckpt_format == "torch", "--ckpt-format", "'torch' (the only format this trainer writes)")
    _require(not args.fp16, "--fp16", "not supported by this trainer; use --bf16 or fp32")
    _require(not args.te_rng_tracker, "--te-rng-tracker", "not supported (no TransformerEngine)")
    _require(args.save_interval is None or args.save_interval >= 1, "--save-interval", "an integer >= 1")
    _require(args.exit_interval is None or args.exit_interval >= 1, "--exit-interval", "an integer >= 1")
    _require(args.hidden_size % args.num_attention_heads == 0, "--hidden-size",
             "a multiple of --num-attention-heads")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    _require(args.num_attention_heads % tp == 0, "--tensor-model-parallel-size",
             "a divisor of --num-attention-heads")
    _require(args.num_layers % pp == 0, "--pipeline-model-parallel-size", "a divisor of --num-layers")
    model_parallel = tp * pp
    _require(args.world_size % model_parallel == 0, "--tensor-model-parallel-size x --pipeline-model-parallel-size",
             f"a divisor of the world size {args.world_size}")
    args.data_parallel_size = args.world_size // model_parallel
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    _require(args.global_batch_size % (args.micro_batch_size * args.data_parallel_size) == 0,
             "--global-batch-size", f"a multiple of --micro-batch-size x data-parallel size "
             f"({args.micro_batch_size * args.data_parallel_size})")
    n = args.num_distributed_optimizer_instances
    _require(args.data_parallel_size % n == 0, "--num-distributed-optimizer-instances",
             f"a divisor of the data-parallel size {args.data_parallel_size}")
    _require(n == 1 or args.use_distributed_optimizer, "--num-distributed-optimizer-instances",
             "1 unless --use-distributed-optimizer")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(args.max_position_embeddings >= args.seq_length, "--max-position-embeddings",
             "an integer >= --seq-length")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    # Byte-level tokenizer: 256 byte values + EOD.
    orig_vocab = args.vocab_size if args.vocab_size is not None else 257
    _require(orig_vocab >= 257, "--vocab-size", "an integer >= 257 (byte-level tokenizer)")
    args.padded_vocab_size = _pad_vocab(orig_vocab, args.make_vocab_size_divisible_by, tp)
    args.params_dtype = "bfloat16" if args.bf16 else "float32"
    for name in ("no_save_optim", "no_save_rng", "no_load_optim", "no_load_rng"):
        if getattr(args, name) is None:
            setattr(args, name, False)
    args.consumed_train_samples = 0
    args.skipped_train_samples = 0
    args.consumed_valid_samples = 0
    args.iteration = 0
    args.curr_iteration = 0
    args.use_dist_ckpt = False
    args.async_save = False
    args.decoder_seq_length = None
    args.virtual_pipeline_model_parallel_size = None
    args.expert_model_parallel_size = 1
    args.context_parallel_size = 1
    args.sequence_parallel = False
    args.num_experts = None
    args.add_position_embedding = args.position_embedding_type == "learned_absolute"
    args.vocab_file = None
    args.retro_add_retriever = False
    return args


def core_transformer_config_from_args(args, config_class=None):
    """megatron-core TransformerConfig for the local (no TransformerEngine) GPT layers."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    kw = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=False, bf16=args.bf16, fp16=False, params_dtype=dtype,
        pipeline_dtype=dtype, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=args.add_bias_linear, persist_layer_norm=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False,
        deallocate_pipeline_outputs=True,
    )
    if args.swiglu:
        kw.update(gated_linear_unit=True, activation_func=F.silu)
    return (config_class or TransformerConfig)(**kw)
