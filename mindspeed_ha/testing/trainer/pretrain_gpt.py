"""Pretrain GPT on megatron-core (Megatron-LM's pretrain_gpt.py shape).

    torchrun --standalone --nproc-per-node 4 -m mindspeed_ha.testing.trainer.pretrain_gpt \\
        --tensor-model-parallel-size 2 --num-layers 4 --hidden-size 64 ...
"""

import mindspeed_ha  # noqa: F401  (installs the patch registry first)

from functools import partial

import torch
from megatron.core import parallel_state as mpu
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from mindspeed_ha.testing.trainer.arguments import core_transformer_config_from_args, get_args
from mindspeed_ha.testing.trainer.data import build_gpt_datasets
from mindspeed_ha.testing.trainer.training import pretrain


def model_provider(pre_process=True, post_process=True) -> GPTModel:
    """This PP stage's GPTModel with the local (no TransformerEngine) layer spec."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(normalization=args.normalization)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, fp16_lm_cross_entropy=False, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type)


def get_batch(data_iterator):
    """tokens, labels, loss_mask, attention_mask, position_ids (None on middle PP stages)."""
    if not (mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage()):
        return None, None, None, None, None
    batch = next(data_iterator)
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"])


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(sum of masked token losses, local token count, {'lm loss': DP-summed (sum, count)})."""
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    total_tokens = loss_mask.sum()
    loss = torch.cat([torch.sum(losses.view(-1) * loss_mask).view(1), total_tokens.view(1)])
    reporting_loss = loss.clone().detach()
    torch.distributed.all_reduce(reporting_loss, group=mpu.get_data_parallel_group())
    local_num_tokens = loss[1].clone().detach().to(torch.int)
    return loss[0].clone(), local_num_tokens, {"lm loss": (reporting_loss[0], reporting_loss[1])}


def forward_step(data_iterator, model: GPTModel):
    """Forward one micro-batch; returns (output_tensor, loss function)."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """(train, valid, test) GPTDatasets; valid/test are not built."""
    args = get_args()
    return build_gpt_datasets(args, train_val_test_num_samples[0])


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
             forward_step)
