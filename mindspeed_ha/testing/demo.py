"""The main job: prove a fault-tolerant Megatron run survives a killed rank (``--fault kill``,
:func:`run_dying_checkpoint`), a device memory error or a network error (``--fault
uce|network``: recovered in the running processes, :func:`run_in_place`), or a killed rank
restarted alone by the launcher and rejoined with the survivors (``--fault kill --reboot``:
worker restart in place, ``--enable-worker-reboot``, also :func:`run_in_place`).

Real runs of megatron-core's GPT on CPU ranks (gloo) through ``mindspeed-ha-run``, all
with ``--enable-high-availability`` and the same seed:

1. baseline: uninterrupted, ``--train-iters T``;
2. faulty: the same run with ``--save``; the fault hits rank R at a named point of
   iteration K. ``--fault kill``: rank R SIGKILLs itself, the survivors write the dying
   checkpoint and the job exits 75; otherwise the job recovers and finishes;
3. (``--fault kill`` only) resumed: the same command with ``--load``; it continues from
   the dying checkpoint.

Then the per-iteration losses are put side by side with the baseline, and a summary is
printed (and written as JSON with ``--report``); its ``phase_seconds`` is one of the
tables of :mod:`mindspeed_ha.phases`. Exit status: 0 when the job survived as the fault
kind promises (dying checkpoint with no completed iteration lost and losses bitwise or
within 1e-6 relative ("close"); in-place: recovered in the running processes and losses
bitwise), 1 when not, 2 for bad options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

from mindspeed_ha import env as ha_env
from mindspeed_ha import faults, phases

#: where each demo fault may fire (``--fault-point``), the first is the default
FAULT_POINTS = {"kill": ("backward", "forward", "optimizer", "between"),
                "uce": ("backward", "forward", "optimizer", "between"),
                "network": ("grad_sync", "pp", "tp")}

#: seconds one run (baseline, faulty, resumed) may take before its process group is killed
RUN_TIMEOUT_S = 900


@dataclasses.dataclass
class _Job:
    """One demo: its options, scratch directory and launcher command."""

    ns: argparse.Namespace
    workdir: str
    launcher: List[str]

    @property
    def tp(self) -> int:
        return self.ns.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.ns.pipeline_model_parallel_size

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def args(self, extra: Sequence[str]) -> List[str]:
        """The training arguments: the tiny GPT with HA on, plus ``extra``."""
        from mindspeed_ha.testing.harness import tiny_gpt_args

        a = tiny_gpt_args(tp=self.tp, pp=self.pp, train_iters=self.ns.train_iters) + [
            "--enable-high-availability", "--ha-controller-port", "0"]
        if self.ns.data_path:
            a += ["--data-path", self.ns.data_path]
        return a + list(extra)

    def launch(self, extra: Sequence[str], env: Optional[Dict[str, str]] = None):
        """One run through ``mindspeed-ha-run``; a :class:`~mindspeed_ha.testing.harness.RunResult`."""
        from mindspeed_ha.testing.harness import launch

        return launch(self.ns.nproc, self.args(extra), launcher=self.launcher, timeout_s=RUN_TIMEOUT_S, env=env)


def _compare(baseline: Dict[int, str], recovered: Dict[int, str]):
    """Rows ``(iteration, baseline, recovered or None, match)``, the verdict (bitwise |
    close | differ) and the largest absolute difference."""
    rows, max_diff, all_bitwise, complete = [], 0.0, True, True
    for it in sorted(baseline):
        b = float.fromhex(baseline[it])
        r_hex = recovered.get(it)
        if r_hex is None:
            complete = False
            rows.append((it, b, None, "missing"))
            continue
        r = float.fromhex(r_hex)
        diff = abs(r - b)
        max_diff = max(max_diff, diff)
        same = r_hex == baseline[it]
        all_bitwise &= same
        rows.append((it, b, r, "bitwise" if same else f"{diff:.2e}"))
    if not complete:
        verdict = "differ"
    elif all_bitwise:
        verdict = "bitwise"
    elif all(abs(float.fromhex(recovered[i]) - float.fromhex(baseline[i])) <= 1e-6 * abs(float.fromhex(baseline[i]))
             for i in baseline):
        verdict = "close"
    else:
        verdict = "differ"
    return rows, verdict, max_diff


def _seconds(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.3f}s"


def _print_losses(rows, title: str, source: Optional[Callable[[int], str]] = None) -> None:
    """The per-iteration table: baseline vs the faulty (or recovered) run, with the source column if given."""
    print(f"\n{'iter':>5} {'baseline loss':>22} {title:>22}  " + ("source   " if source else "") + "match")
    for it, b, r, m in rows:
        rs = f"{r:22.17f}" if r is not None else f"{'-':>22}"
        print(f"{it:5d} {b:22.17f} {rs}  " + (f"{source(it):8} " if source else "") + m)


def _print_failed_run(run, what: str, tail: int = 3000) -> None:
    print(run.stdout[-tail:], run.stderr[-tail:], sep="\n", file=sys.stderr)
    print(what, file=sys.stderr)


def _baseline(job: _Job, extra: Sequence[str], step: str, summary: dict):
    """The uninterrupted run (``baseline_seconds``); None (the reason printed) if it failed."""
    ns = job.ns
    print(f"{step} baseline: {ns.nproc} ranks, TP{job.tp} PP{job.pp}, {ns.train_iters} iterations, no fault",
          flush=True)
    t0 = time.monotonic()
    base = job.launch(extra)
    summary["baseline_seconds"] = round(time.monotonic() - t0, 2)
    if base.returncode != 0:
        _print_failed_run(base, "baseline run failed")
        return None
    return base


# --- in place: --fault uce|network, --fault kill --reboot ------------------------------------

def _in_place_summary(ns) -> dict:
    return {"fault": f"{ns.fault} at {ns.kill_point}", "fault_rank": ns.kill_rank, "worker_reboot": ns.reboot,
            "fault_iteration": ns.kill_iteration, "fault_point": ns.kill_point,
            "tensor_model_parallel_size": ns.tensor_model_parallel_size,
            "pipeline_model_parallel_size": ns.pipeline_model_parallel_size,
            "nproc": ns.nproc, "train_iters": ns.train_iters}


def _faulty_in_place(job: _Job, extra: Sequence[str], summary: dict):
    """The run with the fault; returns it and what it left behind (:class:`phases.RunLogs`)."""
    ns = job.ns
    inject = f"rank={ns.kill_rank},iteration={ns.kill_iteration},point={ns.kill_point},fault={ns.fault}"
    report, inject_log, recovery_log = (job.path(n) for n in ("controller_report.json", "injected.jsonl",
                                                               "recovered.jsonl"))
    print(f"[2/2] faulty: {ns.fault} on rank {ns.kill_rank} at {ns.kill_point} of iteration {ns.kill_iteration}, "
          + ("the process restarted alone and rejoined" if ns.reboot else "recovered in place"), flush=True)
    t0 = time.monotonic()
    # --save: should the recovery not be possible in place, the dying checkpoint has somewhere to go
    faulty = job.launch(list(extra) + ["--save", job.path("checkpoints")],
                        env={ha_env.INJECT: inject, ha_env.REPORT: report, ha_env.INJECT_LOG: inject_log,
                             ha_env.RECOVERY_LOG: recovery_log})
    summary["faulty_seconds"] = round(time.monotonic() - t0, 2)
    summary["faulty_exit_code"] = faulty.returncode
    with open(job.path("faulty_run.log"), "w") as f:  # kept with --workdir
        f.write(faulty.stdout + faulty.stderr)
    return faulty, phases.RunLogs.read(report, inject_log, recovery_log, nproc=ns.nproc)


def _summarize_reboot(job: _Job, faulty, logs: phases.RunLogs, summary: dict) -> None:
    """``restarted_ranks``, ``restarts``, ``recovered_in_process`` (exit 0 after rejoin
    recoveries, no dying checkpoint), ``survivor_pids_unchanged`` and the reboot phases."""
    recs, report = logs.recoveries, logs.report
    # the dying-checkpoint path stamps the report's exit (the tracker alone says nothing:
    # Megatron also saves at the end of training)
    dying = not report or report.get("exit_code") is not None or report.get("exit_wall") is not None
    summary["restarted_ranks"] = sorted({int(e["rank"]) for e in logs.restarts})
    summary["restarts"] = len(logs.restarts)
    summary["recovered_in_process"] = bool(faulty.returncode == 0 and recs and not dying
                                           and all(r.get("mode") in ("rejoin", "forward", "reload") for r in recs))
    first_pids: Dict[int, int] = {}
    for rank, pid in re.findall(r"rank (\d+) registered \(pid (\d+)", faulty.stdout + faulty.stderr):
        first_pids.setdefault(int(rank), int(pid))
    survivors = [r for r in range(job.ns.nproc) if r not in summary["restarted_ranks"]]
    after = logs.pids_after
    summary["survivor_pids_unchanged"] = bool(survivors) and all(
        r in first_pids and after.get(r) == first_pids[r] for r in survivors)
    summary["phase_seconds"] = phases.reboot_phases(report, logs.fault_wall, logs.first_after_wall)


def _summarize_in_place(job: _Job, faulty, logs: phases.RunLogs, summary: dict) -> None:
    """``recovered_in_process`` (exit 0, the faulty rank kept its PID), ``restarts`` (0) and
    the in-place phases."""
    summary["recovered_in_process"] = bool(faulty.returncode == 0 and logs.recoveries and logs.fault_pid is not None
                                           and logs.pids_after.get(job.ns.kill_rank) == logs.fault_pid)
    summary["restarts"] = 0 if summary["recovered_in_process"] else None
    summary["phase_seconds"] = phases.in_place_phases(logs.report, logs.fault_wall, logs.first_after_wall)


def run_in_place(job: _Job, summary: dict) -> int:
    """--fault uce|network, or --fault kill --reboot: baseline, then the same run with the
    fault, recovered without ending the job. Returns the demo's exit status.

    uce|network: the same processes recover (``recovered_in_process``: the job finished and
    the faulty rank kept its PID; ``restarts`` 0); ``phase_seconds``:
    :func:`mindspeed_ha.phases.in_place_phases`.

    kill --reboot (``--enable-worker-reboot``): the launcher restarts the killed process
    alone and it rejoins. ``restarted_ranks``: the ranks in the controller's ``restarts``;
    ``restarts``: how many; ``recovered_in_process``: the job finished (exit 0) after a
    rejoin recovery without a dying checkpoint; ``phase_seconds``:
    :func:`mindspeed_ha.phases.reboot_phases`."""
    ns = job.ns
    extra = {"uce": ["--enable-hbmfault-repair"], "kill": ["--enable-worker-reboot"]}.get(ns.fault, [])
    base = _baseline(job, extra, "[1/2]", summary)
    if base is None:
        return 1
    faulty, logs = _faulty_in_place(job, extra, summary)
    (_summarize_reboot if ns.reboot else _summarize_in_place)(job, faulty, logs, summary)
    recs = logs.recoveries
    summary["recoveries"] = len(recs)
    summary["repairs"] = recs[0].get("repairs") if recs else None
    rows, verdict, max_diff = _compare(base.losses, faulty.losses)
    summary.update(loss_match=verdict, max_abs_loss_diff=max_diff, steps_lost=0 if verdict == "bitwise" else None)
    if not logs.injected:
        print(f"the fault never fired: no {ns.kill_point} point in iteration {ns.kill_iteration} on rank "
              f"{ns.kill_rank}", file=sys.stderr)
        return 1
    if faulty.returncode != 0:
        _print_failed_run(faulty, f"the faulty run did not recover in place (exit code {faulty.returncode}; 75: the "
                                  f"dying checkpoint was written to {job.path('checkpoints')} instead)", tail=4000)
        return 1
    _print_losses(rows, "faulty-run loss")
    how = (f"restarted ranks {summary['restarted_ranks']}, {summary['restarts']} restart(s); the others kept "
           f"their PIDs: {summary['survivor_pids_unchanged']}" if ns.reboot else "same PIDs, 0 restarts")
    print(f"\nfault: {ns.fault} on rank {ns.kill_rank} at {ns.kill_point} of iteration {ns.kill_iteration}; "
          f"recovered in process: {summary['recovered_in_process']} ({how})")
    print("recovery phases: " + ", ".join(f"{k} {_seconds(v)}" for k, v in summary["phase_seconds"].items()))
    print(f"loss match: {verdict} (max |diff| {max_diff:.3g})")
    ok = summary["recovered_in_process"] and verdict == "bitwise"
    if ns.reboot:
        ok = ok and summary["restarted_ranks"] == [ns.kill_rank] and summary["survivor_pids_unchanged"]
    return 0 if ok else 1


# --- dying checkpoint: --fault kill ------------------------------------------------------------

def _dying_summary(ns) -> dict:
    return {"fault": f"SIGKILL at {ns.kill_point}", "killed_rank": ns.kill_rank,
            "recovered_in_process": False, "restarts": 1,
            "kill_iteration": ns.kill_iteration, "kill_point": ns.kill_point,
            "tensor_model_parallel_size": ns.tensor_model_parallel_size,
            "pipeline_model_parallel_size": ns.pipeline_model_parallel_size,
            "nproc": ns.nproc, "train_iters": ns.train_iters}


def _faulty_dying(job: _Job, summary: dict):
    """The run whose rank is SIGKILLed: ``checkpoint_iteration`` (the tracker's, or None)
    and the dying-checkpoint phases. Returns the run and that iteration."""
    ns = job.ns
    inject = f"rank={ns.kill_rank},iteration={ns.kill_iteration},point={ns.kill_point},fault=kill"
    report, inject_log, ckpt = job.path("controller_report.json"), job.path("injected.jsonl"), job.path("checkpoints")
    print(f"[2/3] faulty: kill rank {ns.kill_rank} at {ns.kill_point} of iteration {ns.kill_iteration}", flush=True)
    t0 = time.monotonic()
    faulty = job.launch(["--save", ckpt], env={ha_env.INJECT: inject, ha_env.REPORT: report,
                                               ha_env.INJECT_LOG: inject_log})
    summary["faulty_seconds"] = round(time.monotonic() - t0, 2)
    summary["faulty_exit_code"] = faulty.returncode
    tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    ckpt_iter = None
    if os.path.exists(tracker):
        with open(tracker) as f:
            ckpt_iter = int(f.read().strip())
    summary["checkpoint_iteration"] = ckpt_iter
    logs = phases.RunLogs.read(report, inject_log)
    summary["phase_seconds"] = phases.dying_checkpoint_phases(logs.report, logs.fault_wall)
    return faulty, ckpt_iter


def _resume(job: _Job, faulty, ckpt_iter: int, from_scratch: bool, summary: dict) -> Optional[Dict[int, str]]:
    """The run continued from the dying checkpoint (``--load``; from iteration 0 when
    nothing was saved); the losses faulty-then-resumed, or None (reason printed)."""
    ckpt = job.path("checkpoints")
    print(f"[3/3] resume from the dying checkpoint at iteration {ckpt_iter}" if not from_scratch
          else "[3/3] restart from iteration 0", flush=True)
    t0 = time.monotonic()
    resumed = job.launch(["--save", ckpt] if from_scratch else ["--load", ckpt, "--save", ckpt])
    summary["resume_seconds"] = round(time.monotonic() - t0, 2)
    if resumed.returncode != 0:
        _print_failed_run(resumed, "resumed run failed")
        summary.update(loss_match="differ", max_abs_loss_diff=None, recovered=False)
        return None
    recovered = {i: v for i, v in faulty.losses.items() if i <= ckpt_iter}
    recovered.update({i: v for i, v in resumed.losses.items() if i > ckpt_iter})
    return recovered


def run_dying_checkpoint(job: _Job, summary: dict) -> int:
    """--fault kill: baseline, the faulty run that ends with the dying checkpoint, the
    resume with ``--load``; the losses of faulty-then-resumed against the baseline.
    ``phase_seconds``: :func:`mindspeed_ha.phases.dying_checkpoint_phases`. Returns the
    demo's exit status."""
    ns = job.ns
    base = _baseline(job, [], "[1/3]", summary)
    if base is None:
        return 1
    faulty, ckpt_iter = _faulty_dying(job, summary)
    completed = ns.kill_iteration if ns.kill_point == "between" else ns.kill_iteration - 1
    summary["completed_before_fault"] = completed
    nothing_to_save = completed == 0 and ckpt_iter is None and faulty.returncode == faults.EXIT_NO_COMPLETE_DATA
    if nothing_to_save:  # killed in iteration 1: no completed step exists, none is lost
        print("no iteration had completed before the fault: nothing to save; restarting from scratch")
        ckpt_iter = summary["checkpoint_iteration"] = 0
    elif faulty.returncode != faults.EXIT_DYING_CHECKPOINT_SAVED or ckpt_iter is None:
        _print_failed_run(faulty, f"no dying checkpoint (exit code {faulty.returncode})", tail=4000)
        summary.update(steps_lost=None, loss_match="differ", max_abs_loss_diff=None, recovered=False)
        return 1
    summary["steps_lost"] = max(0, completed - ckpt_iter)
    recovered = _resume(job, faulty, ckpt_iter, nothing_to_save, summary)
    if recovered is None:
        return 1
    rows, verdict, max_diff = _compare(base.losses, recovered)
    summary.update(loss_match=verdict, max_abs_loss_diff=max_diff, recovered=True)
    _print_losses(rows, "recovered loss", lambda it: "faulty" if it <= ckpt_iter else "resumed")
    ps = summary["phase_seconds"]
    print(f"\nfault: SIGKILL rank {ns.kill_rank} at {ns.kill_point} of iteration {ns.kill_iteration}; "
          f"dying checkpoint at iteration {ckpt_iter}; steps lost: {summary['steps_lost']}")
    print(f"recovery phases: detect {_seconds(ps['detect'])}, decide {_seconds(ps['decide'])}, "
          f"save {_seconds(ps['save'])}, total {_seconds(ps['total'])}")
    print(f"loss match: {verdict} (max |diff| {max_diff:.3g})")
    return 0 if summary["steps_lost"] == 0 and verdict in ("bitwise", "close") else 1


# --- the command ---------------------------------------------------------------------------------

def check_options(ns) -> Optional[str]:
    """What is wrong with the demo's options (the message for exit status 2), or None.
    Sets ``ns.kill_point`` to the fault's default point when not given."""
    fault, reboot = ns.fault, ns.reboot
    for flag, value, least in (("--nproc", ns.nproc, 2), ("--train-iters", ns.train_iters, 1),
                               ("--tensor-model-parallel-size", ns.tensor_model_parallel_size, 1),
                               ("--pipeline-model-parallel-size", ns.pipeline_model_parallel_size, 1)):
        if value < least:
            return f"{flag}={value}: accepted integers >= {least}"
    if ns.nproc % (ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size):
        return (f"--nproc={ns.nproc}: accepted multiples of --tensor-model-parallel-size x "
                f"--pipeline-model-parallel-size = {ns.tensor_model_parallel_size * ns.pipeline_model_parallel_size}")
    if ns.report:
        from mindspeed_ha.errors import ConfigError
        from mindspeed_ha.launch.report import check_path

        try:
            check_path(ns.report, "--report")
        except ConfigError as exc:
            return str(exc)
    if reboot and fault != "kill":
        return (f"--reboot goes with --fault kill only (got --fault {fault}): a {fault} fault is recovered in the "
                "running processes, nothing is restarted")
    if ns.kill_point is None:
        ns.kill_point = FAULT_POINTS[fault][0]
    if ns.kill_point not in FAULT_POINTS[fault]:
        return f"--fault-point={ns.kill_point} does not go with --fault {fault}: accepted {'|'.join(FAULT_POINTS[fault])}"
    for point, size, flag in (("tp", ns.tensor_model_parallel_size, "--tensor-model-parallel-size"),
                              ("pp", ns.pipeline_model_parallel_size, "--pipeline-model-parallel-size")):
        if ns.kill_point == point and size < 2:
            return f"--fault-point {point} needs {flag} >= 2 (got {size}): there is no such collective to fail"
    if not 1 <= ns.kill_iteration <= ns.train_iters:
        return f"--kill-iteration={ns.kill_iteration} must be in [1, --train-iters={ns.train_iters}]"
    if not 0 <= ns.kill_rank < ns.nproc:
        return f"--kill-rank={ns.kill_rank} must be in [0, {ns.nproc - 1}]"
    return None


def _write_report(path: str, summary: dict) -> None:
    """``--report``: the summary as JSON; a write failure is a warning (the demo's exit
    status stays what the runs gave)."""
    try:
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
    except OSError as exc:
        print(f"mindspeed-ha demo: warning: --report {path!r} could not be written: {exc}", file=sys.stderr)


def run_demo(ns) -> int:
    """``mindspeed-ha demo`` (the options of :mod:`mindspeed_ha.cli`). Returns the exit
    status: 0 survived, 1 not, 2 bad options (one line naming the option, before anything
    starts), 128 + the signal's number when SIGINT or SIGTERM ended it (every process it
    started ended too). ``--report``: the summary as JSON, written whatever happens (a write
    failure is a warning); ``--workdir``: kept, else a temporary directory removed at the end."""
    from mindspeed_ha.testing.harness import launcher_command

    ns.fault = getattr(ns, "fault", "kill")
    ns.reboot = bool(getattr(ns, "reboot", False))
    problem = check_options(ns)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    from mindspeed_ha.launch.proctree import interrupt_on_signal

    restore = interrupt_on_signal()
    keep = ns.workdir is not None
    workdir = os.path.abspath(ns.workdir) if keep else tempfile.mkdtemp(prefix="mindspeed-ha-demo-")
    os.makedirs(workdir, exist_ok=True)
    job = _Job(ns, workdir, launcher_command(ns.nproc))
    in_place = ns.fault != "kill" or ns.reboot
    summary = _in_place_summary(ns) if in_place else _dying_summary(ns)
    try:
        return run_in_place(job, summary) if in_place else run_dying_checkpoint(job, summary)
    except KeyboardInterrupt as exc:
        signum = exc.args[0] if exc.args and isinstance(exc.args[0], int) else 2  # 2: SIGINT (Ctrl-C)
        print(f"mindspeed-ha demo: interrupted by signal {signum}: every process it started was ended",
              file=sys.stderr)
        summary["interrupted_by_signal"] = signum
        return 128 + signum
    finally:
        if ns.report:
            _write_report(ns.report, summary)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        restore()
