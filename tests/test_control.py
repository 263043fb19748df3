"""Controller + processors in one process over real localhost ZeroMQ; the standalone
controller as its own process; a hung (SIGSTOPped) rank in a real 4-rank launcher job.

Teardown is by fixtures, so it happens when a test fails too: ``closing`` (an ExitStack)
closes every controller, processor, socket and process a test made, then ``no_leaks``
checks that no thread outlived the test and every ZeroMQ context was terminated
explicitly (none was left for the garbage collector). Assertions are about outcomes and
orderings, never about how fast something happened.
"""

import contextlib
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from mindspeed_ha.config import ConfigError, HAConfig
from mindspeed_ha.control import auth, wire
from mindspeed_ha.control.controller import Controller
from mindspeed_ha.control.policy import ActionKind, DumpPlan
from mindspeed_ha.control.processor import Processor, ProcessorExited
from mindspeed_ha.control.state import Layout, OptimizerStatus, Phase
from mindspeed_ha.faults import (EXIT_CONTROLLER_LOST, EXIT_DYING_CHECKPOINT_SAVED, EXIT_FAULT_UNRECOVERABLE,
                                 EXIT_NO_COMPLETE_DATA, CommunicationError, ControlPlaneError, FaultKind)
from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args

KEY = b"t" * 32
CFG = HAConfig(enabled=True, distributed_optimizer=True, replica_count=2, auth_key=KEY, controller_addr="127.0.0.1",
               heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0, stop_timeout_s=5.0, action_timeout_s=10.0,
               connect_timeout_s=5.0, save_dir=None)
WORLD = 4  # TP1 PP1 DP4, N=2: instances {0,1} and {2,3}; shard s held by ranks s and s+2


