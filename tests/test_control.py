"""Controller + processors in one process over real localhost ZeroMQ."""

import threading
import time

import pytest
import zmq

from mindspeed_ha.config import ConfigError, HAConfig
from mindspeed_ha.control import wire
from mindspeed_ha.control.controller import Controller
from mindspeed_ha.control.policy import ActionKind, DumpPlan
from mindspeed_ha.control.processor import Processor, ProcessorExited
from mindspeed_ha.control.state import Layout, OptimizerStatus, Phase
from mindspeed_ha.faults import (EXIT_DYING_CHECKPOINT_SAVED, EXIT_FAULT_UNRECOVERABLE, EXIT_NO_COMPLETE_DATA,
                                 CommunicationError, ControlPlaneError, FaultKind)

KEY = b"t" * 32
CFG = HAConfig(enabled=True, distributed_optimizer=True, replica_count=2, auth_key=KEY, controller_addr="127.0.0.1",
               heartbeat_interval_s=0.05, heartbeat_timeout_s=0.3, stop_timeout_s=2.0, action_timeout_s=5.0,
               connect_timeout_s=5.0, save_dir=None)
WORLD = 4  # TP1 PP1 DP4, N=2: instances {0,1} and {2,3}; shard s held by ranks s and s+2


class Job:
    """A controller and WORLD processors with recording action handlers."""

    def __init__(self, cfg=CFG, save_dir="/save", dump_delay=0.0):
        self.ctl = Controller(cfg, WORLD, "127.0.0.1", 0, tick_s=0.01).start()
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

    def close(self):
        for p in self.procs:
            p.close(None)  # the controller is gone: no GOODBYE to linger on
        self.ctl.stop()


@pytest.fixture
def no_leaks():
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not leaked, f"leaked threads: {leaked}"


@pytest.fixture
def job(no_leaks):
    jobs = []

    def make(**kw):
        j = Job(**kw)
        jobs.append(j)
        return j

    yield make
    for j in jobs:
        j.close()


def assert_dying_checkpoint(j, dead, iteration):
    out = j.ctl.wait_done(10)
    assert out is not None and out.phase is Phase.DONE
    assert out.exit_code == EXIT_DYING_CHECKPOINT_SAVED, out.reason
    assert out.iteration == iteration and out.fault_rank == dead
    plan = out.plan
    assert dead not in plan.savers()
    # DUMP went exactly to the plan's savers, with the same plan
    assert sorted(r for r, _ in j.calls["dump"]) == list(plan.savers())
    for _, params in j.calls["dump"]:
        assert DumpPlan.from_params(params) == plan and params["save_dir"] == "/save"
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
        assert j.procs[r].stop_event.wait(5)
    latency = max(j.procs[r].stop_received_at for r in (0, 1, 3)) - t0
    out = assert_dying_checkpoint(j, dead=2, iteration=2)
    assert latency < 0.25, latency  # disconnect -> STOP at every survivor (ms; see report)
    plan = out.plan
    assert plan.shard_savers == {(0, 0, 0): 0, (0, 0, 1): 1}  # instance 0 intact: preferred


def test_report_rank_exit_is_instant(job):
    j = job()
    j.step(1)
    t0 = time.monotonic()
    j.ctl.report_rank_exit(0, -9)
    for r in (1, 2, 3):
        assert j.procs[r].stop_event.wait(5)
    latency = max(j.procs[r].stop_received_at for r in (1, 2, 3)) - t0
    out = assert_dying_checkpoint(j, dead=0, iteration=1)
    assert out.plan.shard_savers == {(0, 0, 0): 2, (0, 0, 1): 3}
    assert latency < 0.1, latency
    assert out.timings["detect"] < 0.1


