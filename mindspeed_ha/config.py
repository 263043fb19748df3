"""HAConfig: the one configuration object, built from Megatron's args and the environment.

Megatron's argparse ``Namespace`` is read once, at setup, by :meth:`HAConfig.from_args`;
nothing else in mindspeed-ha reads ``get_args()``. This module imports neither torch
nor megatron, so the controller can build its config in the launcher process.

Precedence (one rule for every setting): **environment > command-line flag > default.**
The environment wins because it is what the cluster (Kubernetes pod spec, the
``mindspeed-ha-run`` launcher, the reference's ``TTP_ADDR`` export) sets per job and
per node; flags are the fallback for plain ``torchrun`` runs.

=================================  ==========================================  ===============
setting                            sources, highest first                      default
=================================  ==========================================  ===============
controller_addr                    ``CONTROLLER_ADDR`` > ``TTP_ADDR`` >         ``127.0.0.1``
                                   ``--ha-controller-addr``
processor_addr                     ``PROCESSOR_ADDR``                          ``None``
controller_port                    ``TTP_PORT`` > ``--ha-controller-port``     ``8000``
heartbeat_interval_s               ``MINDSPEED_HA_HEARTBEAT_INTERVAL`` >       ``1.0``
                                   ``--ha-heartbeat-interval``
heartbeat_timeout_s                ``MINDSPEED_HA_HEARTBEAT_TIMEOUT`` >        ``10.0``
                                   ``--ha-heartbeat-timeout``
stop_timeout_s                     ``MINDSPEED_HA_STOP_TIMEOUT`` >             ``30.0``
                                   ``--ha-stop-timeout``
action_timeout_s                   ``MINDSPEED_HA_ACTION_TIMEOUT`` >           ``600.0``
                                   ``--ha-action-timeout``
connect_timeout_s                  ``MINDSPEED_HA_CONNECT_TIMEOUT`` >          ``60.0``
                                   ``--ha-connect-timeout``
preemption_deadline_s              ``MINDSPEED_HA_PREEMPTION_DEADLINE`` >      ``20.0``
                                   ``--ha-preemption-deadline``
max_message_bytes                  ``MINDSPEED_HA_MAX_MESSAGE_BYTES``          ``1 MiB``
auth_key                           ``MINDSPEED_HA_AUTH_KEY`` (hex)             ``None``
network_retries                    ``--ha-network-retries``                    ``3``
events_file                        ``--ha-events-file``                        ``None``
metrics_port                       ``--ha-metrics-port``                       ``None`` (off)
metrics_addr                       ``--ha-metrics-addr``                       ``127.0.0.1``
subhealth                          ``--ha-subhealth*`` (see ``subhealth.py``)  off
=================================  ==========================================  ===============

Addresses: ``TTP_ADDR`` must be an IPv4 or IPv6 literal (the reference's contract);
``CONTROLLER_ADDR``, ``PROCESSOR_ADDR`` and ``--ha-controller-addr`` accept an IP
literal or an RFC 1123 host name (pod DNS names are common in Kubernetes; the
processor resolves them when it connects, the controller binds to the resolved
interface).

Errors: every invalid value raises :class:`ConfigError` whose message names the flag
or environment variable and the accepted range.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
import re
from typing import Any, Mapping, Optional

from mindspeed_ha import env as ha_env
from mindspeed_ha.errors import ConfigError  # noqa: F401  (re-exported: callers import it from here)
from mindspeed_ha.subhealth import SubhealthSettings, add_arguments as add_subhealth_arguments

ENV_CONTROLLER_ADDR = ha_env.CONTROLLER_ADDR
ENV_TTP_ADDR = ha_env.TTP_ADDR
ENV_PROCESSOR_ADDR = ha_env.PROCESSOR_ADDR
ENV_TTP_PORT = ha_env.TTP_PORT
ENV_HEARTBEAT_INTERVAL = ha_env.HEARTBEAT_INTERVAL
ENV_HEARTBEAT_TIMEOUT = ha_env.HEARTBEAT_TIMEOUT
ENV_STOP_TIMEOUT = ha_env.STOP_TIMEOUT
ENV_ACTION_TIMEOUT = ha_env.ACTION_TIMEOUT
ENV_CONNECT_TIMEOUT = ha_env.CONNECT_TIMEOUT
ENV_PREEMPTION_DEADLINE = ha_env.PREEMPTION_DEADLINE
ENV_MAX_MESSAGE_BYTES = ha_env.MAX_MESSAGE_BYTES
ENV_AUTH_KEY = ha_env.AUTH_KEY
ENV_NO_CUDA_CACHING = ha_env.NO_CUDA_CACHING
ENV_NO_NPU_CACHING = ha_env.NO_NPU_CACHING

DEFAULT_CONTROLLER_ADDR = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_REPLICA_COUNT = 2
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
DEFAULT_STOP_TIMEOUT_S = 30.0
DEFAULT_ACTION_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 60.0
#: graceful stop (SIGTERM/SIGINT): seconds from the signal to the committed checkpoint. Well
#: under the 30 s a scheduler usually grants between SIGTERM and SIGKILL (Kubernetes'
#: terminationGracePeriodSeconds default; Slurm's KillWait default is 30 s too).
DEFAULT_PREEMPTION_DEADLINE_S = 20.0
MAX_PREEMPTION_DEADLINE_S = 3600.0
#: in-place retries of one iteration after network faults (``--ha-network-retries``), then the dying checkpoint
DEFAULT_NETWORK_RETRIES = 3
MAX_NETWORK_RETRIES = 100
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
MIN_AUTH_KEY_BYTES = 16
#: where --ha-metrics-port binds unless --ha-metrics-addr says otherwise: this host only
DEFAULT_METRICS_ADDR = "127.0.0.1"

_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")


def _check_ip(value: str, source: str) -> str:
    try:
        return str(ipaddress.ip_address(value.strip().strip("[]")))
    except ValueError:
        raise ConfigError(
            f"{source}={value!r} is not an IPv4 or IPv6 address literal (e.g. 10.0.0.1 or fd00::1)"
        ) from None


def _check_host(value: str, source: str) -> str:
    value = value.strip()
    try:
        return str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        pass
    if _HOSTNAME.match(value) and not value.replace(".", "").isdigit():
        return value
    raise ConfigError(f"{source}={value!r} is neither an IPv4/IPv6 literal nor a valid host name")


def _env_float(env: Mapping[str, str], name: str, flag: Optional[str], flag_value: Any, default: float) -> float:
    source, raw = (name, env[name]) if env.get(name) not in (None, "") else (flag, flag_value)
    if raw is None:
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}={raw!r} is not a number (seconds, > 0)") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{source}={raw!r} must be a finite number of seconds > 0")
    return value


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if args is not None else default


@dataclasses.dataclass(frozen=True)
class HAConfig:
    """Validated HA settings of one job. Immutable; build with :meth:`from_args` (a copy
    with other values: ``dataclasses.replace``, which validates again).

    Each field's docstring names its unit, its sources (highest first, see the module's
    precedence table) and its accepted range; :meth:`__post_init__` enforces the ranges.
    """

    enabled: bool = False
    """``--enable-high-availability``: the master switch (dying checkpoint, optimizer replicas,
    the controller). The three switches below require it."""
    hbm_repair: bool = False
    """``--enable-hbmfault-repair``: repair a device memory UCE online (needs the framework's
    caching allocator: ``PYTORCH_NO_CUDA_MEMORY_CACHING`` / ``PYTORCH_NO_NPU_MEMORY_CACHING``
    unset)."""
    worker_reboot: bool = False
    """``--enable-worker-reboot``: ARF, restart only the failed workers and continue."""
    no_replica: bool = False
    """``--distributed-optimizer-no-replica``: no optimizer replicas (forces ``replica_count``
    1); a repair reloads the latest periodic checkpoint instead."""
    distributed_optimizer: bool = False
    """Megatron's ``--use-distributed-optimizer`` (optimizer state sharded over DP)."""
    replica_count: int = DEFAULT_REPLICA_COUNT
    """N, copies of each distributed-optimizer shard: ``--ha-replica-count`` > 1 with
    ``no_replica`` > 2. Integer >= 1 that divides the DP size (checked by
    :func:`validate_ha_args`); meaningful only with the distributed optimizer (a
    non-distributed one holds the full state on every DP rank)."""
    controller_addr: str = DEFAULT_CONTROLLER_ADDR
    """Where the controller listens: ``CONTROLLER_ADDR`` (IP or host name) > ``TTP_ADDR``
    (IP literal) > ``--ha-controller-addr`` (IP or host name) > ``127.0.0.1``."""
    processor_addr: Optional[str] = None
    """This rank's own address (pod network) from ``PROCESSOR_ADDR``, IP or host name, or None
    when unset. Validated, informational: no module acts on it today."""
    controller_port: int = DEFAULT_PORT
    """Controller TCP port: ``TTP_PORT`` > ``--ha-controller-port`` > 8000; range 0..65535
    (0: ``mindspeed-ha-run`` binds a free port and exports it in ``TTP_PORT``)."""
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    """Processor heartbeat period, seconds: ``MINDSPEED_HA_HEARTBEAT_INTERVAL`` >
    ``--ha-heartbeat-interval`` > 1.0; finite, > 0."""
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    """Silence after which the controller counts a rank lost, seconds:
    ``MINDSPEED_HA_HEARTBEAT_TIMEOUT`` > ``--ha-heartbeat-timeout`` > 10.0; finite and at
    least 2 x ``heartbeat_interval_s`` (one lost heartbeat is not a death)."""
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    """How long the STOP round waits for STOPPED replies, seconds:
    ``MINDSPEED_HA_STOP_TIMEOUT`` > ``--ha-stop-timeout`` > 30.0; finite, > 0."""
    action_timeout_s: float = DEFAULT_ACTION_TIMEOUT_S
    """Deadline of one action (DUMP / ASSEMBLE / COMMIT, a repair), seconds:
    ``MINDSPEED_HA_ACTION_TIMEOUT`` > ``--ha-action-timeout`` > 600.0; finite, > 0."""
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    """How long a processor tries to register with the controller, seconds:
    ``MINDSPEED_HA_CONNECT_TIMEOUT`` > ``--ha-connect-timeout`` > 60.0; finite, > 0
    (generous for slow nodes)."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Cap on one control message, bytes: ``MINDSPEED_HA_MAX_MESSAGE_BYTES`` > 1 MiB;
    range 4096..67108864."""
    preemption_deadline_s: float = DEFAULT_PREEMPTION_DEADLINE_S
    """Graceful stop (SIGTERM/SIGINT to the launcher or to a worker): seconds from the signal
    until the checkpoint must be committed. ``MINDSPEED_HA_PREEMPTION_DEADLINE`` >
    ``--ha-preemption-deadline`` > 20.0; range (0, 3600]. The first half is for every rank
    to finish its current iteration (past it the iteration is abandoned and the last one
    every rank completed is saved); past the whole deadline the save is abandoned (EXIT 77:
    nothing published, tracker untouched) and the launcher ends what is left."""
    network_retries: int = DEFAULT_NETWORK_RETRIES
    """In-place retries of one iteration after network faults: ``--ha-network-retries`` > 3;
    range 0..100 (0: a network fault ends in the dying checkpoint)."""
    auth_key: Optional[bytes] = dataclasses.field(default=None, repr=False)
    """The job's HMAC key (CURVE keys derive from it too): ``MINDSPEED_HA_AUTH_KEY``, hex, at
    least 16 bytes. None until the launcher or the runtime provides one; never printed."""
    save_dir: Optional[str] = None
    """Megatron's ``--save``, where a dying checkpoint goes (None: none can be written)."""
    events_file: Optional[str] = None
    """``--ha-events-file``: the JSON-lines file the controller appends the job's events to
    (:mod:`mindspeed_ha.control.job_events`), or None (no file). Its directory must exist on
    the controller's host (:func:`mindspeed_ha.control.job_events.check_events_file`); an existing path must be a regular
    file (appended to, never through a symbolic link)."""
    metrics_port: Optional[int] = None
    """``--ha-metrics-port``: the controller's HTTP port for ``/metrics`` (Prometheus),
    ``/healthz``, ``/readyz``, ``/status`` (:mod:`mindspeed_ha.control.http_status`); range
    0..65535 (0: any free port, announced in the log and the events file); None: off."""
    metrics_addr: str = DEFAULT_METRICS_ADDR
    """``--ha-metrics-addr``: the address the metrics port binds (IP literal or host name);
    default ``127.0.0.1`` (this host only)."""
    subhealth: SubhealthSettings = dataclasses.field(default_factory=SubhealthSettings)
    """The sub-health detector's ``--ha-subhealth*`` flags (:class:`mindspeed_ha.subhealth.SubhealthSettings`)."""

    def __post_init__(self) -> None:
        if not self.enabled:
            for flag, on in (
                ("--enable-hbmfault-repair", self.hbm_repair),
                ("--enable-worker-reboot", self.worker_reboot),
                ("--distributed-optimizer-no-replica", self.no_replica),
            ):
                if on:
                    raise ConfigError(f"{flag} requires --enable-high-availability")
        if not isinstance(self.network_retries, int) or not 0 <= self.network_retries <= MAX_NETWORK_RETRIES:
            raise ConfigError(f"--ha-network-retries={self.network_retries!r}: accepted range 0..{MAX_NETWORK_RETRIES} "
                              f"(default {DEFAULT_NETWORK_RETRIES}; 0: a network fault ends in the dying checkpoint)")
        if not isinstance(self.replica_count, int) or self.replica_count < 1:
            raise ConfigError(f"--ha-replica-count={self.replica_count!r}: accepted values are integers >= 1")
        if self.no_replica and self.replica_count != 1:
            raise ConfigError(
                f"--distributed-optimizer-no-replica forces --ha-replica-count=1 (got {self.replica_count})"
            )
        if not isinstance(self.controller_port, int) or not 0 <= self.controller_port <= 65535:
            raise ConfigError(
                f"--ha-controller-port / {ENV_TTP_PORT}={self.controller_port!r}: accepted range 0..65535 "
                f"(0: mindspeed-ha-run picks a free port)"
            )
        for name, env in (
            ("heartbeat_interval_s", ENV_HEARTBEAT_INTERVAL),
            ("heartbeat_timeout_s", ENV_HEARTBEAT_TIMEOUT),
            ("stop_timeout_s", ENV_STOP_TIMEOUT),
            ("action_timeout_s", ENV_ACTION_TIMEOUT),
            ("connect_timeout_s", ENV_CONNECT_TIMEOUT),
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{env}={value!r}: must be a finite number of seconds > 0")
        d = self.preemption_deadline_s
        if not isinstance(d, (int, float)) or not math.isfinite(d) or not 0 < d <= MAX_PREEMPTION_DEADLINE_S:
            raise ConfigError(f"--ha-preemption-deadline / {ENV_PREEMPTION_DEADLINE}={d!r}: accepted range "
                              f"(0, {MAX_PREEMPTION_DEADLINE_S:.0f}] seconds (default {DEFAULT_PREEMPTION_DEADLINE_S})")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ConfigError(
                f"{ENV_HEARTBEAT_TIMEOUT}={self.heartbeat_timeout_s} must be >= 2 x "
                f"{ENV_HEARTBEAT_INTERVAL}={self.heartbeat_interval_s} (one lost heartbeat is not a death)"
            )
        if not isinstance(self.max_message_bytes, int) or not 4096 <= self.max_message_bytes <= (64 << 20):
            raise ConfigError(f"{ENV_MAX_MESSAGE_BYTES}={self.max_message_bytes!r}: accepted range 4096..67108864")
        if self.metrics_port is not None and (
                isinstance(self.metrics_port, bool) or not isinstance(self.metrics_port, int)
                or not 0 <= self.metrics_port <= 65535):
            raise ConfigError(f"--ha-metrics-port={self.metrics_port!r}: accepted range 0..65535 (0: any free port)")
        if self.events_file is not None and (not isinstance(self.events_file, str) or not self.events_file.strip()):
            raise ConfigError(f"--ha-events-file={self.events_file!r}: accepted a file path (its directory must exist)")
        if self.auth_key is not None and (
            not isinstance(self.auth_key, bytes) or len(self.auth_key) < MIN_AUTH_KEY_BYTES
        ):
            raise ConfigError(f"{ENV_AUTH_KEY}: the key must be at least {MIN_AUTH_KEY_BYTES} bytes")

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_args(cls, args: Any = None, env: Optional[Mapping[str, str]] = None) -> "HAConfig":
        """Build the config from Megatron's parsed args and the environment.

        Args:
            args: argparse ``Namespace`` (missing attributes take defaults), or None.
            env: environment mapping; ``os.environ`` when None.

        Raises:
            ConfigError: on any invalid setting (message names flag/env and range).
        """
        env = os.environ if env is None else env
        enabled = bool(_arg(args, "enable_high_availability", False))
        hbm_repair = bool(_arg(args, "enable_hbmfault_repair", False))
        no_replica = bool(_arg(args, "distributed_optimizer_no_replica", False))
        replica_count = _arg(args, "ha_replica_count", None)
        if replica_count is None:
            replica_count = 1 if no_replica else DEFAULT_REPLICA_COUNT
        elif no_replica and replica_count != 1:
            raise ConfigError(
                f"--distributed-optimizer-no-replica forces --ha-replica-count=1 (got {replica_count})"
            )
        if hbm_repair:
            check_caching_allocator(env)
        return cls(
            enabled=enabled,
            hbm_repair=hbm_repair,
            worker_reboot=bool(_arg(args, "enable_worker_reboot", False)),
            no_replica=no_replica,
            distributed_optimizer=bool(_arg(args, "use_distributed_optimizer", False)),
            replica_count=replica_count,
            controller_addr=controller_addr_from(args, env),
            processor_addr=(
                _check_host(env[ENV_PROCESSOR_ADDR], ENV_PROCESSOR_ADDR) if env.get(ENV_PROCESSOR_ADDR) else None
            ),
            controller_port=port_from(args, env),
            heartbeat_interval_s=_env_float(
                env, ENV_HEARTBEAT_INTERVAL, "--ha-heartbeat-interval",
                _arg(args, "ha_heartbeat_interval"), DEFAULT_HEARTBEAT_INTERVAL_S),
            heartbeat_timeout_s=_env_float(
                env, ENV_HEARTBEAT_TIMEOUT, "--ha-heartbeat-timeout",
                _arg(args, "ha_heartbeat_timeout"), DEFAULT_HEARTBEAT_TIMEOUT_S),
            stop_timeout_s=_env_float(
                env, ENV_STOP_TIMEOUT, "--ha-stop-timeout", _arg(args, "ha_stop_timeout"), DEFAULT_STOP_TIMEOUT_S),
            action_timeout_s=_env_float(
                env, ENV_ACTION_TIMEOUT, "--ha-action-timeout",
                _arg(args, "ha_action_timeout"), DEFAULT_ACTION_TIMEOUT_S),
            connect_timeout_s=_env_float(
                env, ENV_CONNECT_TIMEOUT, "--ha-connect-timeout",
                _arg(args, "ha_connect_timeout"), DEFAULT_CONNECT_TIMEOUT_S),
            max_message_bytes=_int_env(env, ENV_MAX_MESSAGE_BYTES, DEFAULT_MAX_MESSAGE_BYTES, "4096..67108864"),
            preemption_deadline_s=_preemption_deadline(args, env),
            network_retries=_network_retries(args),
            auth_key=auth_key_from(env),
            save_dir=_arg(args, "save", None) or None,
            events_file=_arg(args, "ha_events_file", None),
            metrics_port=_arg(args, "ha_metrics_port", None),
            metrics_addr=_check_host(_arg(args, "ha_metrics_addr", None) or DEFAULT_METRICS_ADDR, "--ha-metrics-addr"),
            subhealth=SubhealthSettings.from_args(args),
        )


def _network_retries(args: Any) -> int:
    """``--ha-network-retries``: in-place retries of one iteration after network faults."""
    raw = _arg(args, "ha_network_retries", None)
    if raw is None:
        return DEFAULT_NETWORK_RETRIES
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(f"--ha-network-retries={raw!r}: accepted range 0..{MAX_NETWORK_RETRIES}")
    return raw


def _preemption_deadline(args: Any, env: Mapping[str, str]) -> float:
    """``MINDSPEED_HA_PREEMPTION_DEADLINE`` > ``--ha-preemption-deadline`` > 20 s; range (0, 3600].

    Raises:
        ConfigError: not a number, or outside the range (the message names the source).
    """
    source, raw = ((ENV_PREEMPTION_DEADLINE, env[ENV_PREEMPTION_DEADLINE])
                   if env.get(ENV_PREEMPTION_DEADLINE) not in (None, "")
                   else ("--ha-preemption-deadline", _arg(args, "ha_preemption_deadline")))
    if raw is None:
        return DEFAULT_PREEMPTION_DEADLINE_S
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not math.isfinite(value) or not 0 < value <= MAX_PREEMPTION_DEADLINE_S:
        raise ConfigError(f"{source}={raw!r}: accepted range (0, {MAX_PREEMPTION_DEADLINE_S:.0f}] seconds "
                          f"(default {DEFAULT_PREEMPTION_DEADLINE_S})")
    return value


def _int_env(env: Mapping[str, str], name: str, default: int, accepted: str) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer (accepted range {accepted})") from None


def controller_addr_from(args: Any, env: Mapping[str, str]) -> str:
    """Controller address: ``CONTROLLER_ADDR`` > ``TTP_ADDR`` > ``--ha-controller-addr`` > 127.0.0.1.

    Raises:
        ConfigError: ``TTP_ADDR`` set but empty or not an IP literal; any other
            source not an IP literal nor a host name.
    """
    if env.get(ENV_CONTROLLER_ADDR):
        return _check_host(env[ENV_CONTROLLER_ADDR], ENV_CONTROLLER_ADDR)
    if ENV_TTP_ADDR in env:
        if not env[ENV_TTP_ADDR].strip():
            raise ConfigError(f"{ENV_TTP_ADDR} is set but empty: export the controller's IPv4 or IPv6 address")
        return _check_ip(env[ENV_TTP_ADDR], ENV_TTP_ADDR)
    flag = _arg(args, "ha_controller_addr")
    if flag:
        return _check_host(flag, "--ha-controller-addr")
    return DEFAULT_CONTROLLER_ADDR


def port_from(args: Any, env: Mapping[str, str]) -> int:
    """Controller port: ``TTP_PORT`` > ``--ha-controller-port`` > 8000, range 0..65535.

    0 asks ``mindspeed-ha-run`` to bind a free port and pass it to the workers in
    ``TTP_PORT``; without the launcher the runtime rejects it.
    """
    source, raw = (ENV_TTP_PORT, env[ENV_TTP_PORT]) if env.get(ENV_TTP_PORT) else (
        "--ha-controller-port", _arg(args, "ha_controller_port"))
    if raw is None:
        return DEFAULT_PORT
    try:
        port = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}={raw!r} is not an integer port (accepted range 0..65535)") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{source}={raw!r} is out of range (accepted range 0..65535; 0: the launcher picks)")
    return port