class Job:
    """A controller and WORLD processors with recording action handlers.

    Everything it starts is registered on ``stack`` as soon as it exists, so a failure
    half-way through still closes what was made.
    """

    def __init__(self, stack, cfg=CFG, save_dir="/save", dump_delay=0.0, ctl=None):
        self.ctl = ctl or Controller(cfg, WORLD, "127.0.0.1", 0, tick_s=0.01).start()
        stack.callback(self.ctl.stop)
        self.calls = {k: [] for k in ("dump", "assemble", "commit")}
        self.exits = {}
        self.exited = {r: threading.Event() for r in range(WORLD)}
        self.procs = []
        self.lock = threading.Lock()
        for r in range(WORLD):
            lay = Layout(dp_rank=r, dp_size=WORLD, replica_count=2, instance_id=r // 2, shard_id=r % 2)
            p = Processor(cfg, r, lay, save_dir, port=self.ctl.port, exit_handler=self._exit_handler(r))
            for kind in self.calls:
                p.on_action(kind, self._handler(kind, r, dump_delay if kind == "dump" else 0.0))
            stack.callback(p.close, None)  # no GOODBYE to linger on: the controller goes too
            self.procs.append(p.start())

    def _handler(self, kind, rank, delay):
        def handle(params):
            if delay:
                threading.Event().wait(delay)  # a long save: heartbeats must go on meanwhile
            with self.lock:
                self.calls[kind].append((rank, params))
            return True, f"{kind} done on {rank}"
        return handle

    def _exit_handler(self, rank):
        def on_exit(code, reason):
            self.exits[rank] = (code, reason)
            self.exited[rank].set()
        return on_exit

    def step(self, iteration, ranks=None):
        for r in ranks if ranks is not None else range(WORLD):
            self.procs[r].begin_update(iteration)
            self.procs[r].end_update(iteration)



@pytest.fixture
def no_leaks(monkeypatch):
    """Fails a test that leaves a thread running or a ZeroMQ context not terminated.

    Every ``zmq.Context()`` made during the test is recorded (and so kept from the
    garbage collector) and must be closed by the end of it.
    """
    contexts = []

    class RecordedContext(zmq.Context):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            contexts.append(self)

    monkeypatch.setattr(zmq, "Context", RecordedContext)
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    open_contexts = [c for c in contexts if not c.closed]
    for c in open_contexts:  # report, then end them so that one failure does not hang the rest
        c.destroy(linger=0)
    assert not leaked, f"leaked threads: {leaked}"
    assert not open_contexts, f"{len(open_contexts)} ZeroMQ context(s) left open"


@pytest.fixture
def closing(no_leaks):
    """An ExitStack closed after the test, before ``no_leaks`` checks (failures included)."""
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture
def job(closing):
    def make(**kw):
        return Job(closing, **kw)

    return make


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_dying_checkpoint(j, dead, iteration):
    out = j.ctl.wait_done(10)
    assert out is not None and out.phase is Phase.DONE
    assert out.exit_code == EXIT_DYING_CHECKPOINT_SAVED, out.reason
    assert out.iteration == iteration and out.fault_rank == dead
    plan = out.plan
    assert dead not in plan.savers()
    # DUMP went exactly to the plan's savers, each with its own part of the plan (its roles)
    assert sorted(r for r, _ in j.calls["dump"]) == list(plan.savers())
    for r, params in j.calls["dump"]:
        own = DumpPlan.from_params(params)
        assert own.roles(r) == plan.roles(r) and own.iteration == plan.iteration and params["save_dir"] == "/save"
        assert set(own.shard_savers.values()) == {r}  # nobody else's shards
    assert [r for r, _ in j.calls["assemble"]] == sorted(set(plan.assemblers.values()))
    assert [r for r, _ in j.calls["commit"]] == [plan.committer]
    survivors = [r for r in range(WORLD) if r != dead]
    for r in survivors:
        assert j.exited[r].wait(5)
        assert j.exits[r][0] == EXIT_DYING_CHECKPOINT_SAVED
    assert dead not in j.exits
    actions = [e.action for e in out.events]
    assert actions == [ActionKind.STOP_ALL, ActionKind.DUMP, ActionKind.ASSEMBLE, ActionKind.COMMIT,
                       ActionKind.EXIT, ActionKind.NOOP]
    assert set(out.timings) == {"detect", "decide", "save", "total"}
    return out


def test_socket_close_is_detected_and_round_completes(job):
    j = job()
    j.step(1)
    j.step(2)
    t0 = time.monotonic()
    j.procs[2].close(None)  # the process vanishes: no GOODBYE, TCP connection closed
    for r in (0, 1, 3):
        assert j.procs[r].stop_event.wait(10)
        assert j.procs[r].stop_received_at >= t0  # STOP follows the disconnect
    out = assert_dying_checkpoint(j, dead=2, iteration=2)
    assert "control connection closed" in out.events[0].reason
    plan = out.plan
    assert plan.shard_savers == {(0, 0, 0): 0, (0, 0, 1): 1}  # instance 0 intact: preferred


def test_report_rank_exit_stops_the_survivors(job):
    j = job()
    j.step(1)
    t0 = time.monotonic()
    j.ctl.report_rank_exit(0, -9)
    for r in (1, 2, 3):
        assert j.procs[r].stop_event.wait(10)
        assert j.procs[r].stop_received_at >= t0
    out = assert_dying_checkpoint(j, dead=0, iteration=1)
    assert "agent report" in out.events[0].reason  # the report, not a missed heartbeat, was the evidence
    assert out.plan.shard_savers == {(0, 0, 0): 2, (0, 0, 1): 3}
    assert out.timings["detect"] >= 0


def test_missed_heartbeats_detected_after_timeout(closing):
    # a second, hung rank: registers through a raw socket and then never speaks again
    ctl = Controller(CFG, 2, "127.0.0.1", 0, tick_s=0.01).start()
    closing.callback(ctl.stop)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    closing.callback(wire.close_all, ctx, raw)
    wire.configure_socket(raw, CFG.max_message_bytes)
    auth.configure_client(raw, auth.derive_keys(KEY))
    raw.connect(f"tcp://127.0.0.1:{ctl.port}")
    codec = wire.Codec(KEY, wire.new_sender("rank", 1))
    lay = Layout(dp_rank=1, dp_size=2, replica_count=2, instance_id=1)
    t_register = time.monotonic()  # the controller hears rank 1 for the last time after this
    raw.send(codec.encode(wire.Register(1, 2, 1, "h", lay, "/save", "", "updated", 1)))
    assert raw.poll(10000)
    assert codec.decode(raw.recv()).body.accepted
    p0 = Processor(CFG, 0, Layout(dp_size=2, replica_count=2), "/save", port=ctl.port,
                   iteration=1, exit_handler=lambda c, r: None)
    closing.callback(p0.close, None)
    p0.start()
    assert p0.stop_event.wait(30)
    assert p0.stop_received_at - t_register >= CFG.heartbeat_timeout_s  # never declared dead early
    out = ctl.wait_done(30)
    assert out is not None and "rank 1 missed heartbeats" in out.events[0].reason
    # rank 0 holds the only healthy copy and is asked to dump; it has no dump handler here
    assert out.exit_code == EXIT_FAULT_UNRECOVERABLE and "failed on rank 0" in out.reason, out.reason
    assert ctl.unresponsive_ranks().keys() == {1}  # the launcher ends such a rank's process


def test_freeze_blocks_begin_update_and_dirty_holder_is_skipped(job):
    j = job()
    j.step(1)
    j.procs[1].begin_update(2)  # rank 1 is inside update 2 when the fault hits: dirty
    j.step(2, ranks=[0, 2, 3])
    j.ctl.report_rank_exit(3, 1)
    assert j.procs[1].stop_event.wait(10)
    assert j.procs[1].frozen
    # frozen: a new update must not start; it stays blocked until EXIT ends the rank
    started = threading.Event()
    errors = []

    def next_step():
        started.set()
        try:
            j.procs[0].begin_update(3)
        except ProcessorExited as exc:
            errors.append(exc)

    assert j.procs[0].stop_event.wait(10)
    t = threading.Thread(target=next_step)
    t.start()
    assert started.wait(10)
    out = j.ctl.wait_done(30)
    t.join(10)
    assert not t.is_alive() and len(errors) == 1  # released only by EXIT
    # shard 1: rank 3 dead, rank 1 dirty (UPDATING@2) -> shard 1 only complete at... nowhere
    assert out.exit_code == EXIT_NO_COMPLETE_DATA, out.reason
    assert "rank 1 updating@2" in out.reason and "rank 3 dead" in out.reason
    assert j.procs[1].status() == (OptimizerStatus.UPDATING, 2)
    assert not j.calls["dump"]


def test_report_fault_returns_exit_action_and_long_dump_keeps_heartbeats(job):
    j = job(dump_delay=3 * CFG.heartbeat_timeout_s)
    j.step(1)
    result = {}

    def main_thread():
        try:
            raise CommunicationError("all-reduce failed") from RuntimeError("Connection reset by peer")
        except CommunicationError as exc:
            result["action"] = j.procs[3].report_fault(exc, iteration=2, timeout=10)

    t = threading.Thread(target=main_thread)
    t.start()
    out = j.ctl.wait_done(10)
    t.join(5)
    assert out.exit_code == EXIT_DYING_CHECKPOINT_SAVED, out.reason  # no rank declared dead during the dump
    assert out.fault_kind is FaultKind.NETWORK and out.fault_rank == 3
    assert result["action"].kind == ActionKind.EXIT.value
    assert result["action"].params["code"] == EXIT_DYING_CHECKPOINT_SAVED
    assert 3 in j.exits  # the reporting rank is a healthy holder and exits too


def test_no_save_dir_exits_77(job):
    j = job(save_dir=None)
    j.step(1)
    j.ctl.report_rank_exit(1, 137)
    out = j.ctl.wait_done(10)
    assert out.exit_code == EXIT_FAULT_UNRECOVERABLE and "--save" in out.reason
    assert not j.calls["dump"]


def _two_ranks(closing):
    """A started controller of a 2-rank job and its two registered processors."""
    ctl = Controller(CFG, 2, "127.0.0.1", 0, tick_s=0.01).start()
    closing.callback(ctl.stop)
    ps = []
    for r in range(2):
        p = Processor(CFG, r, Layout(dp_rank=r, dp_size=2, replica_count=2, instance_id=r), None, port=ctl.port)
        closing.callback(p.close, None)
        ps.append(p.start())
    return ctl, ps


def test_normal_end_all_goodbye(closing):
    ctl, ps = _two_ranks(closing)
    for p in ps:
        p.close(0)
    out = ctl.wait_done(10)
    assert out.phase is Phase.DONE and out.exit_code is None and out.fault_rank is None
    assert ctl.unresponsive_ranks() == {}


def test_a_rank_closes_its_connection_only_after_its_goodbye_was_handled(closing):
    """The controller learns of a closed connection from its socket monitor, which may
    report the close before the GOODBYE sent ahead of it was read: a job that ended
    normally was then taken for dead ranks (CI, 1 run in 15 of the ARF demo beside CPU
    hogs: a dying checkpoint attempted, exit 76 in the report). The controller answers
    GOODBYE_ACK and the rank closes only after it: when ``close(0)`` returns, the
    controller has recorded the exit."""
    ctl, ps = _two_ranks(closing)
    for r, p in enumerate(ps):
        p.close(0)
        assert ctl.state.ranks[r].exit_code == 0, "the rank closed before its GOODBYE was handled"
        assert p.link.goodbye_acked
    out = ctl.wait_done(10)
    assert out.phase is Phase.DONE and out.fault_rank is None
    assert [e.action for e in ctl.events] == [ActionKind.NOOP]  # the one decision: DONE


def test_port_in_use_is_config_error(closing):
    a = Controller(CFG, 1, "127.0.0.1", 0).start()
    closing.callback(a.stop)
    with pytest.raises(ConfigError) as ei:
        Controller(CFG, 1, "127.0.0.1", a.port).start()  # its context is closed before the error
    assert str(a.port) in str(ei.value) and "--ha-controller-port" in str(ei.value)
    assert "TTP_PORT" in str(ei.value)


def test_wrong_key_cannot_register(closing):
    """A rank with another job's key fails the CURVE handshake: not one of its frames
    reaches the controller's application (nothing decoded, nothing rejected there)."""
    ctl = Controller(CFG, 1, "127.0.0.1", 0).start()
    closing.callback(ctl.stop)
    bad = dataclasses.replace(CFG, auth_key=b"x" * 32)
    with pytest.raises(ControlPlaneError, match="registration failed"):
        Processor(bad, 0, Layout(), None, port=ctl.port).start(timeout=0.5)
    deadline = time.monotonic() + 30  # the refused handshake's event reaches the controller's thread
    while not ctl.transport_rejected.totals and time.monotonic() < deadline:
        time.sleep(0.01)
    ctl.stop()
    assert sum(ctl.transport_rejected.totals.values()) >= 1
    assert ctl.codec.accepted == 0 and not ctl.codec.rejected


def test_unreachable_controller_fails_within_the_deadline_and_names_it(closing):
    with pytest.raises(ControlPlaneError, match="--ha-connect-timeout"):
        Processor(CFG, 0, Layout(), None, port=free_port()).start(timeout=0.5)


def test_missing_auth_key_is_config_error():
    with pytest.raises(ConfigError, match="MINDSPEED_HA_AUTH_KEY"):
        Controller(dataclasses.replace(CFG, auth_key=None), 1)
    with pytest.raises(ConfigError, match="MINDSPEED_HA_AUTH_KEY"):
        Processor(dataclasses.replace(CFG, auth_key=None), 0, Layout())


def test_registration_retries_are_logged_once(closing, caplog):
    """A rank that starts before its controller re-sends REGISTER until answered; the
    rank and the controller each log the registration once, not once per REGISTER."""
    caplog.set_level(logging.DEBUG, logger="mindspeed_ha.control")
    port = free_port()
    p = Processor(CFG, 0, Layout(), None, port=port)
    closing.callback(p.close, None)
    started = {}
    t = threading.Thread(target=lambda: started.setdefault("p", p.start(timeout=60)))
    closing.callback(t.join, 60)
    t.start()

    def lines(logger, text):
        return [r for r in caplog.records if r.name == logger and text in r.getMessage()]

    deadline = time.monotonic() + 30
    while len(lines("mindspeed_ha.control.processor", "REGISTER #")) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lines("mindspeed_ha.control.processor", "REGISTER #")) >= 3  # nobody listening yet
    ctl = Controller(CFG, 1, "127.0.0.1", port, tick_s=0.01).start()
    closing.callback(ctl.stop)
    t.join(60)
    assert started.get("p") is p
    # the REGISTERs queued while nobody listened reach the controller too: each is answered
    deadline = time.monotonic() + 30
    while not lines("mindspeed_ha.control.controller", "REGISTER repeated") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lines("mindspeed_ha.control.controller", "REGISTER repeated")
    p.close(0)
    assert ctl.wait_done(30) is not None  # every REGISTERED has been handled by now
    assert len(lines("mindspeed_ha.control.processor", "registered with the controller")) == 1
    assert len(lines("mindspeed_ha.control.controller", "registered (pid")) == 1


