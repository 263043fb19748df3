"""Phase tables: seconds per phase of one recovery, computed here and nowhere else.

Three tables, one per way a job survives a fault, each a pure function of what a faulty run
leaves behind (:class:`RunLogs`):

* :func:`dying_checkpoint_phases` (``--fault kill``: the job ends with a dying checkpoint):
  ``detect, decide, save, total``;
* :func:`in_place_phases` (UCE / network error recovered in the running processes):
  ``detect, stop, clean, rebuild, repair, rollback, first_iteration_after, total``;
* :func:`reboot_phases` (worker restart in place, ``--enable-worker-reboot``):
  ``detect, restart_process, rendezvous, rebuild_groups, repair, rollback,
  first_iteration_after, total``;

and two finer ones for the benchmarks: :func:`preemption_phases` (graceful stop:
``request, drain, save, commit``) and :func:`action_intervals` (the dying checkpoint's
actions: ``dump, assemble, commit``).

The demo (``mindspeed-ha demo``, its report's ``phase_seconds``) and every benchmark under
``scripts/`` print these tables; the README documents their keys. Inputs (their keys are
fixed): the controller's report (``MINDSPEED_HA_REPORT``: ``phase_seconds``, ``fault_wall``,
``exit_wall``, ``recoveries[i].{evidence_wall, abort_wall, retry_wall, ranks}``,
``restarts[i].t_wall``), the fault injector's log (``MINDSPEED_HA_INJECT_LOG``: one line per
fault fired, ``wall``) and the recovery log (``MINDSPEED_HA_RECOVERY_LOG``: one line per rank
when its re-run iteration is done: ``rank, pid, iteration, wall``). Every ``*_wall`` is
``time.time()`` seconds; every result is seconds, or None where an input is missing.
Imports nothing but the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional

Table = Dict[str, Optional[float]]

#: the keys of each table, in print order
DYING_CHECKPOINT_KEYS = ("detect", "decide", "save", "total")
PREEMPTION_KEYS = ("request", "drain", "save", "commit")
IN_PLACE_KEYS = ("detect", "stop", "clean", "rebuild", "repair", "rollback", "first_iteration_after", "total")
REBOOT_KEYS = ("detect", "restart_process", "rendezvous", "rebuild_groups", "repair", "rollback",
               "first_iteration_after", "total")


@dataclasses.dataclass(frozen=True)
class RunLogs:
    """What one faulty run left behind.

    Attributes:
        report: the controller's report ({} when it wrote none).
        injected: the injector's log lines, oldest first (one per fault fired).
        recovered: the recovery log lines (one per rank whose re-run iteration is done).
        nproc: the job's ranks, if known: :attr:`first_after_wall` then waits for all.
    """

    report: Mapping[str, Any]
    injected: List[Mapping[str, Any]]
    recovered: List[Mapping[str, Any]]
    nproc: Optional[int] = None

    @classmethod
    def read(cls, report: str, inject_log: str, recovery_log: Optional[str] = None,
             nproc: Optional[int] = None) -> "RunLogs":
        """Read the three files (an absent file reads as empty).

        Raises:
            ValueError: a file is not JSON / JSON lines.
        """
        rep = {}
        if os.path.exists(report):
            with open(report) as f:
                rep = json.load(f) or {}
        return cls(rep, read_jsonl(inject_log), read_jsonl(recovery_log) if recovery_log else [], nproc)

    @property
    def fault_wall(self) -> Optional[float]:
        """When the first fault fired (wall clock, s), or None if none fired."""
        return self.injected[0]["wall"] if self.injected else None

    @property
    def fault_pid(self) -> Optional[int]:
        """The process the first fault fired in, or None."""
        return int(self.injected[0]["pid"]) if self.injected and "pid" in self.injected[0] else None

    @property
    def first_after_wall(self) -> Optional[float]:
        """When the last rank finished its re-run iteration (wall clock, s); None until every
        rank (``nproc``, or any when unknown) has logged it."""
        if not self.recovered or (self.nproc is not None and len(self.recovered) < self.nproc):
            return None
        return max(e["wall"] for e in self.recovered)

    @property
    def pids_after(self) -> Dict[int, int]:
        """Global rank -> the process that finished its re-run iteration."""
        return {int(e["rank"]): int(e["pid"]) for e in self.recovered}

    @property
    def recoveries(self) -> List[Mapping[str, Any]]:
        """The controller's in-place recoveries (report ``recoveries``), oldest first."""
        return list(self.report.get("recoveries") or [])

    @property
    def restarts(self) -> List[Mapping[str, Any]]:
        """The worker restarts (report ``restarts``), oldest first."""
        return list(self.report.get("restarts") or [])


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    """Every JSON line of ``path`` ([] if absent; blank lines skipped).

    Raises:
        ValueError: a line is not JSON.
    """
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def slowest_stages(recovery: Mapping[str, Any], stages: Iterable[str]) -> Table:
    """Stage -> the slowest rank's seconds of that stage in one recovery (each rank's RETRY
    result, ``recoveries[i].ranks``), or None when no rank ran it. Ranks run their stages at
    the same time, so the slowest rank's is the stage's cost."""
    ranks = [d for d in (recovery.get("ranks") or {}).values() if isinstance(d, dict)]
    out: Table = {}
    for stage in stages:
        vals = [d[stage] for d in ranks if isinstance(d.get(stage), (int, float))]
        out[stage] = max(vals) if vals else None
    return out


