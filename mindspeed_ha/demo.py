"""The main job: prove a fault-tolerant Megatron run survives a killed rank (``--fault kill``,
below), a device memory error or a network error (``--fault uce|network``: recovered in
the running processes, see :func:`run_in_place`), or a killed rank restarted alone by the
launcher and rejoined with the survivors (``--fault kill --reboot``: worker restart in place,
``--enable-worker-reboot``, also :func:`run_in_place`; phases in :func:`_reboot_phases`).

Three real runs of megatron-core's GPT on CPU ranks (gloo) through ``mindspeed-ha-run``,
all with ``--enable-high-availability`` and the same seed:

1. baseline: uninterrupted, ``--train-iters T``;
2. faulty: the same run with ``--save``; rank R SIGKILLs itself at a named point of
   iteration K; the survivors write the dying checkpoint and the job exits non-zero;
3. resumed: the same command with ``--load``; it continues from the dying checkpoint.

Then the per-iteration losses (faulty up to the checkpoint, resumed after it) are put
side by side with the baseline, and a summary is printed (and written as JSON with
``--report``). Exit status: 0 when the dying checkpoint was written, no completed
iteration was lost and the losses match bit for bit (or within 1e-6 relative: "close").
"""

from __future__ import annotations

from mindspeed_ha import env as ha_env
import json
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Dict, Optional

from mindspeed_ha import faults


def _compare(baseline: Dict[int, str], recovered: Dict[int, str]):
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


def _phase_seconds(report: Optional[dict], kill_wall: Optional[float]) -> Dict[str, Optional[float]]:
    """detect: SIGKILL -> the controller has evidence (agent report / closed connection);
    decide: evidence -> DUMP sent (freeze every survivor, collect status, choose k and savers);
    save: DUMP -> EXIT sent (shards + model files, assembly, validation, rename, tracker);
    total: SIGKILL -> EXIT sent."""
    out = {"detect": None, "decide": None, "save": None, "total": None}
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


#: where each demo fault may fire (``--fault-point``), the first is the default
FAULT_POINTS = {"kill": ("backward", "forward", "optimizer", "between"),
                "uce": ("backward", "forward", "optimizer", "between"),
                "network": ("grad_sync", "pp", "tp")}


def _in_place_phases(report: Optional[dict], fault_wall: Optional[float],
                     first_after_wall: Optional[float]) -> Dict[str, Optional[float]]:
    """Seconds per phase of an in-place recovery (the first one in the controller's report).

    detect: fault raised -> the controller has the report; stop: -> every rank left its
    step and is parked (the plan is sent); clean / rebuild / repair / rollback: the slowest
    rank's stage (its RETRY result); first_iteration_after: plan sent -> the re-run
    iteration done on every rank; total: fault -> that.
    """
    out: Dict[str, Optional[float]] = {k: None for k in ("detect", "stop", "clean", "rebuild", "repair", "rollback",
                                                         "first_iteration_after", "total")}
    recs = (report or {}).get("recoveries") or []
    if not recs:
        return out
    rec = recs[0]
    if fault_wall is not None and rec.get("evidence_wall") is not None:
        out["detect"] = max(0.0, rec["evidence_wall"] - fault_wall)
    if rec.get("evidence_wall") is not None and rec.get("retry_wall") is not None:
        out["stop"] = rec["retry_wall"] - rec["evidence_wall"]
    ranks = [d for d in (rec.get("ranks") or {}).values() if isinstance(d, dict)]
    for stage in ("clean", "rebuild", "repair", "rollback"):
        vals = [d[stage] for d in ranks if isinstance(d.get(stage), (int, float))]
        out[stage] = max(vals) if vals else None
    if first_after_wall is not None and rec.get("retry_wall") is not None:
        out["first_iteration_after"] = first_after_wall - rec["retry_wall"]
    if first_after_wall is not None and fault_wall is not None:
        out["total"] = first_after_wall - fault_wall
    return out