def _end(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_standalone_controller_imports_nothing_heavy_and_answers(closing, tmp_path):
    """``python -m mindspeed_ha.control.controller``, as rank 0 starts it under plain torchrun,
    imports neither torch nor megatron (so it listens within a second of starting), answers a
    rank, and exits with the job."""
    port = free_port()
    err = open(tmp_path / "controller.err", "w+")
    closing.callback(err.close)
    cmd = [sys.executable, "-X", "importtime", "-m", "mindspeed_ha.control.controller", "--world-size", "1",
           "--port", str(port), "--bind", "127.0.0.1", "--registration-timeout", "120"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, MINDSPEED_HA_AUTH_KEY=KEY.hex()),
                            stdout=subprocess.DEVNULL, stderr=err)
    closing.callback(_end, proc)
    p = Processor(CFG, 0, Layout(), None, port=port)
    closing.callback(p.close, None)
    p.start(timeout=60)  # raises ControlPlaneError unless the controller answers
    p.close(0)
    assert proc.wait(60) == 0  # every rank said goodbye 0: the job is over
    err.seek(0)
    text = err.read()
    imported = {line.rsplit("|", 1)[1].strip().split(".")[0]
                for line in text.splitlines() if line.startswith("import time:")}
    assert "zmq" in imported, text[-2000:]
    heavy = imported & {"torch", "megatron", "numpy", "transformer_engine", "apex"}
    assert not heavy, f"the standalone controller imports {sorted(heavy)}"


