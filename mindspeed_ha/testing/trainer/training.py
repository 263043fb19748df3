"""Megatron-LM-shaped training loop on megatron-core (names and signatures of core_v0.12.1).

:func:`train` looks up :func:`train_step`, :func:`save_checkpoint` and
:func:`training_log` in this module's globals at call time, so a wrapt patch on
``mindspeed_ha.testing.trainer.training.<name>`` (or, in Megatron-LM,
``megatron.training.training.<name>``) takes effect. The per-iteration path issues no
collectives beyond Megatron-LM's (forward/backward, gradient sync, optimizer, the loss
function's DP all-reduce for logging).
"""

from __future__ import annotations

import json
import os
import time

import torch
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from .arguments import get_args
from .checkpointing import check_save_dir_writable, load_checkpoint, print_rank_0, save_checkpoint
from .data import build_train_iterator
from .initialize import initialize_megatron


def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, wrap_with_ddp=True):
    """Build this PP stage's model chunk, cast for bf16 and wrap in megatron DDP; a list."""
    args = get_args()
    model = model_provider_func(pre_process=mpu.is_pipeline_first_stage(),
                                post_process=mpu.is_pipeline_last_stage())
    model.model_type = model_type
    model = [model]
    for chunk in model:
        for p in chunk.parameters():
            from megatron.core import tensor_parallel
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    if args.bf16:
        config = get_model_config(model[0])
        model = [Float16Module(config, m) for m in model]
    if not wrap_with_ddp:
        return model
    config = get_model_config(model[0])
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 or args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=False, overlap_param_gather=False,
        use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        check_for_nan_in_grad=False,
    )
    model = [DDP(config=config, ddp_config=ddp_config, module=m, disable_bucketing=(i > 0))
             for i, m in enumerate(model)]
    if args.data_parallel_random_init:
        for m in model:
            m.broadcast_params()
    return model


def get_optimizer_param_scheduler(optimizer):
    """Megatron-LM's iteration-based schedule, in samples."""
    args = get_args()
    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True, override_opt_param_scheduler=False)


def setup_model_and_optimizer(model_provider_func, model_type, no_wd_decay_cond=None,
                              scale_lr_cond=None, lr_mult=1.0, checkpointing_context=None):
    """Model (list of DDP chunks), Megatron optimizer and LR scheduler; loads --load."""
    args = get_args()
    model = get_model(model_provider_func, model_type)
    config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=False,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(config, model, no_wd_decay_cond, scale_lr_cond, lr_mult)
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)
    if args.load is not None:
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(
            model, optimizer, opt_param_scheduler)
    else:
        args.iteration, args.num_floating_point_operations_so_far = 0, 0
    return model, optimizer, opt_param_scheduler


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
    """One training step (Megatron-LM core_v0.12.1's contract).

    Returns:
        ``(loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm,
        num_zeros_in_grad)``; ``loss_dict`` is ``{}`` except on the last PP stage.
    """
    args = get_args()
    rerun_state_machine = get_rerun_state_machine()
    while rerun_state_machine.should_run_forward_backward(data_iterator):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward_func = get_forward_backward_func()
        losses_reduced = forward_backward_func(
            forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
            num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length,
            forward_only=False)
    should_checkpoint, should_exit, exit_code = rerun_state_machine.should_checkpoint_and_exit()
    if should_exit:
        return {}, True, should_checkpoint, should_exit, exit_code, None, None
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    if update_successful:
        increment = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        opt_param_scheduler.step(increment=increment)
        skipped_iter = 0
    else:
        skipped_iter = 1
    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        loss_reduced = {}
        for key in losses_reduced[0].keys():
            numerator, denominator = 0, 0
            for x in losses_reduced:
                val = x[key]
                if isinstance(val, (tuple, list)):
                    numerator += val[0]
                    denominator += val[1]
                else:
                    numerator += val
                    denominator += 1
            loss_reduced[key] = numerator / denominator
        return loss_reduced, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, num_zeros_in_grad
    return {}, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, num_zeros_in_grad


def _is_loss_logger() -> bool:
    return (mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0
            and mpu.get_data_parallel_rank() == 0)


