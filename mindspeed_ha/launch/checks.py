"""What ``mindspeed-ha-run`` checks before anything starts: its own environment (before torch
is imported), torchrun's numeric flags, ``--save``. Each bad value raises one
:class:`~mindspeed_ha.errors.ConfigError` naming the flag or variable and the accepted
range; the launcher prints it as one line and exits 2. (The HA flags and job settings are
``HAConfig``'s: :func:`mindspeed_ha.config.validate_ha_args`.)
"""

from __future__ import annotations

import math
import os

from mindspeed_ha import env as ha_env
from mindspeed_ha.errors import ConfigError
from mindspeed_ha.launch import report

#: seconds the survivors of a failure get to finish the dying checkpoint (default 600)
ENV_GRACE = ha_env.DYING_GRACE_S
#: the longest grace for the dying checkpoint, seconds (a day)
MAX_GRACE_S = 86400.0
#: ``MINDSPEED_HA_LOG``: the ``logging`` level names (any case); the first five are the usual ones
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "WARN", "FATAL", "NOTSET")


def grace_s() -> float:
    """``MINDSPEED_HA_DYING_GRACE_S``, seconds in (0, ``MAX_GRACE_S``], default 600.

    Raises:
        ConfigError: not a number, or out of range (NaN and inf too).
    """
    raw = os.environ.get(ENV_GRACE, "").strip() or "600"
    try:
        grace = float(raw)
    except ValueError:
        grace = -1.0
    if not 0 < grace <= MAX_GRACE_S:  # NaN fails too
        raise ConfigError(f"{ENV_GRACE}={raw!r}: accepted range (0, {MAX_GRACE_S:.0f}] seconds (default 600)")
    return grace


def log_level() -> str:
    """``MINDSPEED_HA_LOG``, a ``logging`` level name, default INFO.

    Raises:
        ConfigError: not one of :data:`LOG_LEVELS`.
    """
    raw = os.environ.get(ha_env.LOG, "").strip()
    if not raw:
        return "INFO"
    if raw.upper() not in LOG_LEVELS:
        raise ConfigError(f"{ha_env.LOG}={raw!r}: accepted {'|'.join(LOG_LEVELS[:5])} (any case; default INFO)")
    return raw.upper()


def check_switch(name: str) -> None:
    """``name`` is unset, 0 or 1.

    Raises:
        ConfigError: any other value.
    """
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ConfigError(f"{name}={raw!r}: accepted 0 or 1 (unset: 0)")


def check_env() -> None:
    """The launcher's own environment variables, checked before torch is imported and before
    anything starts (the HA job settings of ``HAConfig`` are checked later, with the flags).

    Raises:
        ConfigError: naming the variable and the accepted values.
    """
    from mindspeed_ha.control.lease import lease_seconds
    from mindspeed_ha.patches.registry import check_disabled

    log_level()
    grace_s()
    if os.environ.get(ha_env.REPORT):
        report.check_path(os.environ[ha_env.REPORT], ha_env.REPORT)
    try:
        lease_seconds()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_switch(ha_env.WARM_SPARES)
    check_switch(ha_env.FORKSERVER)
    from mindspeed_ha.forkserver import preload_names

    try:
        preload_names(os.environ.get(ha_env.FORKSERVER_PRELOAD))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_switch(ha_env.CPU_BACKEND)
    relay = os.environ.get(ha_env.RELAY, "").strip()
    if relay not in ("", "0", "1"):  # the launcher sets the workers' own value (its relay's socket)
        raise ConfigError(f"{ha_env.RELAY}={relay!r}: accepted 0 (every worker connects to the controller itself) "
                          "or 1 (unset: 1, the node relay)")
    check_disabled()
    if os.environ.get(ha_env.INJECT):  # a bad test spec: say so once, before 4 tracebacks
        from mindspeed_ha.faultspec import parse_env

        try:
            parse_env(os.environ[ha_env.INJECT])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def check_save_writable(save: str) -> None:
    """--save must be a directory we can create or write, checked without creating it.

    Raises:
        ConfigError: naming --save.
    """
    path = os.path.abspath(save)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--save {save!r} is not a writable directory ({path!r} is not a writable directory)")


def nnodes(targs) -> int:
    """The most nodes of ``--nnodes`` (``N`` or ``MIN:MAX``; checked by :func:`check_torchrun_args`)."""
    return int(str(targs.nnodes).split(":")[-1])


def nproc(targs) -> int:
    """``--nproc-per-node`` as a number (torchrun's reading of ``auto``/``cpu``/``gpu``/...).

    Raises:
        ConfigError: neither an integer >= 1 nor a device name torch resolves here.
    """
    from torch.distributed.run import determine_local_world_size

    raw = targs.nproc_per_node
    try:
        n = int(determine_local_world_size(str(raw)))
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"--nproc-per-node={raw!r}: accepted an integer >= 1, or auto|cpu|gpu|xpu ({exc})") from None
    if n < 1:
        raise ConfigError(f"--nproc-per-node={raw!r}: accepted an integer >= 1, or auto|cpu|gpu|xpu")
    return n


def check_torchrun_args(targs) -> None:
    """torchrun's numeric flags, which torchrun itself reads with a traceback or not at all:
    ``--nnodes`` (``N`` or ``MIN:MAX``, 1 <= MIN <= MAX), ``--nproc-per-node``,
    ``--node-rank`` (0 <= rank < nodes), ``--master-port`` (0..65535), ``--max-restarts``
    (>= 0), ``--monitor-interval`` (finite seconds > 0).

    Raises:
        ConfigError: naming the flag and the accepted range.
    """
    parts = str(targs.nnodes).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise ConfigError(f"--nnodes={targs.nnodes!r}: accepted N or MIN:MAX, integers with 1 <= MIN <= MAX")
    nproc(targs)
    if not 0 <= int(targs.node_rank) < hi:
        raise ConfigError(f"--node-rank={targs.node_rank}: accepted range 0..{hi - 1} (--nnodes {targs.nnodes})")
    if targs.master_port is not None and not 0 <= int(targs.master_port) <= 65535:
        raise ConfigError(f"--master-port={targs.master_port}: accepted range 0..65535")
    if int(targs.max_restarts) < 0:
        raise ConfigError(f"--max-restarts={targs.max_restarts}: accepted integers >= 0")
    interval = float(targs.monitor_interval)
    if not (math.isfinite(interval) and interval > 0):
        raise ConfigError(f"--monitor-interval={targs.monitor_interval}: accepted finite seconds > 0")