def test_standalone_controller_exits_without_registrations(monkeypatch, no_leaks):
    from mindspeed_ha.control import controller

    monkeypatch.setenv("MINDSPEED_HA_AUTH_KEY", KEY.hex())
    assert controller.main(["--world-size", "2", "--port", "0", "--registration-timeout", "0.3"]) == 1
    monkeypatch.delenv("MINDSPEED_HA_AUTH_KEY")
    assert controller.main(["--world-size", "2", "--port", "0"]) == 2  # no key: refuses to start


def test_standalone_controller_exits_with_the_job(monkeypatch, closing):
    from mindspeed_ha.control import controller

    monkeypatch.setenv("MINDSPEED_HA_AUTH_KEY", KEY.hex())
    port = free_port()
    rc = {}
    t = threading.Thread(target=lambda: rc.setdefault("rc", controller.main(
        ["--world-size", "1", "--port", str(port), "--registration-timeout", "10"])))
    closing.callback(t.join, 30)
    t.start()
    p = Processor(CFG, 0, Layout(), None, port=port)
    closing.callback(p.close, None)
    p.start(timeout=30)
    p.close(0)
    t.join(30)
    assert rc["rc"] == 0


@pytest.mark.hog
def test_stopped_rank_is_detected_and_ended_by_the_launcher(tmp_path):
    """SIGSTOP is a hang: the process and its TCP connections stay, every thread stops,
    heartbeats included. The controller declares the rank dead after the heartbeat
    timeout, the survivors write the dying checkpoint, and the launcher SIGKILLs the
    stopped process itself (it cannot act on torchrun's closing SIGTERM)."""
    import json

    import psutil

    save, report, fired_log = str(tmp_path / "ckpt"), str(tmp_path / "report.json"), str(tmp_path / "fired.jsonl")
    args = tiny_gpt_args(tp=1, pp=2, train_iters=5) + [
        "--enable-high-availability", "--ha-controller-port", "0", "--save", save,
        "--ha-heartbeat-interval", "0.5", "--ha-heartbeat-timeout", "5"]
    r = launch(4, args, launcher=launcher_command(4), timeout_s=300, env={
        "MINDSPEED_HA_INJECT": "rank=1,iteration=3,point=backward,fault=stop",
        "MINDSPEED_HA_INJECT_LOG": fired_log, "MINDSPEED_HA_REPORT": report})
    assert not r.timed_out, r.stderr[-6000:]
    assert r.returncode == EXIT_DYING_CHECKPOINT_SAVED, r.stderr[-6000:]
    with open(fired_log) as f:
        fired = [json.loads(line) for line in f]
    assert [(x["rank"], x["fault"]) for x in fired] == [(1, "stop")]
    pid = fired[0]["pid"]
    with open(report) as f:
        rep = json.load(f)
    assert rep["fault_rank"] == 1 and "rank 1 missed heartbeats" in rep["events"][0]["reason"]
    assert rep["iteration"] == 2  # iteration 3 was being computed: nothing completed is lost
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == 2
    assert f"worker rank 1 (pid {pid}) is unresponsive" in r.stderr, r.stderr[-6000:]
    assert f"Sending process {pid} closing signal" not in r.stderr  # torchrun had nothing left to end
    assert not psutil.pid_exists(pid)