def dying_checkpoint_phases(report: Optional[Mapping[str, Any]], kill_wall: Optional[float]) -> Table:
    """The dying-checkpoint table.

    detect: SIGKILL -> the controller has evidence (agent report / closed connection);
    decide: evidence -> DUMP sent (freeze every survivor, collect status, choose k and savers);
    save: DUMP -> EXIT sent (shards + model files, assembly, validation, rename, tracker);
    total: SIGKILL -> EXIT sent.
    """
    out: Table = {k: None for k in DYING_CHECKPOINT_KEYS}
    if not report:
        return out
    phases = report.get("phase_seconds") or {}
    if kill_wall is not None and report.get("fault_wall") is not None:
        out["detect"] = max(0.0, report["fault_wall"] - kill_wall)
    if phases.get("decide") is not None:
        out["decide"] = phases["decide"] + (phases.get("detect") or 0.0)
    out["save"] = phases.get("save")
    if kill_wall is not None and report.get("exit_wall") is not None:
        out["total"] = report["exit_wall"] - kill_wall
    return out


def in_place_phases(report: Optional[Mapping[str, Any]], fault_wall: Optional[float],
                    first_after_wall: Optional[float], *, split_stop: bool = False) -> Table:
    """The in-place table, of the first recovery in the controller's report.

    detect: fault raised -> the controller has the report; stop: -> every rank left its
    step and is parked (the plan is sent); clean / rebuild / repair / rollback: the slowest
    rank's stage (its RETRY result); first_iteration_after: plan sent -> the re-run
    iteration done on every rank (it contains those stages); total: fault -> that.

    ``split_stop``: ``stop`` given as its two parts instead, ``freeze`` (evidence -> ABORT
    sent) and ``abort+park+plan`` (-> the plan sent), in its place.
    """
    out: Table = {k: None for k in IN_PLACE_KEYS}
    recs = (report or {}).get("recoveries") or []
    if recs:
        rec = recs[0]
        evidence, retry = rec.get("evidence_wall"), rec.get("retry_wall")
        if fault_wall is not None and evidence is not None:
            out["detect"] = max(0.0, evidence - fault_wall)
        if evidence is not None and retry is not None:
            out["stop"] = retry - evidence
        out.update(slowest_stages(rec, ("clean", "rebuild", "repair", "rollback")))
        if first_after_wall is not None and retry is not None:
            out["first_iteration_after"] = first_after_wall - retry
        if first_after_wall is not None and fault_wall is not None:
            out["total"] = first_after_wall - fault_wall
    if not split_stop:
        return out
    rec = recs[0] if recs else {}
    evidence, abort, retry = rec.get("evidence_wall"), rec.get("abort_wall"), rec.get("retry_wall")
    split = {"freeze": None if evidence is None or abort is None else abort - evidence,
             "abort+park+plan": None if abort is None or retry is None else retry - abort}
    return {k2: v2 for k, v in out.items() for k2, v2 in (split.items() if k == "stop" else [(k, v)])}


