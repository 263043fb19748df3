"""Text -> Megatron indexed dataset (.bin/.idx), byte-level tokenizer, GPT data iterators.

* :class:`ByteLevelTokenizer`: UTF-8 bytes (ids 0..255) + EOD (256); vocab 257 before
  Megatron's padding to ``--make-vocab-size-divisible-by x TP``.
* :func:`build_indexed_dataset`: documents (paragraphs by default, or lines) -> a
  ``megatron.core.datasets.indexed_dataset`` pair, written under a temporary name and
  published with ``os.replace`` (``.bin`` first, ``.idx`` last; a prefix "exists" when its
  ``.idx`` does), so concurrent builders of the same corpus never expose a partial file.
* :func:`default_corpus_prefix`: Python's own ``pydoc_data.topics`` text (present
  wherever Python is installed), built once into ``$MINDSPEED_HA_CACHE`` or
  ``~/.cache/mindspeed_ha``.
* :func:`build_train_iterator`: GPTDataset via BlendedMegatronDatasetBuilder and
  Megatron-LM's pretraining-sampler order (resume at ``consumed_samples``). It uses no
  DataLoader and draws nothing from any torch RNG, so resumed dropout stays bitwise.

CLI: ``python -m mindspeed_ha.testing.trainer.data --input X.txt --output-prefix P [--split-lines]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Iterable, Iterator, List, Optional

import numpy as np

from mindspeed_ha.patches.cpu_training import cache_dir

EOD_ID = 256
BYTE_VOCAB_SIZE = 257


def _tokenizer_base():
    from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer

    return MegatronTokenizer


class ByteLevelTokenizer(_tokenizer_base()):
    """UTF-8 byte tokenizer with one EOD token (id 256)."""

    def __init__(self):
        super().__init__("byte-level")

    def tokenize(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def vocab(self):
        return {bytes([i]).decode("latin-1"): i for i in range(256)} | {"<eod>": EOD_ID}

    @property
    def inv_vocab(self):
        return {v: k for k, v in self.vocab.items()}

    @property
    def vocab_size(self):
        return BYTE_VOCAB_SIZE

    @property
    def eod(self):
        return EOD_ID


def split_documents(text: str, split_lines: bool = False) -> List[str]:
    """Documents = non-empty paragraphs (blank-line separated), or non-empty lines."""
    if split_lines:
        parts = text.splitlines()
    else:
        parts = [p for p in text.replace("\r\n", "\n").split("\n\n")]
    return [p.strip("\n") for p in parts if p.strip()]


def build_indexed_dataset(documents: Iterable[str], output_prefix: str) -> str:
    """Write documents (byte tokens + EOD each) as ``output_prefix.{bin,idx}``; atomic publish.

    Returns:
        ``output_prefix``.

    Raises:
        ValueError: no non-empty document.
    """
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tok = ByteLevelTokenizer()
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(output_prefix) + "-", dir=out_dir)
    os.close(fd)
    try:
        builder = IndexedDatasetBuilder(tmp + ".bin", dtype=np.uint16)
        n = 0
        for doc in documents:
            ids = tok.tokenize(doc)
            if ids.size == 0:
                continue
            ids = np.concatenate([ids, [EOD_ID]])
            builder.add_document(ids, [ids.size])
            n += 1
        if n == 0:
            builder.data_file.close()
            raise ValueError("build_indexed_dataset: no non-empty document in the input")
        builder.finalize(tmp + ".idx")
        for ext in (".bin", ".idx"):  # .idx last: its presence means the pair is complete
            with open(tmp + ext, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp + ext, output_prefix + ext)
    finally:
        for path in (tmp, tmp + ".bin", tmp + ".idx"):
            if os.path.exists(path):
                os.remove(path)
    return output_prefix


def build_from_text_file(input_path: str, output_prefix: str, split_lines: bool = False) -> str:
    with open(input_path, "r", encoding="utf-8") as f:
        text = f.read()
    return build_indexed_dataset(split_documents(text, split_lines), output_prefix)


def _default_documents() -> List[str]:
    from pydoc_data import topics

    return [topics.topics[k] for k in sorted(topics.topics)]


def default_corpus_prefix(build: bool = True) -> str:
    """Prefix of the embedded default corpus (Python's pydoc topics text), built if missing."""
    prefix = os.path.join(cache_dir(), "pydoc_topics_bytes_document")
    if build and not os.path.exists(prefix + ".idx"):
        build_indexed_dataset(_default_documents(), prefix)
    return prefix


def ensure_default_corpus() -> str:
    """Rank 0 builds the default corpus if missing; every rank waits (one barrier)."""
    import torch

    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not dist or torch.distributed.get_rank() == 0:
        prefix = default_corpus_prefix(build=True)
    if dist:
        torch.distributed.barrier()
        prefix = default_corpus_prefix(build=False)
    return prefix


def build_gpt_datasets(args, train_samples: int):
    """Build (train, valid, test) GPTDatasets from ``args`` (valid/test are None)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if args.data_path:
        blend = (list(args.data_path), None) if len(args.data_path) == 1 else _parse_blend(args.data_path)
    else:
        blend = ([ensure_default_corpus()], None)
    cache = args.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(blend[0][0])), "cache")
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        split="100,0,0",
        path_to_cache=cache,
        tokenizer=ByteLevelTokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, [train_samples, 0, 0], lambda: True, config).build()


def _parse_blend(paths: List[str]):
    weights, prefixes = paths[0::2], paths[1::2]
    return prefixes, [float(w) for w in weights]


def pretraining_batches(dataset, consumed_samples: int, micro_batch_size: int,
                        data_parallel_rank: int, data_parallel_size: int) -> Iterator[dict]:
    """Megatron-LM's MegatronPretrainingSampler order, collated; no RNG, no DataLoader.

    Global micro-batch j covers samples ``[j*mbs*dp, (j+1)*mbs*dp)``; this DP rank takes
    its contiguous ``mbs`` slice. Starts at ``consumed_samples``; drops the last partial batch.
    """
    import torch

    total = len(dataset)
    step = micro_batch_size * data_parallel_size
    start = consumed_samples
    while start + step <= total:
        lo = start + data_parallel_rank * micro_batch_size
        items = [dataset[i] for i in range(lo, lo + micro_batch_size)]
        yield {k: torch.stack([torch.as_tensor(it[k]) for it in items]) for k in items[0]}
        start += step


def build_train_iterator(dataset, consumed_samples: int, args) -> Optional[Iterator[dict]]:
    from megatron.core import parallel_state

    if dataset is None:
        return None
    return pretraining_batches(dataset, consumed_samples, args.micro_batch_size,
                               parallel_state.get_data_parallel_rank(),
                               parallel_state.get_data_parallel_world_size())


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="text file -> Megatron indexed dataset (byte-level)")
    p.add_argument("--input", required=True)
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--split-lines", action="store_true", help="one document per line (default: paragraphs)")
    a = p.parse_args(argv)
    prefix = build_from_text_file(a.input, a.output_prefix, a.split_lines)
    print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
