"""Sub-health detector settings: the ``--ha-subhealth*`` flags, validated (torch-free).

The detector (docs/ARCHITECTURE.md, "Sub-health detector") flags a rank that is alive but
degraded: slower than its peers or than itself, or whose device counters drift. Samplers
run in each rank's processor (:mod:`mindspeed_ha.control.subhealth_sampler`), the decision
is a pure function in the controller (:mod:`mindspeed_ha.control.policy.subhealth`), and the
controller applies it (:mod:`mindspeed_ha.control.subhealth_monitor`).

Defaults follow the reference's slow-node detector as issue 18 summarises MindIO TFT /
ClusterD (Ascend mind-cluster ``component/mindio/tft``): 30 s windows, 3 consecutive
degraded windows, 30% degradation, 3 sigma, escalation when the same fault repeats 2-3
times in 24 h, and "many ranks at once within a window is not hardware".

Actions, weakest first (:data:`ACTIONS`): ``log`` (one log line), ``event`` (and a
``Subhealth`` job event and metric), ``check`` (and the operator's online check of the
rank), ``switch`` (and the operator's hot switch of the rank to a spare), ``exit`` (and the
graceful stop: the checkpoint of the last completed iteration, exit 75). Default
``event``: enforcement is opt-in.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Tuple

from mindspeed_ha.errors import ConfigError

#: what a flagged rank gets, weakest first
ACTIONS = ("log", "event", "check", "switch", "exit")
#: the signals the detector scores (see :data:`mindspeed_ha.control.policy.subhealth.SIGNALS`)
SIGNAL_NAMES = ("step", "sm_clock_mhz", "temperature_c", "ecc_corrected", "throttle")

DEFAULT_WINDOW_S = 30.0
MIN_WINDOW_S, MAX_WINDOW_S = 0.1, 3600.0
DEFAULT_WINDOWS = 3
MAX_WINDOWS = 100
DEFAULT_DEGRADATION = 0.3
MAX_DEGRADATION = 10.0
DEFAULT_SIGMA = 3.0
MAX_SIGMA = 100.0
DEFAULT_MANY = 0.5
DEFAULT_ESCALATE = 3
MAX_ESCALATE = 100
DEFAULT_ACTION = "event"
#: seconds over which repeats of the same fault escalate (the reference's 24 h)
ESCALATION_WINDOW_S = 24 * 3600.0


def parse_actions(spec: Any, flag: str = "--ha-subhealth-action") -> Tuple[str, Tuple[Tuple[str, str], ...]]:
    """``ACTION`` or ``[ACTION,]SIGNAL=ACTION,...`` -> (default action, per-signal overrides).

    Raises:
        ConfigError: naming ``flag``, the accepted actions and signals.
    """
    default, per = DEFAULT_ACTION, []
    accepted = f"accepted: ACTION or SIGNAL=ACTION,... with ACTION in {'|'.join(ACTIONS)}, SIGNAL in " \
               f"{'|'.join(SIGNAL_NAMES)}"
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{flag}={spec!r}: {accepted}")
    for item in spec.split(","):
        name, sep, action = (p.strip() for p in item.partition("="))
        if not sep:
            name, action = "", name
        if action not in ACTIONS or (sep and name not in SIGNAL_NAMES):
            raise ConfigError(f"{flag}={spec!r}: {item.strip()!r} is not valid; {accepted}")
        if sep:
            per.append((name, action))
        else:
            default = action
    return default, tuple(per)


@dataclasses.dataclass(frozen=True)
class SubhealthSettings:
    """The detector's settings (each field: its flag, unit and accepted range; checked at
    construction, the message names the flag)."""

    enabled: bool = False
    """``--ha-subhealth``: sample and score every rank (off by default)."""
    window_s: float = DEFAULT_WINDOW_S
    """``--ha-subhealth-window``: seconds per scoring window; [0.1, 3600]."""
    windows: int = DEFAULT_WINDOWS
    """``--ha-subhealth-windows``: consecutive degraded windows before a rank is flagged (and
    healthy ones before the flag is cleared); 1..100."""
    degradation: float = DEFAULT_DEGRADATION
    """``--ha-subhealth-degradation``: how much worse than its reference a value must be, as a
    fraction (0.3: 30% slower); (0, 10]."""
    sigma: float = DEFAULT_SIGMA
    """``--ha-subhealth-sigma``: and beyond this many standard deviations of the reference
    sample; [0, 100] (0: the rule is off)."""
    many: float = DEFAULT_MANY
    """``--ha-subhealth-many``: more than this fraction of the ranks degraded in one window
    (and at least 2) is a cluster-wide slowdown (a data or storage stall), not hardware:
    nobody is flagged; (0, 1]."""
    action: str = DEFAULT_ACTION
    """``--ha-subhealth-action``: what a flag does, one of :data:`ACTIONS` (default ``event``)."""
    signal_actions: Tuple[Tuple[str, str], ...] = ()
    """Per-signal overrides of ``action`` (``--ha-subhealth-action step=switch,...``)."""
    escalate_after: int = DEFAULT_ESCALATE
    """``--ha-subhealth-escalate``: the same (rank, signal) flagged this many times within
    24 h escalates to ``escalate_action``; 0..100 (0: never)."""
    escalate_action: str = DEFAULT_ACTION
    """``--ha-subhealth-escalate-action``: the escalated action, one of :data:`ACTIONS`."""

    def __post_init__(self) -> None:
        checks = (
            ("--ha-subhealth-window", self.window_s, f"[{MIN_WINDOW_S:g}, {MAX_WINDOW_S:g}] seconds",
             lambda v: MIN_WINDOW_S <= v <= MAX_WINDOW_S),
            ("--ha-subhealth-windows", self.windows, f"integers 1..{MAX_WINDOWS}", lambda v: 1 <= v <= MAX_WINDOWS),
            ("--ha-subhealth-degradation", self.degradation, f"(0, {MAX_DEGRADATION:g}]",
             lambda v: 0 < v <= MAX_DEGRADATION),
            ("--ha-subhealth-sigma", self.sigma, f"[0, {MAX_SIGMA:g}] (0: off)", lambda v: 0 <= v <= MAX_SIGMA),
            ("--ha-subhealth-many", self.many, "(0, 1]", lambda v: 0 < v <= 1),
            ("--ha-subhealth-escalate", self.escalate_after, f"integers 0..{MAX_ESCALATE} (0: never)",
             lambda v: 0 <= v <= MAX_ESCALATE),
        )
        for flag, value, accepted, ok in checks:
            integral = accepted.startswith("integers")
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or (integral and not isinstance(value, int))
                    or not math.isfinite(value) or not ok(value)):
                raise ConfigError(f"{flag}={value!r}: accepted range {accepted}")
        for flag, value in (("--ha-subhealth-action", self.action),
                            ("--ha-subhealth-escalate-action", self.escalate_action)):
            if value not in ACTIONS:
                raise ConfigError(f"{flag}={value!r}: accepted {'|'.join(ACTIONS)}")

    def action_for(self, signal: str) -> str:
        """The configured action of ``signal`` (its override, else ``action``)."""
        return dict(self.signal_actions).get(signal, self.action)

    def to_argv(self) -> list:
        """The flags that give these settings (for a controller started as its own process)."""
        if not self.enabled:
            return []
        action = ",".join([self.action] + [f"{s}={a}" for s, a in self.signal_actions])
        return ["--ha-subhealth", "--ha-subhealth-window", repr(self.window_s), "--ha-subhealth-windows",
                str(self.windows), "--ha-subhealth-degradation", repr(self.degradation), "--ha-subhealth-sigma",
                repr(self.sigma), "--ha-subhealth-many", repr(self.many), "--ha-subhealth-action", action,
                "--ha-subhealth-escalate", str(self.escalate_after), "--ha-subhealth-escalate-action",
                self.escalate_action]

    @classmethod
    def from_args(cls, args: Any) -> "SubhealthSettings":
        """From the parsed flags (missing attributes: defaults).

        Raises:
            ConfigError: naming the flag and the accepted range.
        """
        def get(name: str, default: Any) -> Any:
            value = getattr(args, name, None) if args is not None else None
            return default if value is None else value

        action, per = parse_actions(get("ha_subhealth_action", DEFAULT_ACTION))
        escalate = get("ha_subhealth_escalate_action", DEFAULT_ACTION)
        if escalate not in ACTIONS:
            raise ConfigError(f"--ha-subhealth-escalate-action={escalate!r}: accepted {'|'.join(ACTIONS)}")
        return cls(enabled=bool(get("ha_subhealth", False)), window_s=get("ha_subhealth_window", DEFAULT_WINDOW_S),
                   windows=get("ha_subhealth_windows", DEFAULT_WINDOWS),
                   degradation=get("ha_subhealth_degradation", DEFAULT_DEGRADATION),
                   sigma=get("ha_subhealth_sigma", DEFAULT_SIGMA), many=get("ha_subhealth_many", DEFAULT_MANY),
                   action=action, signal_actions=per, escalate_after=get("ha_subhealth_escalate", DEFAULT_ESCALATE),
                   escalate_action=escalate)


def add_arguments(g: Any) -> None:
    """Add the ``--ha-subhealth*`` flags to argument group ``g`` (defaults None: "not given")."""
    g.add_argument("--ha-subhealth", action="store_true", default=None,
                   help="Sub-health detector: score every rank's own step time and device counters over windows "
                        "and flag a degraded rank (default action: log + event).")
    g.add_argument("--ha-subhealth-window", type=float, default=None,
                   help=f"Seconds per scoring window, [{MIN_WINDOW_S:g}, {MAX_WINDOW_S:g}] (default {DEFAULT_WINDOW_S:g}).")
    g.add_argument("--ha-subhealth-windows", type=int, default=None,
                   help=f"Consecutive degraded windows before a rank is flagged, 1..{MAX_WINDOWS} "
                        f"(default {DEFAULT_WINDOWS}).")
    g.add_argument("--ha-subhealth-degradation", type=float, default=None,
                   help=f"Degradation against the reference, a fraction in (0, {MAX_DEGRADATION:g}] "
                        f"(default {DEFAULT_DEGRADATION:g}: 30%%).")
    g.add_argument("--ha-subhealth-sigma", type=float, default=None,
                   help=f"And beyond this many standard deviations, [0, {MAX_SIGMA:g}] (default {DEFAULT_SIGMA:g}; 0: off).")
    g.add_argument("--ha-subhealth-many", type=float, default=None,
                   help=f"More than this fraction of ranks degraded at once is a cluster-wide slowdown, not "
                        f"hardware, (0, 1] (default {DEFAULT_MANY:g}).")
    g.add_argument("--ha-subhealth-action", type=str, default=None,
                   help=f"What a flag does: ACTION or SIGNAL=ACTION,... ACTION {'|'.join(ACTIONS)}, SIGNAL "
                        f"{'|'.join(SIGNAL_NAMES)} (default {DEFAULT_ACTION}).")
    g.add_argument("--ha-subhealth-escalate", type=int, default=None,
                   help=f"The same rank and signal flagged this many times in 24 h escalates, 0..{MAX_ESCALATE} "
                        f"(default {DEFAULT_ESCALATE}; 0: never).")
    g.add_argument("--ha-subhealth-escalate-action", type=str, default=None,
                   help=f"The escalated action, {'|'.join(ACTIONS)} (default {DEFAULT_ACTION}).")


__all__ = ["ACTIONS", "SIGNAL_NAMES", "ESCALATION_WINDOW_S", "SubhealthSettings", "add_arguments", "parse_actions"]
