"""Against Megatron-LM's own ``megatron/training`` (core_v0.12.1), which is not on PyPI.

Skipped unless ``MEGATRON_LM`` points at a Megatron-LM checkout (its root, holding
``megatron/training``). Checked once by hand with core_v0.12.1: the HA flags parse
through Megatron-LM's ``parse_args``, ``validate_args`` accepts the replica setting, and
``train_step`` has the signature our decorator binds.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.environ.get("MEGATRON_LM")
pytestmark = pytest.mark.skipif(not ROOT or not os.path.isdir(os.path.join(ROOT or "", "megatron", "training")),
                                reason="set MEGATRON_LM to a Megatron-LM checkout to run")

SCRIPT = r'''
import inspect, sys
import mindspeed_ha
from mindspeed_ha.patches import registry
import megatron.training.arguments as A
import megatron.training.training as T
base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "4", "--lr", "1e-3", "--pipeline-model-parallel-size", "2",
        "--use-distributed-optimizer", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "4096", "--bf16", "--enable-high-availability"]
sys.argv = ["pretrain_gpt.py"] + base
args = A.parse_args()
A.validate_args(args, {})
assert args.enable_high_availability and args.num_distributed_optimizer_instances == 2
assert list(inspect.signature(T.train_step).parameters) == [
    "forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler", "config"]
assert "ha.train_step.megatron" in registry.active("ha")
sys.argv = ["pretrain_gpt.py"] + base + ["--ha-replica-count", "3"]
try:
    A.parse_args()
except Exception as exc:
    assert "--ha-replica-count" in str(exc), exc
else:
    raise AssertionError("bad replica count accepted")
print("OK")
'''


def test_megatron_lm_parse_args_and_train_step():
    env = dict(os.environ, PYTHONPATH=ROOT, WORLD_SIZE="4", RANK="0")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]