def auth_key_from(env: Mapping[str, str]) -> Optional[bytes]:
    """The job's HMAC key from ``MINDSPEED_HA_AUTH_KEY`` (hex), or None if unset."""
    raw = env.get(ENV_AUTH_KEY)
    if not raw:
        return None
    try:
        key = bytes.fromhex(raw.strip())
    except ValueError:
        raise ConfigError(f"{ENV_AUTH_KEY} must be hex-encoded (e.g. from secrets.token_hex(32))") from None
    if len(key) < MIN_AUTH_KEY_BYTES:
        raise ConfigError(f"{ENV_AUTH_KEY} must encode at least {MIN_AUTH_KEY_BYTES} bytes (got {len(key)})")
    return key


def check_caching_allocator(env: Mapping[str, str]) -> None:
    """Raise if the framework's caching allocator is disabled (UCE repair needs it)."""
    if env.get(ENV_NO_CUDA_CACHING, "") not in ("", "0"):
        raise ConfigError(
            f"--enable-hbmfault-repair needs the CUDA caching allocator: unset {ENV_NO_CUDA_CACHING} (or set it to 0)"
        )
    if ENV_NO_NPU_CACHING in env:
        raise ConfigError(f"--enable-hbmfault-repair needs the NPU caching allocator: unset {ENV_NO_NPU_CACHING}")


