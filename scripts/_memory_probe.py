"""Worker for bench_memory.py: build the model + optimizer, run one step, count bytes.

Run under the launcher with Megatron-style args; writes one JSON per rank into
``$MINDSPEED_HA_BENCH_OUT``. Counts the bytes of what the formula counts: model
params, the DDP grad buffers, and the optimizer's fp32 main params + Adam moments.
"""

from mindspeed_ha import env as ha_env
import json
import os
import sys

import mindspeed_ha  # noqa: F401  (patches)
import torch
from megatron.core.enums import ModelType
from megatron.core.utils import get_model_config

from mindspeed_ha.testing.trainer import arguments, pretrain_gpt
from mindspeed_ha.testing.trainer import training as T
from mindspeed_ha.testing.trainer.initialize import initialize_megatron


def _bytes(t):
    return t.numel() * t.element_size()


def main():
    initialize_megatron(argv=sys.argv[1:])
    args = arguments.get_args()
    model, optimizer, sched = T.setup_model_and_optimizer(pretrain_gpt.model_provider, ModelType.encoder_or_decoder)
    it, _, _ = T.build_train_valid_test_data_iterators(pretrain_gpt.train_valid_test_datasets_provider)
    T.train_step(pretrain_gpt.forward_step, it, model, optimizer, sched, get_model_config(model[0]))
    params = [p for m in model for p in m.parameters()]
    n = sum(p.numel() for p in params)
    model_bytes = sum(_bytes(p) for p in params)
    grad_bytes = sum(_bytes(b.grad_data) for m in model for b in m.buffers)
    inner = optimizer.optimizer
    main_params = [p for g in inner.param_groups for p in g["params"]]
    model_ptrs = {p.data_ptr() for p in params}
    # fp32 main params are separate tensors only with bf16 params (fp32 shards are views).
    main_bytes = sum(_bytes(p) for p in main_params if args.bf16 and p.data_ptr() not in model_ptrs)
    moment_bytes = sum(_bytes(t) for st in inner.state.values() for k, t in st.items()
                       if torch.is_tensor(t) and k in ("exp_avg", "exp_avg_sq"))
    out = dict(rank=torch.distributed.get_rank(), params=n, model_bytes=model_bytes, grad_bytes=grad_bytes,
               main_param_bytes=main_bytes, moment_bytes=moment_bytes,
               replicas=args.num_distributed_optimizer_instances,
               dp=torch.distributed.get_world_size() // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size))
    path = os.path.join(os.environ[ha_env.BENCH_OUT], f"rank{out['rank']}.json")
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
