"""``torch_npu.npu`` / ``torch.npu`` of the CPU test double: no device present."""

import contextlib

import torch


def is_available():
    return False


def device_count():
    return 0


def current_device():
    return 0


def set_device(device):
    return None


def synchronize(device=None):
    return None


def _lazy_call(fn, **kwargs):
    return fn()


def manual_seed(seed):
    torch.manual_seed(seed)


def manual_seed_all(seed):
    torch.manual_seed(seed)


def get_device_name(device=None):
    return "cpu-test-double"


class device(contextlib.ContextDecorator):
    def __init__(self, device):
        self.idx = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def __getattr__(name):
    if name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        return lambda *a, **k: 0
    return getattr(torch.cuda, name)
