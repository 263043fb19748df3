"""In-place recovery end to end: real megatron-core on 4 gloo ranks, no process restart.

A UCE (the injector really overwrites the chosen tensor, then raises CUDA's
"uncorrectable ECC error" text) or a network error (gloo's "Connection reset by peer"
raised on one rank inside a real collective while its peers are blocked in it) hits one
rank in iteration K; one job per layout meets several such faults, one per iteration
(a schedule: each case hits a job that already recovered from the ones before). Standard of
proof, per fault: the job exits 0 with every iteration
done, the faulty rank kept its PID (the injector's log and the recovery log name the same
process; the launcher restarts nothing), every rank re-ran iteration K after the
recovery, and the per-iteration losses equal the uninterrupted run's bit for bit (same
seed, dropout on). The same run with the repair skipped (testing knob) gives different
losses: the damage is real and the repair is what undoes it. The same jobs write the events
file and serve the metrics port: scraped while the job runs (once every recovery is in the
file; rank 0 holds the job open meanwhile, ``fault=hold``), /metrics counts every fault by
kind, every recovery by mode and their phase seconds, and the file holds every fault's
events in order; the port is closed when the job is over.
"""

import json
import os
import socket
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mindspeed_ha import faults
from mindspeed_ha.control import job_events
from mindspeed_ha.testing.harness import FOUR_RANK_LAYOUTS, four_rank_args, read_jsonl, run_four

ITERS = 8
K = 3


def _args(layout, *extra):
    return four_rank_args(layout, ITERS, "--enable-hbmfault-repair", *extra)


_run = run_four


@pytest.fixture(scope="module")
def baselines(uninterrupted):
    """The session's shared uninterrupted run of the layout (tests/conftest.py; without
    --enable-hbmfault-repair, which changes nothing until a UCE)."""
    return uninterrupted


def _baseline(baselines, layout):
    tp, pp, more = FOUR_RANK_LAYOUTS[layout]
    return baselines(tp, pp, ITERS, *more, save=False)[0]


def _faulty(tmp_path, layout, spec, extra_env=None, extra_args=()):
    fired, after, report = (str(tmp_path / n) for n in ("fired.jsonl", "after.jsonl", "report.json"))
    env = {"MINDSPEED_HA_INJECT": spec, "MINDSPEED_HA_INJECT_LOG": fired, "MINDSPEED_HA_RECOVERY_LOG": after,
           "MINDSPEED_HA_REPORT": report, **(extra_env or {})}
    r = _run(_args(layout, *extra_args), env=env)
    rep = json.load(open(report)) if os.path.exists(report) else {}
    return r, read_jsonl(fired), read_jsonl(after), rep


# One job per layout meets a schedule of faults, one per iteration from 2 (each case is
# recovered, then the next one hits the recovered job): (rank, point, fault, what) in order.
SCHEDULES = {
    "tp1pp2": [
        (0, "forward", "uce", "param"),
        (3, "backward", "uce", "exp_avg"),
        # inside the optimizer update: the other ranks finished it and wait in the commit
        # barrier; the faulty rank receives the finished update and the step goes on (roll forward)
        (1, "optimizer", "uce", "exp_avg"),
        (3, "optimizer", "uce", "main_param"),
        (1, "grad_sync", "network", ""),
        (2, "pp", "network", ""),
    ],
    "tp2pp1": [
        # found by a new user: early in iteration 2, TP peers still finishing update 1 (the freeze
        # kept them from it; then a rank stopped at the step's entry re-ran with the old RNG)
        (3, "tp", "network", ""),
        (1, "backward", "uce", "main_param"),
        (1, "optimizer", "uce", "exp_avg_sq"),
        (0, "tp", "network", ""),
    ],
    "dp4": [
        (2, "forward", "uce", "param"),
        # DP4 N=2: rank 1, rank 0's optimizer-instance peer, is stuck in the parameter all-gather
        # (its update cannot finish): both receive the finished update from the other instance
        (0, "optimizer", "uce", "exp_avg"),
    ],
}


def _spec(k, rank, point, fault, what):
    return f"rank={rank},iteration={k},point={point},fault={fault}" + (f",what={what}" if what else "")