def add_ha_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the HA flags to ``parser`` in an argument group "high availability".

    Defaults that have an environment override are None here so that
    :meth:`HAConfig.from_args` can tell "not given" from "given".
    """
    g = parser.add_argument_group(title="high availability")
    g.add_argument("--enable-high-availability", action="store_true",
                   help="Master switch: dying checkpoint on unrecoverable faults, optimizer replicas.")
    g.add_argument("--enable-hbmfault-repair", action="store_true",
                   help="Repair device memory uncorrectable errors (UCE) online. Needs the master switch.")
    g.add_argument("--enable-worker-reboot", action="store_true",
                   help="Restart only failed workers and continue (ARF). Needs the master switch.")
    g.add_argument("--ha-network-retries", type=int, default=None,
                   help=f"In-place retries of one iteration after network faults, 0..{MAX_NETWORK_RETRIES} (default "
                        f"{DEFAULT_NETWORK_RETRIES}); past them, or with 0, the dying checkpoint.")
    g.add_argument("--distributed-optimizer-no-replica", action="store_true",
                   help="No optimizer replicas (N = 1); repairs reload the latest periodic checkpoint.")
    g.add_argument("--ha-replica-count", type=int, default=None,
                   help=f"Replicas N of each distributed-optimizer shard (default {DEFAULT_REPLICA_COUNT}); "
                        "DP size must be divisible by N.")
    g.add_argument("--ha-controller-addr", type=str, default=None,
                   help=f"Controller address; env {ENV_CONTROLLER_ADDR} > {ENV_TTP_ADDR} > this flag > "
                        f"{DEFAULT_CONTROLLER_ADDR}.")
    g.add_argument("--ha-controller-port", type=int, default=None,
                   help=f"Controller port (1..65535, or 0: mindspeed-ha-run picks a free one); "
                        f"env {ENV_TTP_PORT} > this flag > {DEFAULT_PORT}.")
    g.add_argument("--ha-heartbeat-interval", type=float, default=None,
                   help=f"Heartbeat period, s (env {ENV_HEARTBEAT_INTERVAL}; default {DEFAULT_HEARTBEAT_INTERVAL_S}).")
    g.add_argument("--ha-heartbeat-timeout", type=float, default=None,
                   help=f"Silence before a rank is dead, s (env {ENV_HEARTBEAT_TIMEOUT}; "
                        f"default {DEFAULT_HEARTBEAT_TIMEOUT_S}).")
    g.add_argument("--ha-stop-timeout", type=float, default=None,
                   help=f"Wait for STOPPED replies, s (env {ENV_STOP_TIMEOUT}; default {DEFAULT_STOP_TIMEOUT_S}).")
    g.add_argument("--ha-action-timeout", type=float, default=None,
                   help=f"Deadline of a save/assemble/commit step, s (env {ENV_ACTION_TIMEOUT}; "
                        f"default {DEFAULT_ACTION_TIMEOUT_S}).")
    g.add_argument("--ha-connect-timeout", type=float, default=None,
                   help=f"Deadline for a rank to register with the controller, s (env {ENV_CONNECT_TIMEOUT}; "
                        f"default {DEFAULT_CONNECT_TIMEOUT_S}; raise it for slow nodes).")
    g.add_argument("--ha-preemption-deadline", type=float, default=None,
                   help=f"Graceful stop on SIGTERM/SIGINT: seconds from the signal to the committed checkpoint "
                        f"(env {ENV_PREEMPTION_DEADLINE}; default {DEFAULT_PREEMPTION_DEADLINE_S}; range "
                        f"(0, {MAX_PREEMPTION_DEADLINE_S:.0f}]); past it the save is abandoned (exit 77).")
    g.add_argument("--ha-events-file", type=str, default=None,
                   help="Append the job's events (faults, recoveries, pauses, the dying checkpoint, exit) to this "
                        "JSON-lines file (read it with `mindspeed-ha events`); its directory must exist.")
    g.add_argument("--ha-metrics-port", type=int, default=None,
                   help="Serve /metrics (Prometheus), /healthz, /readyz and /status on this port of the "
                        "controller's host, 0..65535 (0: any free port; default: off).")
    g.add_argument("--ha-metrics-addr", type=str, default=None,
                   help=f"Address the metrics port binds (default {DEFAULT_METRICS_ADDR}: this host only).")
    add_subhealth_arguments(g)
    return parser


def _check_checkpoint_format(args: Any) -> None:
    """The dying checkpoint can be written in the run's ``--ckpt-format``: say so before
    training (the format's own check: :func:`mindspeed_ha.checkpoint.formats.check_args`).

    Raises:
        ConfigError: an unknown format, or one the format refuses for ``args``.
    """
    from mindspeed_ha.checkpoint.formats import check_args

    check_args(args)


def validate_ha_args(
    args: Any, world_size: int, tp: int, pp: int, cp: int = 1, env: Optional[Mapping[str, str]] = None
) -> HAConfig:
    """Check the HA flags against the parallel layout; return the built config.

    Args:
        args: Megatron's parsed args.
        world_size, tp, pp, cp: world size and tensor/pipeline/context parallel sizes.
        env: environment mapping (``os.environ`` when None).

    Returns:
        The :class:`HAConfig` (its ``replica_count`` is the configured N; a
        non-distributed optimizer holds the state on all d data-parallel ranks).

    Raises:
        ConfigError: naming the offending flag/env var and the accepted values.
    """
    env = os.environ if env is None else env
    cfg = HAConfig.from_args(args, env)
    if not cfg.enabled:
        return cfg
    _check_checkpoint_format(args)
    model_parallel = tp * pp * cp
    if model_parallel <= 0 or world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}"
        )
    d = world_size // model_parallel
    explicit_n = _arg(args, "ha_replica_count", None)
    if not cfg.distributed_optimizer:
        if explicit_n is not None and explicit_n != d:
            raise ConfigError(
                f"--ha-replica-count={explicit_n} requires --use-distributed-optimizer: a non-distributed "
                f"optimizer already holds the full state on all d={d} data-parallel ranks"
            )
        return cfg
    n = cfg.replica_count
    if n > d or d % n:
        accepted = [k for k in range(1, d + 1) if d % k == 0]
        raise ConfigError(
            f"--ha-replica-count={n} must divide the data-parallel size d={d} "
            f"(world {world_size} / (tp {tp} * pp {pp} * cp {cp})); accepted values: {accepted}"
        )
    _check_replica_layout_flags(args, n)
    return cfg


def _check_replica_layout_flags(args: Any, n: int) -> None:
    """Refuse the Megatron-LM flags under which ``n`` optimizer replicas cannot be what
    HA runs and reports (docs/ARCHITECTURE.md "Replicas": every other initialization,
    RNG and data-order flag is bitwise neutral).

    Raises:
        ConfigError: ``--num-distributed-optimizer-instances`` other than 1 or ``n`` (HA
            sets it to ``n``: a different value would be overridden); ``--use-custom-fsdp``
            with ``n`` > 1 (megatron-core 0.12.1 ``optimizer/__init__.py``
            ``get_megatron_optimizer``, l.483-516: custom FSDP builds its distributed
            optimizer over the full DP group and ignores the instances, so no shard would
            have a replica).
    """
    instances = _arg(args, "num_distributed_optimizer_instances", 1) or 1
    if instances not in (1, n):
        raise ConfigError(
            f"--num-distributed-optimizer-instances={instances} with --enable-high-availability: HA sets "
            f"the optimizer instances to the replica count (--ha-replica-count={n}); "
            f"give --ha-replica-count {instances} instead, or leave the flag at 1"
        )
    if n > 1 and _arg(args, "use_custom_fsdp", False):
        raise ConfigError(
            f"--use-custom-fsdp with --ha-replica-count={n}: megatron-core's custom FSDP shards the "
            "optimizer over the whole data-parallel group, so there are no optimizer replicas; "
            "use --distributed-optimizer-no-replica (--ha-replica-count 1) or Megatron's DDP"
        )