# --------------------------------------------------------------------------- graceful stop, controller loss
def _wait_for(cond, timeout=20.0, what="condition"):
    """Wait until ``cond()`` holds (polled: it reads state another thread owns)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        threading.Event().wait(0.01)


def _trainer(p, completed, closing):
    """A rank's training thread: pause point, then the update of the next iteration, ..."""
    def run():
        k = completed
        try:
            while k < 100:
                p.pause_point(k)
                k += 1
                p.begin_update(k)
                p.end_update(k)
        except ProcessorExited:
            pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    closing.callback(t.join, 10)
    return t


def test_graceful_stop_pauses_every_rank_after_the_same_iteration(job, closing):
    """request_stop (the launcher's SIGTERM): DRAIN(-1) -> each rank announces the iteration it
    is in (rank 3 is one behind), DRAIN(6) -> every rank finishes up to 6 and pauses there;
    then the dying checkpoint of 6 with every rank alive, and EXIT 75."""
    j = job()
    for k in range(1, 6):
        j.step(k, ranks=range(3) if k == 5 else None)
    for r, p in enumerate(j.procs):
        p.pause_point(5 if r < 3 else 4)  # no limit yet: returns at once
    j.ctl.request_stop("SIGTERM to the launcher (test)")
    _wait_for(lambda: j.ctl.state.drain_until is not None, what="DRAIN(K)")
    assert j.ctl.state.drain_until == 6
    assert {r: i.pause_at for r, i in j.ctl.state.ranks.items()} == {0: 6, 1: 6, 2: 6, 3: 5}
    for r, p in enumerate(j.procs):
        _trainer(p, 5 if r < 3 else 4, closing)
    out = j.ctl.wait_done(20)
    assert out is not None and out.exit_code == EXIT_DYING_CHECKPOINT_SAVED, out
    assert out.iteration == 6 and out.fault_rank is None and out.stop_request.rank == -1
    assert [e.action for e in out.events] == [ActionKind.DRAIN, ActionKind.DRAIN, ActionKind.DUMP, ActionKind.ASSEMBLE,
                                              ActionKind.COMMIT, ActionKind.EXIT, ActionKind.NOOP]
    for r in range(WORLD):
        assert j.exited[r].wait(5) and j.exits[r][0] == EXIT_DYING_CHECKPOINT_SAVED
        assert j.procs[r].status() == (OptimizerStatus.UPDATED, 6)
    assert {"drain", "save", "total"} <= set(out.timings)