def reboot_phases(report: Optional[Mapping[str, Any]], kill_wall: Optional[float],
                  first_after_wall: Optional[float]) -> Table:
    """The worker-restart-in-place table (``--enable-worker-reboot``), of the controller's
    first recovery and its first ``restarts`` entry.

    detect: SIGKILL -> the controller has evidence (the agent's report or the closed
    connection); restart_process: evidence -> the launcher's agent started the new process
    (the restarts entry's ``t_wall``; 0 when the agent was first); rendezvous: that start ->
    the controller sends RETRY to every rank. The controller sends RETRY once the new process
    is parked at its rejoin point, so this phase is mostly the new process's own start-up
    (interpreter, imports, initialisation with its start-up collectives replayed, model and
    optimizer build) plus the park message; it is not a separate rendezvous measurement.
    rebuild_groups / repair / rollback: the slowest rank's stage (its RETRY result; ranks
    run them at the same time; the restarted rank has no rollback);
    first_iteration_after: RETRY sent -> the re-run iteration done on every rank (contains
    rebuild_groups, repair, rollback); total: SIGKILL -> that.
    """
    out: Table = {k: None for k in REBOOT_KEYS}
    report = report or {}
    recs = report.get("recoveries") or []
    restarts = report.get("restarts") or []
    rec = recs[0] if recs else {}
    evidence, retry = rec.get("evidence_wall"), rec.get("retry_wall")
    started = restarts[0].get("t_wall") if restarts else None
    if kill_wall is not None and evidence is not None:
        out["detect"] = max(0.0, evidence - kill_wall)
    if evidence is not None and started is not None:
        out["restart_process"] = max(0.0, started - evidence)
    if started is not None and retry is not None:
        out["rendezvous"] = retry - max(started, evidence if evidence is not None else started)
    stages = slowest_stages(rec, ("rebuild", "repair", "rollback"))
    out.update(rebuild_groups=stages["rebuild"], repair=stages["repair"], rollback=stages["rollback"])
    if first_after_wall is not None and retry is not None:
        out["first_iteration_after"] = first_after_wall - retry
    if first_after_wall is not None and kill_wall is not None:
        out["total"] = first_after_wall - kill_wall
    return out


def preemption_phases(report: Optional[Mapping[str, Any]], signal_wall: float,
                      commit_wall: Optional[float]) -> Table:
    """The graceful-stop table (SIGTERM / SIGINT, ``--ha-preemption-deadline``).

    request: signal -> the controller has the stop request (report ``stop_request.t_wall``);
    drain: request -> every rank paused after the agreed iteration, and save: DUMP -> EXIT
    sent (both the report's ``phase_seconds``); commit: signal -> the tracker names the new
    checkpoint (``commit_wall``: the tracker's modification time, or None).
    """
    out: Table = {k: None for k in PREEMPTION_KEYS}
    if commit_wall is not None:
        out["commit"] = commit_wall - signal_wall
    if report:
        req = report.get("stop_request") or {}
        if req.get("t_wall") is not None:
            out["request"] = req["t_wall"] - signal_wall
        ps = report.get("phase_seconds") or {}
        out["drain"], out["save"] = ps.get("drain"), ps.get("save")
    return out


def action_intervals(report: Mapping[str, Any]) -> Dict[str, float]:
    """Seconds from each dying-checkpoint action sent to the next (DUMP -> ASSEMBLE ->
    COMMIT -> EXIT), from the first event of each action in the report's ``events``;
    keyed by the earlier action (``dump``, ``assemble``, ``commit``), only those sent."""
    first: Dict[str, float] = {}
    for e in report.get("events") or []:
        first.setdefault(e["action"], e["t_wall"])
    order = [a for a in ("dump", "assemble", "commit", "exit") if a in first]
    return {a: first[b] - first[a] for a, b in zip(order, order[1:])}
