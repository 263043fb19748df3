"""Fault injector: kill or fail a rank at a named point of a named iteration.

Configured by the environment so that it reaches every rank started by a launcher::

    MINDSPEED_HA_INJECT="rank=1,iteration=3,point=backward,fault=kill"

Points (where in iteration ``k`` the fault fires):
    ``forward``     first micro-batch forward of iteration k
    ``backward``    backward through the first micro-batch output of iteration k
    ``grad_sync``   DDP gradient synchronisation of iteration k
    ``optimizer``   inside the optimizer update of iteration k (after begin_update)
    ``between``     after iteration k completed, before k+1 starts
    ``data``        where this rank fetches a training batch of iteration k (Megatron-LM's
                    ``get_batch_on_this_tp_rank``; ranks of the first and last PP stage)
    ``eval``        first forward step of the evaluation after iteration k (``--eval-interval``)
    ``save``        inside the periodic checkpoint save of iteration k, at its first barrier:
                    this rank's files are written, the tracker is not (a half-written save)
    ``final_save``  the same inside the final save at the end of training (iteration k)
    ``dying``       while this rank writes its part of a dying checkpoint
Faults: ``kill`` (SIGKILL to itself: the process vanishes, nothing runs after),
``raise`` (raise :class:`InjectedFault`, a RuntimeError carrying a gloo-like message),
``stop`` (SIGSTOP to itself: a hang; every thread stops, heartbeats included, the
process and its connections stay; it goes on only if someone sends SIGCONT),
``term`` (SIGTERM to itself: a preempted worker), ``term_launcher`` / ``int_launcher`` /
``kill_launcher`` (SIGTERM / SIGINT / SIGKILL to its parent process, the launcher: a
preempted job / Ctrl-C / a lost controller host; the rank itself goes on),
``corrupt`` (silent data corruption of this rank's state, then training goes on; only at
the points the runtime fires with its state: ``optimizer``, ``between``, ``dying``)::

    MINDSPEED_HA_INJECT="rank=0,iteration=2,point=between,fault=corrupt,what=exp_avg,how=bitflip"

``what``: ``param`` (a model parameter), ``main_param`` / ``exp_avg`` / ``exp_avg_sq`` (the
fp32 main parameter / Adam state of the first parameter this rank's distributed-optimizer
shard holds); ``how``: ``nan`` (one value becomes NaN, default) or ``bitflip`` (the lowest
bit of one value flips: still finite, only a checksum sees it). The value changed is the
first element of the tensor.
Several specs may be joined with ``;``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Any, List, Optional

ENV = "MINDSPEED_HA_INJECT"
ENV_LOG = "MINDSPEED_HA_INJECT_LOG"  # optional: append a JSON line per fired fault
POINTS = ("forward", "backward", "grad_sync", "optimizer", "between", "data", "eval", "save", "final_save",
          "dying")
FAULTS = ("kill", "raise", "stop", "corrupt", "term", "term_launcher", "int_launcher", "kill_launcher")
#: faults that signal a process and let this rank go on: SIGTERM to itself (a preempted
#: worker), SIGTERM to its parent, the launcher (a preempted job), SIGKILL to the launcher
#: (the controller's host lost; the workers stay)
_SIGNALS = {"term": ("self", "SIGTERM"), "term_launcher": ("parent", "SIGTERM"),
            "int_launcher": ("parent", "SIGINT"), "kill_launcher": ("parent", "SIGKILL")}
CORRUPT_WHAT = ("param", "main_param", "exp_avg", "exp_avg_sq")
CORRUPT_HOW = ("nan", "bitflip")
CORRUPT_POINTS = ("optimizer", "between", "dying")  # fired by the runtime, with its state


class InjectedFault(RuntimeError):
    """Raised by ``fault=raise``."""


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    iteration: int
    point: str
    fault: str = "kill"
    what: str = ""
    how: str = ""

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
        unknown = set(fields) - {"rank", "iteration", "point", "fault", "what", "how"}
        if unknown:
            raise ValueError(f"{ENV}: unknown field(s) {sorted(unknown)}; accepted: rank, iteration, point, "
                             "fault, what, how")
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
        if fault != "corrupt":
            if what or how:
                raise ValueError(f"{ENV}: what= and how= go with fault=corrupt only, got {text!r}")
            return cls(rank, iteration, point, fault)
        how = how or "nan"
        if what not in CORRUPT_WHAT:
            raise ValueError(f"{ENV}: fault=corrupt needs what= one of {CORRUPT_WHAT}, got {what!r}")
        if how not in CORRUPT_HOW:
            raise ValueError(f"{ENV}: how={how!r} not in {CORRUPT_HOW}")
        if point not in CORRUPT_POINTS:
            raise ValueError(f"{ENV}: fault=corrupt fires only at points {CORRUPT_POINTS}, got {point!r}")
        return cls(rank, iteration, point, fault, what, how)


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

    def fire(self, point: str, iteration: int, target: Any = None) -> None:
        """Fire the fault armed for ``point`` of ``iteration``, if any.

        ``target``: the rank's state (an object with ``model`` and ``optimizer``, e.g. the
        runtime's ``DyingContext``), needed by ``fault=corrupt``.
        """
        spec = self.armed(point, iteration)
        if spec is None:
            return
        msg = f"mindspeed-ha injector: {spec.fault} rank {self.rank} at {point} of iteration {iteration}"
        if spec.fault == "corrupt":
            msg += f": {corrupt(target, spec.what, spec.how)}"
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
        if spec.fault == "corrupt":
            return  # silent: training goes on with the corrupted state
        if spec.fault in _SIGNALS:
            who, sig = _SIGNALS[spec.fault]
            os.kill(os.getpid() if who == "self" else os.getppid(), getattr(signal, sig))
            return  # the signal's receiver acts; this rank goes on
        raise InjectedFault(f"{msg} (Connection closed by peer [injected])")


def _target_tensor(target: Any, what: str):
    """The tensor ``what`` names in ``target``'s model / optimizer (see the module docstring)."""
    if target is None:
        raise RuntimeError("fault=corrupt: no model/optimizer to corrupt yet (fires after the first train_step)")
    from mindspeed_ha.integrations import megatron_lm

    chunks = megatron_lm.unwrap_model(target.model)
    chunks = chunks if isinstance(chunks, list) else [chunks]
    params = [p for chunk in chunks for _, p in sorted(chunk.named_parameters())]
    if what == "param":
        return params[0]
    from mindspeed_ha.dying import _unwrap_distributed_optimizer

    opt = _unwrap_distributed_optimizer(target.optimizer)
    if opt is None:
        raise RuntimeError(f"fault=corrupt,what={what} needs the distributed optimizer")
    key = "param" if what == "main_param" else what
    for p in params:
        if p in opt.model_param_group_index_map:
            return opt._get_main_param_and_optimizer_states(p)[key]
    raise RuntimeError(f"fault=corrupt,what={what}: this rank's shard holds no parameter")


def corrupt(target: Any, what: str, how: str) -> str:
    """Corrupt the first element of the tensor ``what`` of ``target`` in place; describe it."""
    import torch

    t = _target_tensor(target, what)
    flat = t.data.view(-1)
    before = float(flat[0])
    with torch.no_grad():
        if how == "nan":
            flat[0] = float("nan")
        else:
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
            flat[:1].view(ints).bitwise_xor_(1)
    return f"{what} {tuple(t.shape)} {t.dtype}: element 0 {before!r} -> {float(flat[0])!r} ({how})"