class _Scraper:
    """While the job runs: follow its events file until the ``n``-th RecoveryFinished, then
    scrape the metrics port the ControllerStarted event names (--ha-metrics-port 0), then
    release the job. The job cannot end before: rank 0 holds after iteration ``ITERS - 1``
    (``fault=hold``) until the release file exists, which this creates whatever happens."""

    def __init__(self, path, release, n):
        self.path, self.release, self.n = path, release, n
        self.url, self.metrics, self.status = None, None, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            finished = 0
            for e in job_events.follow(self.path, 300, self.stop):
                if e["type"] == "ControllerStarted":
                    self.url = e["detail"]["metrics_url"]
                finished += e["type"] == "RecoveryFinished"
                if finished == self.n and self.url:
                    with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
                        self.metrics = {(s.name, tuple(sorted(s.labels.items()))): s.value
                                        for f in text_string_to_metric_families(resp.read().decode())
                                        for s in f.samples}
                    with urllib.request.urlopen(self.url + "/status", timeout=30) as resp:
                        self.status = json.load(resp)
                    return
        finally:
            open(self.release, "w").close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(60)
        open(self.release, "w").close()


@pytest.mark.parametrize("layout", sorted(SCHEDULES))
def test_recovered_in_place(tmp_path, baselines, layout):
    """Each fault of the layout's schedule (iteration k = 2, 3, ...) is recovered in place:
    one recovery per fault, of the right mode, iteration and repairs; every rank re-ran
    (or, forward, finished) iteration k in the same process, the faulty rank being the
    process that faulted; the losses equal the uninterrupted run's bit for bit. The events
    file and a scrape of /metrics during the run show them (see the module docstring)."""
    base = _baseline(baselines, layout)
    cases = {k: case for k, case in enumerate(SCHEDULES[layout], start=2)}
    events, release = str(tmp_path / "events.jsonl"), str(tmp_path / "release")
    hold = f"rank=0,iteration={ITERS - 1},point=between,fault=hold"
    assert max(cases) <= ITERS - 1  # "between": after iteration ITERS - 1 and its recovery
    with _Scraper(events, release, len(cases)) as scraper:
        r, fired, after, rep = _faulty(tmp_path, layout, ";".join([_spec(k, *c) for k, c in cases.items()] + [hold]),
                                       extra_env={"MINDSPEED_HA_INJECT_RELEASE": release},
                                       extra_args=("--ha-events-file", events, "--ha-metrics-port", "0"))
    assert r.returncode == 0, (r.stdout + r.stderr)[-8000:]
    _check_events_and_metrics(events, scraper, list(cases.values()))
    assert [e["fault"] for e in fired][-1] == "hold", fired
    fired = [e for e in fired if e["fault"] != "hold"]
    assert [(e["iteration"], e["rank"]) for e in fired] == [(k, c[0]) for k, c in cases.items()], fired
    recs = rep.get("recoveries") or []
    assert len(recs) == len(cases), rep
    for rec, (k, (rank, point, fault, what)) in zip(recs, cases.items()):
        forward = point == "optimizer"
        case = f"iteration {k}: {fault} at {point} of rank {rank}"
        assert rec["iteration"] == (k if forward else k - 1), (case, rec)
        assert rec["kind"] == fault and rec.get("mode") == ("forward" if forward else "rollback"), (case, rec)
        if fault == "uce" and layout == "dp4" and forward:
            assert [int(d) for d, _ in rec["repairs"]] == [0, 1], (case, rec)
        elif fault == "uce":
            assert [int(d) for d, _ in rec["repairs"]] == [rank], (case, rec)
        at_k = [e for e in after if e["iteration"] == k]
        assert sorted(e["rank"] for e in at_k) == [0, 1, 2, 3], (case, at_k)
        pid = next(e["pid"] for e in fired if e["iteration"] == k)
        assert {e["pid"] for e in at_k if e["rank"] == rank} == {pid}, case
    assert sorted(r.losses) == list(range(1, ITERS + 1))
    for it in sorted(base):
        assert r.losses[it] == base[it], \
            f"iteration {it}: {float.fromhex(r.losses[it])} != uninterrupted {float.fromhex(base[it])}"