def test_stop_request_from_a_rank(job):
    """A rank's SIGTERM handler asks for the stop (StopRequest): the controller drains the job."""
    j = job()
    j.step(1)
    assert j.procs[2].request_stop("SIGTERM to rank 2 (test)")
    _wait_for(lambda: j.ctl.state.stop_request is not None, what="the stop request")
    assert j.ctl.state.stop_request.rank == 2
    for p in j.procs:
        assert p.stop_event.wait(10)  # DRAIN reached every rank


def _loss_cfg():
    return dataclasses.replace(CFG, heartbeat_interval_s=0.1, heartbeat_timeout_s=4.0)  # lost after 2 s without a controller


def test_controller_lost_is_noticed_over_the_connection_and_logged_once(closing, caplog):
    """The controller goes away (its process would; here its sockets close): every processor
    notices the closed connection, declares the controller lost once, and, with no way to
    agree with the other ranks (no exchange registered), ends with 78."""
    caplog.set_level(logging.WARNING, logger="mindspeed_ha.control.processor")
    cfg = _loss_cfg()
    ctl = Controller(cfg, 2, "127.0.0.1", 0, tick_s=0.01).start()
    closing.callback(ctl.stop)
    exits, procs = {}, []
    done = {r: threading.Event() for r in range(2)}
    for r in range(2):
        def on_exit(code, reason, r=r):
            exits[r] = (code, reason)
            done[r].set()
        p = Processor(cfg, r, Layout(dp_rank=r, dp_size=2, replica_count=2, instance_id=r), "/save",
                      port=ctl.port, exit_handler=on_exit)
        closing.callback(p.close, None)
        procs.append(p.start())
    _wait_for(lambda: len(ctl.state.ranks) == 2, what="registration")
    ctl.stop()
    for r in range(2):
        assert done[r].wait(30)
        assert exits[r][0] == EXIT_CONTROLLER_LOST and "controller lost" in exits[r][1]
        assert procs[r].controller_lost_at is not None
    lost = [rec.getMessage() for rec in caplog.records if "CONTROLLER LOST" in rec.getMessage()]
    assert sorted(m.split(":")[0] for m in lost) == ["rank 0", "rank 1"]


