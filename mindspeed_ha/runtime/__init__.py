"""The per-rank HA runtime: the one object the patches talk to (one per process).

Modules:
    :mod:`.core`       :class:`HARuntime` and its step protocol (the call order is in its docstring)
    :mod:`.state`      :class:`StepState`, the step's recovery state shared with the recovery stages
    :mod:`.fault_report` :class:`FaultReport`, what the runtime keeps of each fault it reported
    :mod:`.bootstrap`  start-up: layout, auth key, controller, processor, fallback group
    :mod:`.actions`    the dying checkpoint's action handlers (processor action thread)
    :mod:`.exits`      exit status, GOODBYE at exit, SIGTERM / SIGINT as a graceful stop

The recovery itself (plans of stages) is in :mod:`mindspeed_ha.recovery.stages` and
:mod:`mindspeed_ha.recovery.executor`.
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional

from .core import EXCHANGE_BYTES, HARuntime  # noqa: F401
from .exits import record_exit_status  # noqa: F401
from .fault_report import FaultReport  # noqa: F401

_runtime: Optional[HARuntime] = None
_lock = threading.Lock()

#: called with every runtime :func:`configure` creates, in order (e.g. the fault
#: injector of feature ``testing`` attaches itself here: :mod:`mindspeed_ha.patches.testing`)
CONFIGURE_HOOKS: List[Callable[[HARuntime], None]] = []


def get_runtime() -> Optional[HARuntime]:
    """The process's runtime, or None before the arguments patch configured it."""
    return _runtime


def configure(config, args) -> HARuntime:
    """Create the process's runtime from the parsed Megatron ``args`` (called by the
    arguments patch), then run :data:`CONFIGURE_HOOKS` on it."""
    global _runtime
    with _lock:
        _runtime = HARuntime(config, args, get_runtime=get_runtime)
    for hook in list(CONFIGURE_HOOKS):
        hook(_runtime)
    return _runtime


def reset() -> None:
    """Forget the runtime (tests)."""
    global _runtime
    with _lock:
        if _runtime is not None:
            _runtime.close()
        _runtime = None
