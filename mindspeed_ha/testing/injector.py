"""Fault injector: kill or fail a rank at a named point of a named iteration.

Configured by the environment so that it reaches every rank started by a launcher::

    MINDSPEED_HA_INJECT="rank=1,iteration=3,point=backward,fault=kill"

Points (where in iteration ``k`` the fault fires):
    ``forward``     first micro-batch forward of iteration k
    ``backward``    backward through the first micro-batch output of iteration k
    ``grad_sync``   DDP gradient synchronisation of iteration k
    ``optimizer``   inside the optimizer update of iteration k (after begin_update)
    ``between``     after iteration k completed, before k+1 starts
    ``dying``       while this rank writes its part of a dying checkpoint
Faults: ``kill`` (SIGKILL to itself: the process vanishes, nothing runs after),
``raise`` (raise :class:`InjectedFault`, a RuntimeError carrying a gloo-like message),
``stop`` (SIGSTOP to itself: a hang; every thread stops, heartbeats included, the
process and its connections stay; it goes on only if someone sends SIGCONT).
Several specs may be joined with ``;``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import List, Optional

ENV = "MINDSPEED_HA_INJECT"
ENV_LOG = "MINDSPEED_HA_INJECT_LOG"  # optional: append a JSON line per fired fault
POINTS = ("forward", "backward", "grad_sync", "optimizer", "between", "dying")
FAULTS = ("kill", "raise", "stop")


class InjectedFault(RuntimeError):
    """Raised by ``fault=raise``."""


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    iteration: int
    point: str
    fault: str = "kill"

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        """Parse ``"rank=R,iteration=K,point=P[,fault=F]"``.

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
        unknown = set(fields) - {"rank", "iteration", "point", "fault"}
        if unknown:
            raise ValueError(f"{ENV}: unknown field(s) {sorted(unknown)}; accepted: rank, iteration, point, fault")
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
        return cls(rank, iteration, point, fault)


def parse_env(value: Optional[str]) -> List[FaultSpec]:
    if not value:
        return []
    return [FaultSpec.parse(part) for part in value.split(";") if part.strip()]


class Injector:
    """Fires the faults configured for this rank. Cheap when nothing is configured."""

    def __init__(self, rank: int, specs: List[FaultSpec]):
        self.rank = rank
        self.specs = [s for s in specs if s.rank == rank]

    @classmethod
    def from_env(cls, rank: int) -> "Injector":
        return cls(rank, parse_env(os.environ.get(ENV)))

    def armed(self, point: str, iteration: int) -> Optional[FaultSpec]:
        for s in self.specs:
            if s.point == point and s.iteration == iteration:
                return s
        return None

    def fire(self, point: str, iteration: int) -> None:
        spec = self.armed(point, iteration)
        if spec is None:
            return
        msg = f"mindspeed-ha injector: {spec.fault} rank {self.rank} at {point} of iteration {iteration}"
        print(msg, flush=True)
        log_path = os.environ.get(ENV_LOG)
        if log_path:  # when it happened, for recovery-time measurements (wall clock, seconds)
            import json
            import time

            with open(log_path, "a") as f:
                f.write(json.dumps({"rank": self.rank, "point": point, "iteration": iteration,
                                    "fault": spec.fault, "pid": os.getpid(), "wall": time.time()}) + "\n")
        if spec.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return  # continued (SIGCONT): the hang is over
        raise InjectedFault(f"{msg} (Connection closed by peer [injected])")
