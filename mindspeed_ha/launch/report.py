"""How a ``mindspeed-ha-run`` job ends: its exit status, its closing line, and the
controller's report as JSON (``MINDSPEED_HA_REPORT``).

The report's keys are a contract (the demo, the benchmarks, :mod:`mindspeed_ha.phases`
and the tests read them): ``phase``, ``exit_code``, ``reason``, ``iteration``,
``fault_rank``, ``fault_kind``, ``stop_request``, ``phase_seconds``, ``fault_wall``,
``exit_wall``, ``events``, ``recoveries``, ``restarts``. Every ``*_wall`` / ``t_wall`` is
``time.time()`` seconds (the controller's clock moved onto the wall clock).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Iterable

from mindspeed_ha import env as ha_env
from mindspeed_ha import faults

#: the controller's verdicts, which only follow from a worker's own failure
_HA_CODES = (faults.EXIT_NO_COMPLETE_DATA, faults.EXIT_FAULT_UNRECOVERABLE, faults.EXIT_CONTROLLER_LOST)


def exit_code(codes: Iterable[int]) -> int:
    """The job's exit status from the workers' (signals are negative).

    75 when the dying checkpoint was saved; 79 when training never started (start-up or
    ``--load`` failed: the workers' own errors are that failure); otherwise a worker's own
    error (a plain non-zero exit, e.g. a traceback) wins over the controller's 76/77/78
    verdicts, which only follow from it; 1 when none of these.
    """
    codes = set(codes)
    if faults.EXIT_DYING_CHECKPOINT_SAVED in codes:
        return faults.EXIT_DYING_CHECKPOINT_SAVED
    if faults.EXIT_FAILED_BEFORE_TRAINING in codes:  # start-up / --load failed: the errors are that
        return faults.EXIT_FAILED_BEFORE_TRAINING
    own = sorted(c for c in codes if c > 0 and c not in _HA_CODES)
    if own:
        return own[0]
    for c in _HA_CODES:
        if c in codes:
            return c
    return 1


def outcome_text(controller, code: int) -> str:
    """The launcher's last line for a job that ended with ``code`` (what happened, and
    how to continue when a checkpoint was written)."""
    if controller is None:
        return f"workers failed (exit {code}); the controller runs on another node"
    o = controller.outcome()
    req = o.stop_request
    if req is not None and o.fault_rank is None:
        if code == faults.EXIT_DYING_CHECKPOINT_SAVED:
            return (f"graceful stop ({req.reason}); {o.reason}. Rerun the same command with --load to continue "
                    f"from iteration {o.iteration}.")
        return f"graceful stop ({req.reason}) ended with exit {code}: {o.reason or o.phase.value}"
    if code == faults.EXIT_DYING_CHECKPOINT_SAVED:
        return (f"rank {o.fault_rank} failed ({o.fault_kind.value if o.fault_kind else 'fault'}); {o.reason}. "
                f"Rerun the same command with --load to continue from iteration {o.iteration}.")
    return f"workers failed (exit {code}); controller: {o.reason or o.phase.value}"


def _json_or_text(detail: str):
    try:
        return json.loads(detail)
    except ValueError:
        return detail


def report(controller) -> dict:
    """The controller's outcome as the report's JSON-able dict (times in seconds)."""
    o = controller.outcome()
    to_wall = time.time() - controller.clock()  # controller clock -> wall clock
    fault_at = None if o.fault_rank is None else controller.state.fault.at
    first = {}
    for e in o.events:
        first.setdefault(e.action.value, e.t)
    return {
        "phase": o.phase.value, "exit_code": o.exit_code, "reason": o.reason, "iteration": o.iteration,
        "fault_rank": o.fault_rank, "fault_kind": o.fault_kind.value if o.fault_kind else None,
        "stop_request": None if o.stop_request is None else {
            "rank": o.stop_request.rank, "reason": o.stop_request.reason, "t_wall": o.stop_request.at + to_wall},
        "phase_seconds": o.timings,
        "fault_wall": None if fault_at is None else fault_at + to_wall,
        "exit_wall": None if "exit" not in first else first["exit"] + to_wall,
        "events": [{"t_wall": e.t + to_wall, "phase": e.phase.value, "action": e.action.value, "reason": e.reason}
                   for e in o.events],
        # in-place recoveries: controller times as wall clock, each rank's RETRY result (its stage seconds)
        "recoveries": [dict({k: v for k, v in r.items() if not k.endswith("_at")},
                            **{k.replace("_at", "_wall"): (None if v is None else v + to_wall)
                               for k, v in r.items() if k.endswith("_at")},
                            ranks={str(rank): _json_or_text(d) for rank, d in r["ranks"].items()})
                       for r in o.recoveries],
        # --enable-worker-reboot: each restart of a worker (rank, incarnation, new pid, previous exit code)
        "restarts": [dict({k: v for k, v in r.items() if k != "at"}, t_wall=r["at"] + to_wall) for r in o.restarts],
    }


def check_path(path: str, source: str) -> None:
    """``path`` can be written as a report file: not a directory, in an existing writable
    directory (checked at start-up, creating nothing).

    Raises:
        ConfigError: naming ``source`` (the variable or flag) and what is accepted.
    """
    from mindspeed_ha.errors import ConfigError

    parent = os.path.dirname(os.path.abspath(path)) if path else ""
    if not path or os.path.isdir(path):
        why = "empty" if not path else "a directory"
    elif not os.path.isdir(parent):
        why = f"{parent!r} is not a directory"
    elif not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        why = "not writable"
    else:
        return
    raise ConfigError(f"{source}={path!r}: {why}; accepted: a file path in an existing writable directory")


def write_report(controller) -> bool:
    """``MINDSPEED_HA_REPORT=FILE``: :func:`report` written to FILE (atomically: a
    temporary file renamed over it); nothing when the variable is unset.

    Returns:
        False when the file could not be written (a warning is logged; the job's exit
        status does not change: the report is about the job, not part of it), else True.
    """
    path = os.environ.get(ha_env.REPORT)
    if not path:
        return True
    tmp, opened = f"{path}.tmp", False
    try:
        with open(tmp, "w") as f:
            opened = True
            json.dump(report(controller), f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        if opened:  # ours and partial (e.g. ENOSPC)
            with contextlib.suppress(OSError):
                os.remove(tmp)
        logging.getLogger("mindspeed_ha.launcher").warning("%s=%s: the report could not be written (%s); the job's "
                                                           "exit status is unchanged", ha_env.REPORT, path, exc)
        return False
    return True