def test_standby_controller_at_the_same_address_takes_over(closing):
    """A controller that comes back at the same address before the loss is declared (a
    standby) gets every rank registered again; nobody declares the controller lost."""
    cfg = _loss_cfg()
    port = free_port()
    first = Controller(cfg, 2, "127.0.0.1", port, tick_s=0.01).start()
    closing.callback(first.stop)
    procs = []
    for r in range(2):
        p = Processor(cfg, r, Layout(dp_rank=r, dp_size=2, replica_count=2, instance_id=r), "/save",
                      port=port, exit_handler=lambda code, reason: pytest.fail(f"exit {code}: {reason}"))
        closing.callback(p.close, None)
        procs.append(p.start())
    _wait_for(lambda: len(first.state.ranks) == 2, what="registration")
    first.stop()
    standby = Controller(cfg, 2, "127.0.0.1", port, tick_s=0.01).start()
    closing.callback(standby.stop)
    _wait_for(lambda: len(standby.state.ranks) == 2, what="registration with the standby")
    for p in procs:
        _wait_for(lambda: p.link.disconnected_at is None, what="reconnection")
        assert p.controller_lost_at is None
    procs[0].begin_update(1)
    procs[0].end_update(1)
    _wait_for(lambda: standby.state.ranks[0].iteration == 1, what="status reaching the standby")
