"""The fault-injection spec language (``MINDSPEED_HA_INJECT``), parsed without torch.

``rank=R,iteration=K,point=P[,fault=F][,what=W][,how=H][,sleep=S][,incarnation=N]``, several joined
with ``;``. The injector in :mod:`mindspeed_ha.testing.injector` fires the specs inside the
training processes; the launcher parses them once before starting any (so that a bad spec
is one clear error, not a traceback per rank). Imports nothing but the standard library.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

from mindspeed_ha import env as ha_env

ENV = ha_env.INJECT
POINTS = ("forward", "backward", "grad_sync", "optimizer", "between", "data", "eval", "save", "final_save",
          "dying", "pp", "tp", "recover", "check", "handoff")
FAULTS = ("kill", "raise", "stop", "corrupt", "term", "term_launcher", "int_launcher", "kill_launcher", "uce",
          "network", "kill_node", "stop_launcher", "hold", "slow")
#: faults that signal a process and let this rank go on: SIGTERM to itself (a preempted
#: worker), SIGTERM to its parent, the launcher (a preempted job), SIGKILL to the launcher
#: (the controller's host lost; the workers stay)
SIGNALS = {"term": ("self", "SIGTERM"), "term_launcher": ("parent", "SIGTERM"),
            "int_launcher": ("parent", "SIGINT"), "kill_launcher": ("parent", "SIGKILL"),
            "stop_launcher": ("parent", "SIGSTOP")}
CORRUPT_WHAT = ("param", "main_param", "exp_avg", "exp_avg_sq", "gemm")
CORRUPT_HOW = ("nan", "bitflip")
CORRUPT_POINTS = ("optimizer", "between", "dying", "check")  # fired by the runtime, with its state
#: ``point=check`` (the online check, ``mindspeed-ha check``): ``iteration`` counts the checks this
#: process ran (1: the first), ``what=gemm`` flips a bit of the check's GEMM result (a test double)
CHECK_WHAT = ("gemm",)
#: ``point=handoff`` (a hot switch's outgoing rank, between the state and the progress it sends
#: its new process): ``iteration`` counts the handoffs this process made (1: its first and only:
#: it exits after it)
UCE_WHAT = ("param", "grad", "main_param", "exp_avg", "exp_avg_sq")
UCE_POINTS = ("forward", "backward", "optimizer", "between")
NETWORK_POINTS = ("grad_sync", "pp", "tp")
#: ``fault=slow,sleep=S``: this rank sleeps S seconds at the point of every iteration from K on
#: (a sub-health straggler); S in (0, MAX_SLEEP_S]
SLOW_POINTS = ("forward", "backward", "optimizer", "between")
MAX_SLEEP_S = 60.0
#: points only ``fault=network`` fires at (through the communication hook)
NETWORK_ONLY_POINTS = ("pp", "tp")


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    iteration: int
    point: str
    fault: str = "kill"
    what: str = ""
    how: str = ""
    incarnation: int = 0
    sleep: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        """Parse ``"rank=R,iteration=K,point=P[,fault=F][,incarnation=N]"``.

        ``incarnation`` (default 0): the spec fires only in that process of the rank
        (``MINDSPEED_HA_INCARNATION``; a process the launcher restarted has 1, 2, ...), so
        a rank restarted after a fault does not fire it again.

        Raises:
            ValueError: naming the field and the accepted values.
        """
        fields = {}
        for item in text.split(","):
            if not item.strip():
                continue
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"{ENV}: expected key=value, got {item!r}")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"rank", "iteration", "point", "fault", "what", "how", "incarnation", "sleep"}
        if unknown:
            raise ValueError(f"{ENV}: unknown field(s) {sorted(unknown)}; accepted: rank, iteration, point, "
                             "fault, what, how, sleep, incarnation")
        sleep = _sleep(fields.pop("sleep", None), fields.get("fault"), fields.get("point", "forward"), text)
        try:
            incarnation = int(fields.pop("incarnation", "0"))
        except ValueError:
            raise ValueError(f"{ENV}: incarnation must be an integer >= 0, got {text!r}") from None
        if incarnation < 0:
            raise ValueError(f"{ENV}: incarnation must be an integer >= 0, got {text!r}")
        return dataclasses.replace(cls._parse(text, fields), incarnation=incarnation, sleep=sleep)

    @classmethod
    def _parse(cls, text: str, fields: dict) -> "FaultSpec":
        try:
            rank, iteration = int(fields["rank"]), int(fields["iteration"])
        except KeyError as exc:
            raise ValueError(f"{ENV}: field {exc.args[0]!r} is required") from None
        except ValueError:
            raise ValueError(f"{ENV}: rank and iteration must be integers, got {text!r}") from None
        point, fault = fields.get("point", "forward"), fields.get("fault", "kill")
        if point not in POINTS:
            raise ValueError(f"{ENV}: point={point!r} not in {POINTS}")
        if fault not in FAULTS:
            raise ValueError(f"{ENV}: fault={fault!r} not in {FAULTS}")
        if rank < 0 or iteration < 1:
            raise ValueError(f"{ENV}: rank must be >= 0 and iteration >= 1, got {text!r}")
        what, how = fields.get("what", ""), fields.get("how", "")
        if fault == "uce":
            if how:
                raise ValueError(f"{ENV}: how= goes with fault=corrupt only, got {text!r}")
            what = what or "param"
            if what not in UCE_WHAT:
                raise ValueError(f"{ENV}: fault=uce takes what= one of {UCE_WHAT}, got {what!r}")
            if point not in UCE_POINTS:
                raise ValueError(f"{ENV}: fault=uce fires only at points {UCE_POINTS}, got point={point!r}")
            return cls(rank, iteration, point, fault, what)
        if fault == "network" and point not in NETWORK_POINTS:
            raise ValueError(f"{ENV}: fault=network fires only at points {NETWORK_POINTS}, got point={point!r}")
        if point in NETWORK_ONLY_POINTS and fault != "network":
            raise ValueError(f"{ENV}: point={point!r} takes fault=network only, got fault={fault!r}")
        if point == "check" and fault != "corrupt":
            raise ValueError(f"{ENV}: point=check takes fault=corrupt,what=gemm only, got fault={fault!r}")
        if fault != "corrupt":
            if what or how:
                raise ValueError(f"{ENV}: what= and how= go with fault=corrupt only (what= with fault=uce "
                                 f"too), got {text!r}")
            return cls(rank, iteration, point, fault)
        how = how or "nan"
        if what not in CORRUPT_WHAT:
            raise ValueError(f"{ENV}: fault=corrupt needs what= one of {CORRUPT_WHAT}, got {what!r}")
        if how not in CORRUPT_HOW:
            raise ValueError(f"{ENV}: how={how!r} not in {CORRUPT_HOW}")
        if point not in CORRUPT_POINTS:
            raise ValueError(f"{ENV}: fault=corrupt fires only at points {CORRUPT_POINTS}, got {point!r}")
        if (point == "check") != (what in CHECK_WHAT):
            raise ValueError(f"{ENV}: point=check goes with what=gemm (and what=gemm with point=check), got {text!r}")
        return cls(rank, iteration, point, fault, what, how)


def _sleep(raw: Optional[str], fault: Optional[str], point: str, text: str) -> float:
    """``sleep=S`` of ``fault=slow`` (required there, refused elsewhere)."""
    if fault != "slow":
        if raw is not None:
            raise ValueError(f"{ENV}: sleep= goes with fault=slow only, got {text!r}")
        return 0.0
    if point not in SLOW_POINTS:
        raise ValueError(f"{ENV}: fault=slow fires only at points {SLOW_POINTS}, got point={point!r}")
    try:
        value = float(raw) if raw is not None else float("nan")
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_SLEEP_S:  # NaN fails too
        raise ValueError(f"{ENV}: fault=slow needs sleep= seconds in (0, {MAX_SLEEP_S:g}], got {text!r}")
    return value


def parse_env(value: Optional[str]) -> List[FaultSpec]:
    if not value:
        return []
    return [FaultSpec.parse(part) for part in value.split(";") if part.strip()]
