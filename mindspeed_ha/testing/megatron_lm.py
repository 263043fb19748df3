"""Run Megatron-LM's own, unmodified ``pretrain_gpt.py`` in tests (CPU/gloo or GPU).

Shipped so that users can prove fault tolerance on their own Megatron-LM checkout::

    from mindspeed_ha.testing import megatron_lm as mlm
    root = mlm.unpack("Megatron-LM-core_v0.12.1.tar.gz", tmp_dir)   # or an existing checkout
    r = mlm.launch_stock(root, mlm.stock_gpt_args(pp=2, train_iters=8), env={...})
    r.losses     # {iteration: float.hex(lm loss)}, exact (testing.loss_log patch)

Nothing here writes into the Megatron-LM tree: :func:`tree_digest` lets a test prove it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from typing import Dict, List, Mapping, Optional, Sequence

from mindspeed_ha.env import FORKSERVER_PRELOAD

from .harness import RunResult, flags_to_argv, launch, launcher_command


def unpack(tarball: str, dest: str) -> str:
    """Unpack a ``git archive`` tarball of Megatron-LM into ``dest``; returns the tree root.

    Raises:
        FileNotFoundError: the tarball holds no ``pretrain_gpt.py``.
    """
    with tarfile.open(tarball) as tar:
        tar.extractall(dest, filter="data")
    for root, _dirs, files in os.walk(dest):
        if "pretrain_gpt.py" in files:
            return root
    raise FileNotFoundError(f"{tarball}: no pretrain_gpt.py inside")


def tree_digest(root: str) -> Dict[str, str]:
    """``relative path -> sha256`` of every file under ``root`` (new files show up too)."""
    out = {}
    for base, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def stock_gpt_args(tp: int = 1, pp: int = 1, train_iters: int = 8, ckpt_format: str = "torch",
                   data_prefix: Optional[str] = None, tokenizer_model: Optional[str] = None,
                   **overrides) -> List[str]:
    """Megatron-LM flags for the tiny GPT used on CPU (4 layers, hidden 64, 4 heads, seq 32,
    micro-batch 2, global batch 8, dropout 0.1, distributed optimizer, gloo).

    Mock data (``--mock-data``, ``NullTokenizer``, vocab 4096) unless ``data_prefix`` and
    ``tokenizer_model`` (a sentencepiece model) are given. ``overrides``: ``flag=value``
    (underscores become dashes; ``True`` = bare switch; ``False``/``None`` drops the flag).
    """
    flags = {
        "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
        "max_position_embeddings": 32, "micro_batch_size": 2, "global_batch_size": 8,
        "train_iters": train_iters, "lr": 1e-3, "min_lr": 1e-4, "lr_decay_style": "cosine",
        "lr_warmup_iters": 2, "weight_decay": 0.01, "clip_grad": 1.0,
        "hidden_dropout": 0.1, "attention_dropout": 0.1, "seed": 1234,
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "use_distributed_optimizer": True, "distributed_backend": "gloo",
        "transformer_impl": "local", "no_persist_layer_norm": True,
        "no_gradient_accumulation_fusion": True, "no_masked_softmax_fusion": True,
        "no_bias_gelu_fusion": True, "no_bias_dropout_fusion": True,
        "log_interval": 1, "eval_iters": 0, "eval_interval": 1000, "ckpt_format": ckpt_format,
    }
    if data_prefix is None:
        flags.update(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=4096)
    else:
        flags.update(data_path=data_prefix, split="98,2,0", tokenizer_type="GPTSentencePieceTokenizer",
                     tokenizer_model=tokenizer_model)
    flags.update(overrides)
    return flags_to_argv(flags)


def stock_env(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Environment for a CPU run: one thread per rank, no torch.compile start-up cost, and
    Megatron-LM's ``megatron.training`` among what a fork server preloads (when the
    launcher's ``MINDSPEED_HA_FORKSERVER=1``, see :mod:`mindspeed_ha.forkserver`)."""
    env = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           FORKSERVER_PRELOAD: "megatron.training"}
    env.update(extra or {})
    return env


def launch_stock(root: str, train_args: Sequence[str], *, nproc: int = 4,
                 env: Optional[Mapping[str, str]] = None, timeout_s: float = 400,
                 launcher: Optional[Sequence[str]] = None) -> RunResult:
    """``mindspeed-ha-run --standalone --nproc-per-node N <root>/pretrain_gpt.py ARGS`` from ``root``.

    The working directory is ``root`` (as users run it); ``pretrain_gpt.py`` and its
    ``megatron`` package are the user's, unmodified.
    """
    return launch(nproc, list(train_args), env=stock_env(env), timeout_s=timeout_s,
                  launcher=launcher or launcher_command(nproc), cwd=root,
                  script=os.path.join(root, "pretrain_gpt.py"))


def build_indexed_dataset(root: str, text_file: str, out_dir: str, vocab_size: int = 512) -> Dict[str, str]:
    """A real indexed dataset made by Megatron-LM's stock ``tools/preprocess_data.py``.

    Trains a small sentencepiece BPE model on ``text_file`` (offline), writes one JSON
    document per paragraph, and runs ``preprocess_data.py --tokenizer-type
    GPTSentencePieceTokenizer --append-eod``.

    Returns:
        ``{"data_prefix": ..., "tokenizer_model": ...}`` for :func:`stock_gpt_args`.

    Raises:
        subprocess.CalledProcessError: preprocessing failed (its output is attached).
    """
    import json

    import sentencepiece as spm

    os.makedirs(out_dir, exist_ok=True)
    model_prefix = os.path.join(out_dir, "spm")
    spm.SentencePieceTrainer.train(input=text_file, model_prefix=model_prefix, vocab_size=vocab_size,
                                   model_type="bpe", character_coverage=1.0, num_threads=1,
                                   minloglevel=2)
    with open(text_file, encoding="utf-8") as f:
        paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    docs = os.path.join(out_dir, "docs.jsonl")
    with open(docs, "w", encoding="utf-8") as f:
        for p in paragraphs:
            f.write(json.dumps({"text": p}) + "\n")
    out_prefix = os.path.join(out_dir, "corpus")
    cmd = [sys.executable, os.path.join(root, "tools", "preprocess_data.py"), "--input", docs,
           "--output-prefix", out_prefix, "--tokenizer-type", "GPTSentencePieceTokenizer",
           "--tokenizer-model", model_prefix + ".model", "--append-eod", "--workers", "1"]
    subprocess.run(cmd, cwd=out_dir, check=True, capture_output=True, text=True,
                   env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"))
    return {"data_prefix": out_prefix + "_text_document", "tokenizer_model": model_prefix + ".model"}