def test_missed_heartbeats_detected_after_timeout(no_leaks):
    # a fifth, hung rank: registers through a raw socket and then never speaks again
    ctl = Controller(CFG, 2, "127.0.0.1", 0, tick_s=0.01).start()
    try:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        wire.configure_socket(raw, CFG.max_message_bytes)
        raw.connect(f"tcp://127.0.0.1:{ctl.port}")
        codec = wire.Codec(KEY, wire.new_sender("rank", 1))
        lay = Layout(dp_rank=1, dp_size=2, replica_count=2, instance_id=1)
        raw.send(codec.encode(wire.Register(1, 2, 1, "h", lay, "/save", "", "updated", 1)))
        assert raw.poll(5000)
        raw.recv()
        p0 = Processor(CFG, 0, Layout(dp_size=2, replica_count=2), "/save", port=ctl.port,
                       iteration=1, exit_handler=lambda c, r: None).start()
        t_silent = time.monotonic()
        assert p0.stop_event.wait(5)
        detect = p0.stop_received_at - t_silent
        assert CFG.heartbeat_timeout_s <= detect < CFG.heartbeat_timeout_s + 0.2, detect
        out = ctl.wait_done(10)
        assert out.exit_code == EXIT_FAULT_UNRECOVERABLE or out.exit_code == EXIT_NO_COMPLETE_DATA or \
            out.exit_code == EXIT_DYING_CHECKPOINT_SAVED
        assert "missed heartbeats" in out.events[0].reason
        p0.close(0)
        raw.close(0)
        ctx.term()
    finally:
        ctl.stop()


def test_freeze_blocks_begin_update_and_dirty_holder_is_skipped(job):
    j = job()
    j.step(1)
    j.procs[1].begin_update(2)  # rank 1 is inside update 2 when the fault hits: dirty
    j.step(2, ranks=[0, 2, 3])
    j.ctl.report_rank_exit(3, 1)
    assert j.procs[1].stop_event.wait(5)
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

    assert j.procs[0].stop_event.wait(5)
    t = threading.Thread(target=next_step)
    t.start()
    assert started.wait(5)
    out = j.ctl.wait_done(10)
    t.join(5)
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


def test_normal_end_all_goodbye(no_leaks):
    ctl = Controller(CFG, 2, "127.0.0.1", 0, tick_s=0.01).start()
    try:
        ps = [Processor(CFG, r, Layout(dp_rank=r, dp_size=2, replica_count=2, instance_id=r), None,
                        port=ctl.port).start() for r in range(2)]
        for p in ps:
            p.close(0)
        out = ctl.wait_done(5)
        assert out.phase is Phase.DONE and out.exit_code is None and out.fault_rank is None
    finally:
        ctl.stop()


def test_port_in_use_is_config_error(no_leaks):
    a = Controller(CFG, 1, "127.0.0.1", 0).start()
    try:
        with pytest.raises(ConfigError) as ei:
            Controller(CFG, 1, "127.0.0.1", a.port).start()
        assert str(a.port) in str(ei.value) and "--ha-controller-port" in str(ei.value)
        assert "TTP_PORT" in str(ei.value)
    finally:
        a.stop()


def test_wrong_key_cannot_register(no_leaks):
    ctl = Controller(CFG, 1, "127.0.0.1", 0).start()
    try:
        bad = CFG.with_auth_key(b"x" * 32)
        with pytest.raises(ControlPlaneError, match="registration failed"):
            Processor(bad, 0, Layout(), None, port=ctl.port).start(timeout=0.5)
        assert ctl.codec.rejected["bad_mac"] >= 1
    finally:
        ctl.stop()


def test_missing_auth_key_is_config_error():
    with pytest.raises(ConfigError, match="MINDSPEED_HA_AUTH_KEY"):
        Controller(CFG.replace(auth_key=None), 1)
    with pytest.raises(ConfigError, match="MINDSPEED_HA_AUTH_KEY"):
        Processor(CFG.replace(auth_key=None), 0, Layout())


def test_standalone_controller_exits_without_registrations(monkeypatch, no_leaks):
    from mindspeed_ha.control import controller

    monkeypatch.setenv("MINDSPEED_HA_AUTH_KEY", KEY.hex())
    t0 = time.monotonic()
    assert controller.main(["--world-size", "2", "--port", "0", "--registration-timeout", "0.3"]) == 1
    assert time.monotonic() - t0 < 5
    monkeypatch.delenv("MINDSPEED_HA_AUTH_KEY")
    assert controller.main(["--world-size", "2", "--port", "0"]) == 2  # no key: refuses to start


def test_standalone_controller_exits_with_the_job(monkeypatch, no_leaks):
    from mindspeed_ha.control import controller

    monkeypatch.setenv("MINDSPEED_HA_AUTH_KEY", KEY.hex())
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = {}
    t = threading.Thread(target=lambda: rc.setdefault("rc", controller.main(
        ["--world-size", "1", "--port", str(port), "--registration-timeout", "10"])))
    t.start()
    p = Processor(CFG, 0, Layout(), None, port=port)
    p.start()
    p.close(0)
    t.join(10)
    assert rc["rc"] == 0