def training_log(loss_dict, learning_rate, iteration, skipped_iter, grad_norm, elapsed_s):
    """Megatron-style log line (every --log-interval) and the --loss-log JSON line."""
    args = get_args()
    if not _is_loss_logger():
        return
    lm = loss_dict.get("lm loss")
    lm = float(lm) if lm is not None else float("nan")
    gn = float(grad_norm) if grad_norm is not None else None
    if args.loss_log:
        rec = {"iteration": iteration, "lm_loss": lm, "lm_loss_hex": lm.hex(), "grad_norm": gn,
               "lr": learning_rate, "elapsed_s": elapsed_s}
        with open(args.loss_log, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
    if iteration % args.log_interval == 0:
        print(f" iteration {iteration:8d}/{args.train_iters:8d} |"
              f" consumed samples: {args.consumed_train_samples:12d} |"
              f" elapsed time per iteration (ms): {elapsed_s * 1000.0:.1f} |"
              f" learning rate: {learning_rate:.6E} | global batch size: {args.global_batch_size:5d} |"
              f" lm loss: {lm:.6E} | loss scale: 1.0 |"
              + (f" grad norm: {gn:.3f} |" if gn is not None else "")
              + f" number of skipped iterations: {skipped_iter:3d} |", flush=True)


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
          valid_data_iterator, process_non_loss_data_func, config, checkpointing_context,
          non_loss_data_func=None):
    """Run iterations ``args.iteration .. args.train_iters``; save at --save-interval.

    Returns:
        ``(iteration, num_floating_point_operations_so_far)``.
    """
    args = get_args()
    for chunk in model:
        chunk.train()
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    iteration = args.iteration
    flops = getattr(args, "num_floating_point_operations_so_far", 0)
    saved_at = None
    while iteration < args.train_iters:
        args.curr_iteration = iteration
        t0 = time.perf_counter()
        loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, _ = train_step(
            forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config)
        if should_checkpoint and args.save:
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops,
                            checkpointing_context, train_data_iterator=train_data_iterator)
            saved_at = iteration
        if should_exit:
            break
        iteration += 1
        args.iteration = iteration
        args.consumed_train_samples += get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        lr = next(g["lr"] for g in optimizer.param_groups)
        training_log(loss_dict, lr, iteration, skipped_iter, grad_norm, time.perf_counter() - t0)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops,
                            checkpointing_context, train_data_iterator=train_data_iterator)
            saved_at = iteration
        if args.exit_interval and iteration % args.exit_interval == 0:
            if args.save and saved_at != iteration:
                save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops,
                                checkpointing_context, train_data_iterator=train_data_iterator)
                saved_at = iteration
            print_rank_0(f"exiting program at iteration {iteration}")
            break
    args.last_saved_iteration = saved_at
    return iteration, flops


def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
    """(train, None, None) iterators; train resumes at ``args.consumed_train_samples``."""
    args = get_args()
    train_samples = args.train_iters * args.global_batch_size
    train_ds, _, _ = build_train_valid_test_datasets_provider([train_samples, 0, 0])
    return build_train_iterator(train_ds, args.consumed_train_samples, args), None, None


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={},
             get_embedding_ranks=None, get_position_embedding_ranks=None, non_loss_data_func=None,
             argv=None):
    """Initialize, build model/optimizer (loading --load), train, save at the end.

    Args:
        argv: argument list (default ``sys.argv[1:]``); ours, for tests.
    """
    initialize_megatron(extra_args_provider=extra_args_provider, args_defaults=args_defaults, argv=argv)
    args = get_args()
    check_save_dir_writable(args.save)
    if args.loss_log:
        os.makedirs(os.path.dirname(os.path.abspath(args.loss_log)), exist_ok=True)
    checkpointing_context = {}
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(
        model_provider, model_type, checkpointing_context=checkpointing_context)
    train_data_iterator, valid_data_iterator, _ = build_train_valid_test_data_iterators(
        train_valid_test_dataset_provider)
    config = get_model_config(model[0])
    print_rank_0("training ...")
    iteration, flops = 0, 0
    if args.train_iters > 0:
        iteration, flops = train(forward_step_func, model, optimizer, opt_param_scheduler,
                                 train_data_iterator, valid_data_iterator, process_non_loss_data_func,
                                 config, checkpointing_context, non_loss_data_func)
    if args.save and iteration != 0 and getattr(args, "last_saved_iteration", None) != iteration:
        save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops, checkpointing_context,
                        train_data_iterator=train_data_iterator)
    # Tear the process groups down explicitly: left to interpreter shutdown, gloo's
    # worker threads were seen to abort the process ("terminate called without an
    # active exception", SIGABRT) after a successful run.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return iteration