def _reboot_phases(report: Optional[dict], kill_wall: Optional[float],
                   first_after_wall: Optional[float]) -> Dict[str, Optional[float]]:
    """Seconds per phase of a worker restart in place (``--fault kill --reboot``), from the
    injector's log (SIGKILL, wall clock), the controller's report (its first recovery and
    its first ``restarts`` entry) and the recovery log (each rank's re-run iteration done).

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
    keys = ("detect", "restart_process", "rendezvous", "rebuild_groups", "repair", "rollback",
            "first_iteration_after", "total")
    out: Dict[str, Optional[float]] = {k: None for k in keys}
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
    ranks = [d for d in (rec.get("ranks") or {}).values() if isinstance(d, dict)]
    for stage, key in (("rebuild", "rebuild_groups"), ("repair", "repair"), ("rollback", "rollback")):
        vals = [d[stage] for d in ranks if isinstance(d.get(stage), (int, float))]
        out[key] = max(vals) if vals else None
    if first_after_wall is not None and retry is not None:
        out["first_iteration_after"] = first_after_wall - retry
    if first_after_wall is not None and kill_wall is not None:
        out["total"] = first_after_wall - kill_wall
    return out


def _seconds(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.3f}s"


def _print_losses(rows, title: str, source=None) -> None:
    """The per-iteration table: baseline vs the faulty (or recovered) run, with the source column if given."""
    print(f"\n{'iter':>5} {'baseline loss':>22} {title:>22}  " + ("source   " if source else "") + "match")
    for it, b, r, m in rows:
        rs = f"{r:22.17f}" if r is not None else f"{'-':>22}"
        print(f"{it:5d} {b:22.17f} {rs}  " + (f"{source(it):8} " if source else "") + m)


def _read_json(path: str) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _read_jsonl(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_in_place(ns, workdir: str, launcher, args, summary: dict) -> int:
    """--fault uce|network, or --fault kill --reboot: baseline, then the same run with the
    fault, recovered without ending the job.

    uce|network: the same processes recover (``recovered_in_process``: the job finished and
    the faulty rank kept its PID; ``restarts`` 0). Phase seconds (``summary["phase_seconds"]``,
    see :func:`_in_place_phases`): detect and stop are consecutive; clean, rebuild, repair
    and rollback are each the slowest rank's stage (ranks run them at the same time);
    first_iteration_after runs from the plan sent to the re-run iteration done on every
    rank, so it contains those stages; total runs from the fault to that.

    kill --reboot (``--enable-worker-reboot``): the launcher restarts the killed process
    alone and it rejoins. ``restarted_ranks``: the ranks in the controller's ``restarts``;
    ``restarts``: how many; ``recovered_in_process``: the job finished (exit 0) after a
    rejoin recovery without a dying checkpoint. Phases: :func:`_reboot_phases`."""
    from mindspeed_ha.testing.harness import launch

    point = ns.kill_point
    reboot = ns.fault == "kill"
    extra = {"uce": ["--enable-hbmfault-repair"], "kill": ["--enable-worker-reboot"]}.get(ns.fault, [])
    inject = f"rank={ns.kill_rank},iteration={ns.kill_iteration},point={point},fault={ns.fault}"
    report_path = os.path.join(workdir, "controller_report.json")
    inject_log = os.path.join(workdir, "injected.jsonl")
    recovery_log = os.path.join(workdir, "recovered.jsonl")
    print(f"[1/2] baseline: {ns.nproc} ranks, TP{summary['tensor_model_parallel_size']} "
          f"PP{summary['pipeline_model_parallel_size']}, {ns.train_iters} iterations, no fault", flush=True)
    t0 = time.monotonic()
    base = launch(ns.nproc, args(extra), launcher=launcher, timeout_s=900)
    summary["baseline_seconds"] = round(time.monotonic() - t0, 2)
    if base.returncode != 0:
        print(base.stdout[-3000:], base.stderr[-3000:], sep="\n", file=sys.stderr)
        print("baseline run failed", file=sys.stderr)
        return 1
    print(f"[2/2] faulty: {ns.fault} on rank {ns.kill_rank} at {point} of iteration {ns.kill_iteration}, "
          + ("the process restarted alone and rejoined" if reboot else "recovered in place"), flush=True)
    t0 = time.monotonic()
    # --save: should the recovery not be possible in place, the dying checkpoint has somewhere to go
    faulty = launch(ns.nproc, args(extra + ["--save", os.path.join(workdir, "checkpoints")]), launcher=launcher,
                    timeout_s=900, env={ha_env.INJECT: inject, ha_env.REPORT: report_path,
                         ha_env.INJECT_LOG: inject_log, ha_env.RECOVERY_LOG: recovery_log})
    summary["faulty_seconds"] = round(time.monotonic() - t0, 2)
    summary["faulty_exit_code"] = faulty.returncode
    report = _read_json(report_path)
    recs = (report or {}).get("recoveries") or []
    fired = _read_jsonl(inject_log)
    after = _read_jsonl(recovery_log)
    pids_after = {int(e["rank"]): int(e["pid"]) for e in after}
    fault_pid = next((int(e["pid"]) for e in fired), None)
    first_after = max((e["wall"] for e in after), default=None) if len(after) >= ns.nproc else None
    fault_wall = fired[0]["wall"] if fired else None
    if reboot:
        restarts = (report or {}).get("restarts") or []
        # the dying-checkpoint path stamps the report's exit (the tracker alone says nothing:
        # Megatron also saves at the end of training)
        dying = report is None or report.get("exit_code") is not None or report.get("exit_wall") is not None
        summary["restarted_ranks"] = sorted({int(e["rank"]) for e in restarts})
        summary["restarts"] = len(restarts)
        summary["recovered_in_process"] = bool(faulty.returncode == 0 and recs and not dying
                                               and all(r.get("mode") in ("rejoin", "forward", "reload") for r in recs))
        first_pids: Dict[int, int] = {}
        for rank, pid in re.findall(r"rank (\d+) registered \(pid (\d+)", faulty.stdout + faulty.stderr):
            first_pids.setdefault(int(rank), int(pid))
        survivors = [r for r in range(ns.nproc) if r not in summary["restarted_ranks"]]
        summary["survivor_pids_unchanged"] = bool(survivors) and all(
            r in first_pids and pids_after.get(r) == first_pids[r] for r in survivors)
        summary["phase_seconds"] = _reboot_phases(report, fault_wall, first_after)
    else:
        summary["recovered_in_process"] = bool(faulty.returncode == 0 and recs and fault_pid is not None
                                               and pids_after.get(ns.kill_rank) == fault_pid)
        summary["restarts"] = 0 if summary["recovered_in_process"] else None
        summary["phase_seconds"] = _in_place_phases(report, fault_wall, first_after)
    summary["recoveries"] = len(recs)
    summary["repairs"] = recs[0].get("repairs") if recs else None
    rows, verdict, max_diff = _compare(base.losses, faulty.losses)
    summary.update(loss_match=verdict, max_abs_loss_diff=max_diff, steps_lost=0 if verdict == "bitwise" else None)
    if not fired:
        print(f"the fault never fired: no {point} point in iteration {ns.kill_iteration} on rank {ns.kill_rank}",
              file=sys.stderr)
        return 1
    if faulty.returncode != 0:
        print(faulty.stdout[-4000:], faulty.stderr[-4000:], sep="\n", file=sys.stderr)
        print(f"the faulty run did not recover in place (exit code {faulty.returncode}; 75: the dying checkpoint "
              f"was written to {os.path.join(workdir, 'checkpoints')} instead)", file=sys.stderr)
        return 1
    _print_losses(rows, "faulty-run loss")
    ps = summary["phase_seconds"]
    fmt = _seconds
    how = (f"restarted ranks {summary['restarted_ranks']}, {summary['restarts']} restart(s); the others kept "
           f"their PIDs: {summary['survivor_pids_unchanged']}" if reboot else "same PIDs, 0 restarts")
    print(f"\nfault: {ns.fault} on rank {ns.kill_rank} at {point} of iteration {ns.kill_iteration}; recovered in "
          f"process: {summary['recovered_in_process']} ({how})")
    print("recovery phases: " + ", ".join(f"{k} {fmt(v)}" for k, v in ps.items()))
    print(f"loss match: {verdict} (max |diff| {max_diff:.3g})")
    ok = summary["recovered_in_process"] and verdict == "bitwise"
    if reboot:
        ok = ok and summary["restarted_ranks"] == [ns.kill_rank] and summary["survivor_pids_unchanged"]
    return 0 if ok else 1


def _end_on_sigterm() -> None:
    """SIGTERM ends the demo like Ctrl-C: the run in progress (its own process group) is
    killed by the harness on the way out, nothing is left running."""
    import signal

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread (tests calling run_demo): leave the default
        pass


def run_demo(ns) -> int:
    from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args

    fault = getattr(ns, "fault", "kill")
    reboot = bool(getattr(ns, "reboot", False))
    if reboot and fault != "kill":
        print(f"--reboot goes with --fault kill only (got --fault {fault}): a {fault} fault is recovered in the "
              "running processes, nothing is restarted", file=sys.stderr)
        return 2
    if ns.kill_point is None:
        ns.kill_point = FAULT_POINTS[fault][0]
    if ns.kill_point not in FAULT_POINTS[fault]:
        print(f"--fault-point={ns.kill_point} does not go with --fault {fault}: accepted "
              f"{'|'.join(FAULT_POINTS[fault])}", file=sys.stderr)
        return 2
    tp, pp, iters = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, ns.train_iters
    for point, size, flag in (("tp", tp, "--tensor-model-parallel-size"), ("pp", pp, "--pipeline-model-parallel-size")):
        if ns.kill_point == point and size < 2:
            print(f"--fault-point {point} needs {flag} >= 2 (got {size}): there is no such collective to fail",
                  file=sys.stderr)
            return 2
    _end_on_sigterm()
    if not 1 <= ns.kill_iteration <= iters:
        print(f"--kill-iteration={ns.kill_iteration} must be in [1, --train-iters={iters}]", file=sys.stderr)
        return 2
    if not 0 <= ns.kill_rank < ns.nproc:
        print(f"--kill-rank={ns.kill_rank} must be in [0, {ns.nproc - 1}]", file=sys.stderr)
        return 2
    keep = ns.workdir is not None
    workdir = os.path.abspath(ns.workdir) if keep else tempfile.mkdtemp(prefix="mindspeed-ha-demo-")
    os.makedirs(workdir, exist_ok=True)
    ckpt = os.path.join(workdir, "checkpoints")
    launcher = launcher_command(ns.nproc)

    def args(extra):
        a = tiny_gpt_args(tp=tp, pp=pp, train_iters=iters) + ["--enable-high-availability",
                                                              "--ha-controller-port", "0"]
        if ns.data_path:
            a += ["--data-path", ns.data_path]
        return a + extra

    if fault != "kill" or reboot:
        summary = {"fault": f"{fault} at {ns.kill_point}", "fault_rank": ns.kill_rank,
                   "worker_reboot": reboot,
                   "fault_iteration": ns.kill_iteration, "fault_point": ns.kill_point,
                   "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                   "nproc": ns.nproc, "train_iters": iters}
        try:
            return run_in_place(ns, workdir, launcher, args, summary)
        finally:
            if ns.report:
                with open(ns.report, "w") as f:
                    json.dump(summary, f, indent=1)
            if not keep:
                shutil.rmtree(workdir, ignore_errors=True)
    inject = f"rank={ns.kill_rank},iteration={ns.kill_iteration},point={ns.kill_point},fault=kill"
    report_path = os.path.join(workdir, "controller_report.json")
    inject_log = os.path.join(workdir, "injected.jsonl")
    summary: dict = {"fault": f"SIGKILL at {ns.kill_point}", "killed_rank": ns.kill_rank,
                     "recovered_in_process": False, "restarts": 1,
                     "kill_iteration": ns.kill_iteration, "kill_point": ns.kill_point,
                     "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                     "nproc": ns.nproc, "train_iters": iters}
    try:
        print(f"[1/3] baseline: {ns.nproc} ranks, TP{tp} PP{pp}, {iters} iterations, no fault", flush=True)
        t0 = time.monotonic()
        base = launch(ns.nproc, args([]), launcher=launcher, timeout_s=900)
        summary["baseline_seconds"] = round(time.monotonic() - t0, 2)
        if base.returncode != 0:
            print(base.stdout[-3000:], base.stderr[-3000:], sep="\n", file=sys.stderr)
            print("baseline run failed", file=sys.stderr)
            return 1

        print(f"[2/3] faulty: kill rank {ns.kill_rank} at {ns.kill_point} of iteration {ns.kill_iteration}", flush=True)
        t0 = time.monotonic()
        faulty = launch(ns.nproc, args(["--save", ckpt]), launcher=launcher, timeout_s=900,
                        env={ha_env.INJECT: inject, ha_env.REPORT: report_path,
                             ha_env.INJECT_LOG: inject_log})
        summary["faulty_seconds"] = round(time.monotonic() - t0, 2)
        summary["faulty_exit_code"] = faulty.returncode
        controller_report = _read_json(report_path)
        tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
        ckpt_iter = int(open(tracker).read().strip()) if os.path.exists(tracker) else None
        summary["checkpoint_iteration"] = ckpt_iter
        kill_wall = None
        if os.path.exists(inject_log):
            with open(inject_log) as f:
                kill_wall = json.loads(f.readline())["wall"]
        summary["phase_seconds"] = _phase_seconds(controller_report, kill_wall)
        completed = ns.kill_iteration if ns.kill_point == "between" else ns.kill_iteration - 1
        summary["completed_before_fault"] = completed
        nothing_to_save = (completed == 0 and ckpt_iter is None
                           and faulty.returncode == faults.EXIT_NO_COMPLETE_DATA)
        if nothing_to_save:  # killed in iteration 1: no completed step exists, none is lost
            print("no iteration had completed before the fault: nothing to save; restarting from scratch")
            ckpt_iter = 0
            summary["checkpoint_iteration"] = 0
        elif faulty.returncode != faults.EXIT_DYING_CHECKPOINT_SAVED or ckpt_iter is None:
            print(faulty.stdout[-4000:], faulty.stderr[-4000:], sep="\n", file=sys.stderr)
            print(f"no dying checkpoint (exit code {faulty.returncode})", file=sys.stderr)
            summary.update(steps_lost=None, loss_match="differ", max_abs_loss_diff=None, recovered=False)
            return 1
        summary["steps_lost"] = max(0, completed - ckpt_iter)

        print(f"[3/3] resume from the dying checkpoint at iteration {ckpt_iter}" if not nothing_to_save
              else "[3/3] restart from iteration 0", flush=True)
        t0 = time.monotonic()
        resume_args = ["--save", ckpt] if nothing_to_save else ["--load", ckpt, "--save", ckpt]
        resumed = launch(ns.nproc, args(resume_args), launcher=launcher, timeout_s=900)
        summary["resume_seconds"] = round(time.monotonic() - t0, 2)
        if resumed.returncode != 0:
            print(resumed.stdout[-3000:], resumed.stderr[-3000:], sep="\n", file=sys.stderr)
            print("resumed run failed", file=sys.stderr)
            summary.update(loss_match="differ", max_abs_loss_diff=None, recovered=False)
            return 1
        recovered = {i: v for i, v in faulty.losses.items() if i <= ckpt_iter}
        recovered.update({i: v for i, v in resumed.losses.items() if i > ckpt_iter})
        rows, verdict, max_diff = _compare(base.losses, recovered)
        summary.update(loss_match=verdict, max_abs_loss_diff=max_diff, recovered=True)

        _print_losses(rows, "recovered loss", lambda it: "faulty" if it <= ckpt_iter else "resumed")
        ps = summary["phase_seconds"]
        fmt = _seconds
        print(f"\nfault: SIGKILL rank {ns.kill_rank} at {ns.kill_point} of iteration {ns.kill_iteration}; "
              f"dying checkpoint at iteration {ckpt_iter}; steps lost: {summary['steps_lost']}")
        print(f"recovery phases: detect {fmt(ps['detect'])}, decide {fmt(ps['decide'])}, "
              f"save {fmt(ps['save'])}, total {fmt(ps['total'])}")
        print(f"loss match: {verdict} (max |diff| {max_diff:.3g})")
        ok = summary["steps_lost"] == 0 and verdict in ("bitwise", "close")
        return 0 if ok else 1
    finally:
        if ns.report:
            with open(ns.report, "w") as f:
                json.dump(summary, f, indent=1)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