def _check_events_and_metrics(path, scraper, cases):
    """The file: per fault FaultDetected -> RecoveryStarted -> RecoveryFinished, in order,
    then JobExit 0. The scrape (during the run, after the first recovery): that fault, its
    recovery, its phase seconds; the port closed now that the job is over."""
    lines = job_events.read(path)
    types = [e["type"] for e in lines]
    assert types == ["ControllerStarted"] + ["FaultDetected", "RecoveryStarted", "RecoveryFinished"] * len(cases) \
        + ["JobExit"], types
    assert [e["seq"] for e in lines] == list(range(1, len(lines) + 1))
    assert [e["detail"]["kind"] for e in lines if e["type"] == "FaultDetected"] == [c[2] for c in cases]
    assert [e["ranks"] for e in lines if e["type"] == "FaultDetected"] == [[c[0]] for c in cases]
    assert [e["iteration"] for e in lines if e["type"] == "FaultDetected"] == list(range(2, 2 + len(cases)))
    finished = [e for e in lines if e["type"] == "RecoveryFinished"]
    assert all(e["phase_seconds"]["total"] > 0 and "rebuild" in e["phase_seconds"] for e in finished), finished
    assert lines[-1]["detail"]["exit_code"] == 0
    m = scraper.metrics
    assert m is not None, "no scrape during the run"
    n = len(cases)
    for kind in {c[2] for c in cases}:
        assert m[("mindspeed_ha_faults_total", (("kind", kind),))] == sum(c[2] == kind for c in cases), m
    for mode in ("forward", "rollback"):
        count = sum((c[1] == "optimizer") == (mode == "forward") for c in cases)
        assert m.get(("mindspeed_ha_recoveries_total", (("mode", mode), ("outcome", "recovered"))), 0) == count, m
    assert m[("mindspeed_ha_recovery_phase_seconds_count", (("phase", "rebuild"),))] == n, m
    assert m[("mindspeed_ha_recovery_phase_seconds_sum", (("phase", "rebuild"),))] > 0, m
    assert m[("mindspeed_ha_recovery_duration_seconds_count", ())] == n, m
    assert m[("mindspeed_ha_ranks", (("state", "dead"),))] == 0, m
    assert scraper.status["world_size"] == 4 and scraper.status["recoveries"], scraper.status
    port = int(scraper.url.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_skipping_the_repair_changes_the_losses(tmp_path, baselines):
    """The UCE damage is real: recovering without the repair (testing knob) trains on garbage."""
    base = _baseline(baselines, "tp1pp2")
    r, fired, after, rep = _faulty(tmp_path, "tp1pp2", f"rank=0,iteration={K},point=forward,fault=uce,what=param",
                                   extra_env={"MINDSPEED_HA_TESTING_SKIP_REPAIR": "1"})
    assert fired and (rep.get("recoveries") or []), (r.stdout + r.stderr)[-4000:]
    later = [it for it in range(K, ITERS + 1) if it in r.losses]
    assert any(r.losses[it] != base[it] for it in later), "same losses without the repair: the damage was not real"


def test_fault_during_recovery_falls_back_to_the_dying_checkpoint(tmp_path):
    """A network fault starts a recovery; rank 2 fails inside it (after the clean-up, before
    the rebuild). Nothing loops: the controller takes the dying-checkpoint path, which the
    processor threads write while the other training threads wait in the rebuild. The events
    file says so: the fault, the recovery started and failed, the checkpoint, the exit 75."""
    save, events = str(tmp_path / "ckpt"), str(tmp_path / "events.jsonl")
    spec = (f"rank=1,iteration={K},point=grad_sync,fault=network;"
            f"rank=2,iteration={K},point=recover,fault=raise")
    r = _run(_args("tp1pp2", "--save", save, "--ha-events-file", events), env={"MINDSPEED_HA_INJECT": spec})
    log = r.stdout + r.stderr
    assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, log[-6000:]
    assert "rank 2 failed to recover" in log or "reported a fault during recovery" in log, log[-6000:]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == K - 1
    lines = job_events.read(events)  # the events file tells the same story
    assert [e["type"] for e in lines] == ["ControllerStarted", "FaultDetected", "RecoveryStarted", "RecoveryFailed",
                                          "DyingCheckpointCommitted", "JobExit"], lines
    assert lines[-2]["iteration"] == K - 1 and lines[-2]["phase_seconds"]["save"] > 0, lines[-2]
    assert lines[-1]["detail"]["exit_code"] == faults.EXIT_DYING_CHECKPOINT_SAVED and lines[-1]["severity"] == "Warning"
