"""The controller's phase events: one event per phase, and ``Outcome.timings`` read from them.

A controller that is not started is driven by hand (a fake clock, a fake ROUTER socket);
the events it records must give the timings the decision log implies.
"""

import collections

import zmq

from mindspeed_ha.config import HAConfig
from mindspeed_ha.control import wire
from mindspeed_ha.control.controller import Controller
from mindspeed_ha.control.outcome import PhaseTimer
from mindspeed_ha.control.policy import ActionKind
from mindspeed_ha.control.state import ClusterState, Layout, Phase, StopRequest
from mindspeed_ha.events import EventRecorder
from mindspeed_ha.faults import FaultKind

KEY = b"e" * 32
CFG = HAConfig(enabled=True, distributed_optimizer=True, replica_count=2, auth_key=KEY, controller_addr="127.0.0.1",
               heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0, stop_timeout_s=5.0, action_timeout_s=10.0,
               connect_timeout_s=10.0, save_dir=None)


class _Frame:
    def __init__(self, data):
        self.bytes = data
        self.buffer = memoryview(data)

    def get(self, option):
        raise zmq.ZMQError(zmq.EINVAL)


class _Router:
    def __init__(self):
        self.inbox = collections.deque()
        self.sent = []

    def recv_multipart(self, flags=0, copy=True):
        if not self.inbox:
            raise zmq.Again()
        ident, data = self.inbox.popleft()
        return [_Frame(ident), _Frame(data)]

    def send_multipart(self, parts, flags=0):
        self.sent.append(parts)


class _Clock:
    t = 100.0

    def __call__(self):
        return self.t


def _two_ranks_registered(cfg, clock, rejoins=True, first=()):
    """A controller with ranks 0 and 1 registered; ``first``: (ident, frame) it gets before."""
    ctl = Controller(cfg, 2, "127.0.0.1", 0, clock=clock)
    ctl._router = _Router()
    ctl._router.inbox.extend(first)
    for r in range(2):
        codec = wire.Codec(KEY, wire.new_sender("rank", r))
        lay = Layout(dp_rank=r, dp_size=2, replica_count=2, instance_id=r)
        ctl._router.inbox.append((b"r%d" % r, codec.encode(wire.Register(r, 2, 1000 + r, "h", lay, "/save", "run",
                                                                          "updated", 1, rejoins=rejoins))))
    ctl._turn()
    assert sorted(ctl.state.ranks) == [0, 1]
    return ctl


def test_silent_ranks_give_detect_decide_total_from_the_events():
    clock = _Clock()
    ctl = _two_ranks_registered(CFG, clock, rejoins=False)
    while ctl.state.phase is not Phase.DONE and clock.t < 200:
        clock.t += 1.0
        ctl._turn()
    out = ctl.outcome()
    first = {}
    for e in out.events:
        first.setdefault(e.action, e.t)
    assert ActionKind.STOP_ALL in first and ActionKind.EXIT in first
    assert out.timings["detect"] == first[ActionKind.STOP_ALL] - ctl.state.fault.at
    assert out.timings["total"] == first[ActionKind.EXIT] - ctl.state.fault.at
    assert "save" not in out.timings  # nothing was dumped
    phases = [e.name for e in ctl.recorder.events() if e.seconds or e.name in out.timings]
    assert set(out.timings) <= set(phases)
    assert {e.name for e in ctl.recorder.events()} >= {"stop_sent", "exit_sent", "detect", "total"}
    assert all(e.source == "controller" for e in ctl.recorder.events())


def test_phase_timer_one_event_per_phase_and_a_new_round_after_resume():
    st = ClusterState(world_size=1, phase_since=0.0)
    rec = EventRecorder("controller")
    timer = PhaseTimer(rec)
    st.record_fault(10.0, 0, FaultKind.UNKNOWN, "test")
    timer.applied(11.0, ActionKind.STOP_ALL, st)
    timer.applied(11.5, ActionKind.STOP_ALL, st)  # a second stop round: no second detect
    timer.applied(13.0, ActionKind.VERIFY, st)
    timer.applied(14.0, ActionKind.DUMP, st)
    timer.applied(20.0, ActionKind.EXIT, st)
    assert timer.timings() == {"detect": 1.0, "decide": 3.0, "verify": 1.0, "save": 6.0, "total": 10.0}
    assert [e.name for e in rec.events() if e.seconds == 0] == ["stop_sent", "stop_sent", "verify_sent",
                                                               "dump_sent", "exit_sent"]
    timer.applied(21.0, ActionKind.RESUME, st)
    assert timer.timings() == {}


def test_graceful_stop_times_the_drain_and_a_fault_takes_it_over():
    st = ClusterState(world_size=1, phase_since=0.0)
    timer = PhaseTimer(EventRecorder("controller"))
    st.stop_request = StopRequest(5.0, -1, "SIGTERM")
    timer.applied(6.0, ActionKind.DRAIN, st)
    timer.applied(8.0, ActionKind.DUMP, st)
    timer.applied(9.0, ActionKind.EXIT, st)
    assert timer.timings() == {"save": 1.0, "drain": 3.0, "total": 4.0}
    st2 = ClusterState(world_size=1, phase_since=0.0)
    timer2 = PhaseTimer(EventRecorder("controller"))
    st2.stop_request = StopRequest(5.0, -1, "SIGTERM")
    timer2.applied(6.0, ActionKind.DRAIN, st2)
    timer2.applied(7.0, ActionKind.VERIFY, st2)  # drain ends here ...
    st2.record_fault(7.5, 0, FaultKind.UNKNOWN, "test")
    timer2.applied(8.0, ActionKind.STOP_ALL, st2)  # ... but a fault takes the round over
    timer2.applied(9.0, ActionKind.EXIT, st2)
    assert timer2.timings() == {"detect": 0.5, "decide": 1.0, "verify": 2.0, "total": 1.5}


def test_a_fault_reported_after_the_retry_answer_survives_the_resume():
    """Found by the soak run: rank 1 answered RETRY, re-ran the step and reported a new
    network fault before the last rank answered; RESUME erased every rank's fault, so rank 1
    stayed parked in its fault handler and its peers blocked in a collective (gloo's 600 s
    timeout). The fault reported after the RETRY was sent must start the next round."""
    from mindspeed_ha.control import effects
    from mindspeed_ha.control.policy import Decision, decide
    from mindspeed_ha.control.state import PendingAction

    clock = _Clock()
    ctl = _two_ranks_registered(CFG, clock, rejoins=False)
    st = ctl.state
    st.phase = Phase.RECOVERING
    for r, at in ((0, 99.0), (1, 101.0)):  # rank 0: the fault recovered; rank 1: a new one after the RETRY
        info = st.ranks[r]
        info.fault, info.fault_message, info.fault_at, info.failed_at = FaultKind.NETWORK, "link", at, 99.0
        info.last_heartbeat = clock.t
    st.record_fault(99.0, 0, FaultKind.NETWORK, "link")
    st.pending = PendingAction(7, ActionKind.RETRY.value, (0, 1), 100.0, {}, {0: (True, ""), 1: (True, "")})
    effects._recovered(ctl, clock.t, Decision(ActionKind.RESUME, "recovered", None, (), Phase.RUNNING))
    assert st.ranks[0].fault is None
    assert st.ranks[1].fault is FaultKind.NETWORK and st.ranks[1].failed_at == 101.0
    st.phase = Phase.RUNNING
    d = decide(clock.t, st, CFG)
    assert d.action is ActionKind.STOP_ALL and "rank 1 reported network fault" in d.reason, d.reason


def test_a_hung_rank_of_this_launcher_is_ended_and_awaited_to_rejoin_under_worker_reboot():
    """ARF for a hang: with --enable-worker-reboot, a rank of this controller's own launcher
    whose heartbeats stopped is declared dead at once, listed (with its pid) for the
    launcher to SIGKILL, and awaited to rejoin: the recovery round (RECOVERING), not the
    dying checkpoint (before: "not restarted: controller in phase committing", exit 75)."""
    import dataclasses

    clock = _Clock()
    cfg = dataclasses.replace(CFG, worker_reboot=True)
    ctl = _two_ranks_registered(cfg, clock)
    ctl.hosted_ranks = frozenset({0, 1})
    _silence(ctl, clock, cfg, silent=1)
    st = ctl.state
    assert st.phase is Phase.RECOVERING, [e.reason for e in ctl.events]
    assert 1 in st.rejoin_wait and not st.ranks[1].alive
    assert ctl.unresponsive_ranks().keys() == {1} and ctl.unresponsive_ranks()[1][0] == 1001
    assert ctl.restart_refused(1) is None  # its agent may restart it once the launcher ended it
    # the new process registers (incarnation 1, another pid): nothing left to end
    codec = wire.Codec(KEY, wire.new_sender("rank", 1))
    lay = Layout(dp_rank=1, dp_size=2, replica_count=2, instance_id=1)
    ctl._router.inbox.append((b"r1b", codec.encode(wire.Register(1, 2, 2001, "h", lay, "/save", "run", "updated", 1,
                                                                 incarnation=1, rejoins=True))))
    ctl._turn()
    assert ctl.state.ranks[1].pid == 2001 and 1 not in ctl.unresponsive_ranks()


def _silence(ctl, clock, cfg, silent):
    """Controller turns every 0.5 s past the heartbeat timeout; every rank but ``silent`` beats."""
    end = clock.t + cfg.heartbeat_timeout_s + 1.0
    while clock.t < end:
        clock.t += 0.5
        for r, info in ctl.state.ranks.items():
            if r != silent and info.alive:
                info.last_heartbeat = clock.t
        ctl._turn()


def test_a_controller_stall_or_a_silent_job_ends_no_process():
    """After a stall of the controller itself (its process frozen longer than the timeout)
    every rank looks silent; ending them would lose the job: no rank is declared hung, the
    silent-rank path (dying checkpoint) decides as before."""
    import dataclasses

    cfg = dataclasses.replace(CFG, worker_reboot=True)
    for beats in (True, False):
        clock = _Clock()
        ctl = _two_ranks_registered(cfg, clock)
        ctl.hosted_ranks = frozenset({0, 1})
        ctl._turn()
        clock.t += cfg.heartbeat_timeout_s + 1.0  # one long stall between two turns
        if beats:  # rank 0's heartbeat was handled in this turn, rank 1's not
            ctl.state.ranks[0].last_heartbeat = clock.t
        ctl._turn()
        assert not ctl.arbiter.hung and not ctl.state.rejoin_wait, beats
        if not beats:  # every rank silent, turns regular again: still no hung process
            for _ in range(4):
                clock.t += 0.5
                ctl._turn()
            assert not ctl.arbiter.hung, "every rank silent is not one hung process"


def test_a_hung_rank_of_another_node_is_ended_by_its_agent_and_awaited_to_rejoin():
    """ARF for a hang on a node without the controller: its agent said AGENT_HELLO for the
    rank, so the controller declares the silent rank hung and sends END_WORKER (rank, pid)
    to that agent's connection, and awaits the new process (RECOVERING), as on its own node."""
    import dataclasses

    clock = _Clock()
    cfg = dataclasses.replace(CFG, worker_reboot=True)
    agent = wire.Codec(KEY, wire.new_sender("agent", 1))  # node 1's agent, before its worker starts
    ctl = _two_ranks_registered(cfg, clock, first=[(b"a1", agent.encode(wire.AgentHello(1, [1], 4242, "node1", 1)))])
    ctl.hosted_ranks = frozenset({0})
    _silence(ctl, clock, cfg, silent=1)
    st = ctl.state
    assert st.phase is Phase.RECOVERING and 1 in st.rejoin_wait, [e.reason for e in ctl.events]
    rx = wire.Codec(KEY, "x")
    sent = [(parts[0], rx.decode(parts[-1]).body) for parts in ctl._router.sent if parts[0] == b"a1"]
    ends = [(i, b) for i, b in sent if isinstance(b, wire.EndWorker)]
    assert [(i, b.rank, b.pid) for i, b in ends] == [(b"a1", 1, 1001)], ends
    assert "hung" in ends[0][1].detail

    def end_workers():
        return [b for parts in ctl._router.sent if parts[0] == b"a1"  # a fresh codec: no replay check across calls
                for b in [wire.Codec(KEY, "x").decode(parts[-1]).body] if isinstance(b, wire.EndWorker)]

    for _ in range(5):  # not ended yet: sent again every END_WORKER_RESEND_S (2 s)
        clock.t += 0.5
        ctl.state.ranks[0].last_heartbeat = clock.t
        ctl._turn()
    assert len(end_workers()) == 2, end_workers()
    codec = wire.Codec(KEY, wire.new_sender("rank", 1))  # its new process registers: nothing left to end
    lay = Layout(dp_rank=1, dp_size=2, replica_count=2, instance_id=1)
    ctl._router.inbox.append((b"r1b", codec.encode(wire.Register(1, 2, 2001, "h", lay, "/save", "run", "updated", 1,
                                                                 incarnation=1, rejoins=True))))
    for _ in range(6):
        clock.t += 0.5
        ctl.state.ranks[0].last_heartbeat = clock.t
        ctl._turn()
    assert len(end_workers()) == 2, end_workers()


def test_a_hung_rank_elsewhere_or_without_worker_reboot_keeps_the_dying_checkpoint_path():
    """Without --enable-worker-reboot, or for a rank of another node whose agent never
    spoke to this controller (no connection to send END_WORKER to), silence still means
    the dying checkpoint (STOPPING)."""
    import dataclasses

    for cfg, hosted in ((CFG, {0, 1}), (dataclasses.replace(CFG, worker_reboot=True), {0})):
        clock = _Clock()
        ctl = _two_ranks_registered(cfg, clock)
        ctl.hosted_ranks = frozenset(hosted)
        _silence(ctl, clock, cfg, silent=1)
        assert ctl.state.phase is Phase.STOPPING, (cfg.worker_reboot, [e.reason for e in ctl.events])
        assert not ctl.state.rejoin_wait


def test_another_node_s_agent_keeps_end_worker_and_ends_only_that_pid():
    """The agent side of END_WORKER: the link keeps one that arrives while it waits for an
    answer (RESTART_ANSWER here) and hands it over at the next monitor turn
    (``AgentLink.end_requests``); the launcher SIGKILLs the worker of that rank only while
    it still runs as that pid (``survivors.end_workers_asked_by_link``)."""
    import dataclasses
    import signal
    import types

    from mindspeed_ha.control.agent_link import AgentLink
    from mindspeed_ha.launch import survivors

    controller = wire.Codec(KEY, wire.new_sender("controller", 0))

    class _Dealer:
        def __init__(self, frames):
            self.frames, self.sent = collections.deque(frames), []

        def poll(self, timeout, flags):
            return bool(self.frames)

        def recv(self, copy=True):
            return _Frame(self.frames.popleft())

        def send(self, data, flags=0):
            self.sent.append(data)

    link = AgentLink(dataclasses.replace(CFG, worker_reboot=True), 1, timeout_s=1.0)
    try:
        link._sock = _Dealer([controller.encode(wire.EndWorker(2, 4242, "no heartbeat for 11.0 s: hung")),
                              controller.encode(wire.RestartAnswer(3, 1, ""))])
        assert link.restart_refused(3, -9) is None  # the answer it waited for
        ends = link.end_requests()
        assert [(e.rank, e.pid) for e in ends] == [(2, 4242)] and link.end_requests() == []
    finally:
        link._sock = None
        link.close()

    class _Handler:
        def __init__(self, pid):
            self.proc = types.SimpleNamespace(pid=pid, poll=lambda: None, wait=lambda t: 0)
            self.signals = []

        def close(self, death_sig):
            self.signals.append(death_sig)

    handlers = {0: _Handler(4242), 1: _Handler(5151)}
    pcontext = types.SimpleNamespace(subprocess_handlers=handlers, envs={0: {"RANK": "2"}, 1: {"RANK": "3"}})
    state = survivors.Survivors(None, 5.0, link=types.SimpleNamespace(end_requests=lambda: ends))
    survivors.supervise(pcontext, state)
    assert handlers[0].signals == [signal.SIGKILL] and handlers[1].signals == [] and state.killed == {4242}
    ends = [wire.EndWorker(3, 9999, "hung")]  # an earlier process of rank 3: its pid is not the worker's now
    survivors.supervise(pcontext, state)
    assert handlers[1].signals == []


def test_a_silent_rank_inside_its_ordered_recovery_is_not_ended_until_the_action_timeout():
    """Rank 1 is a target of the pending RETRY (rebuilding its groups), connected but silent
    past the heartbeat timeout: its launcher is not told to SIGKILL it and the recovery
    waits (before: listed in ``unresponsive_ranks``, the dying checkpoint, exit 77 -- the
    failover job at load 30-50). Past ``action_timeout_s`` the recovery falls back and the
    silent rank is listed: a hung rank is still ended."""
    import dataclasses

    from mindspeed_ha.control.state import PendingAction

    clock = _Clock()
    cfg = dataclasses.replace(CFG, worker_reboot=True)
    ctl = _two_ranks_registered(cfg, clock)
    ctl.hosted_ranks = frozenset({0, 1})
    st = ctl.state
    st.set_phase(Phase.RECOVERING, clock.t, "test")
    st.record_fault(clock.t, 0, FaultKind.UCE, "uce")
    st.abort_sent_at = clock.t
    st.pending = PendingAction(7, ActionKind.RETRY.value, (0, 1), clock.t, {"iteration": 1, "mode": "rollback"})
    st.pending.results[0] = (True, "{}")
    _silence(ctl, clock, cfg, silent=1)
    assert clock.t - st.ranks[1].last_heartbeat > cfg.heartbeat_timeout_s
    assert st.phase is Phase.RECOVERING and st.ranks[1].alive, [e.reason for e in ctl.events]
    assert ctl.unresponsive_ranks() == {} and not ctl.arbiter.hung
    clock.t = st.pending.sent_at + cfg.action_timeout_s + 0.5
    st.ranks[0].last_heartbeat = clock.t
    ctl._turn()
    assert st.phase is Phase.STOPPING, [e.reason for e in ctl.events]
    assert ctl.unresponsive_ranks().keys() == {1}


def test_a_replaced_process_cannot_register_again_nor_end_the_rank():
    """A process that a hot switch or a restart replaced (a lower incarnation) may still talk
    while it exits; asked to register again (an unregistered peer is), its REGISTER is
    refused, so the live rank keeps its new process and the old one's GOODBYE ends nothing
    (before: a whole-node switch's old rank 0 registered again after the commit, then its
    GOODBYE marked the new rank 0 dead)."""
    clock = _Clock()
    ctl = _two_ranks_registered(CFG, clock)
    lay = Layout(dp_rank=1, dp_size=2, replica_count=2, instance_id=1)
    new = wire.Codec(KEY, wire.new_sender("rank", 1))
    ctl._router.inbox.append((b"r1b", new.encode(wire.Register(1, 2, 2001, "h", lay, "/save", "run", "updated", 1,
                                                                incarnation=1, rejoins=True))))
    ctl._turn()
    assert ctl.state.ranks[1].pid == 2001 and ctl.state.ranks[1].incarnation == 1
    ctl._router.sent.clear()
    old = wire.Codec(KEY, wire.new_sender("rank", 1))  # the old process (incarnation 0), connected again
    ctl._router.inbox.append((b"r1c", old.encode(wire.Register(1, 2, 1001, "h", lay, "/save", "run", "updated", 1,
                                                                incarnation=0, rejoins=True))))
    ctl._router.inbox.append((b"r1c", old.encode(wire.Goodbye(1, 0))))
    ctl._turn()
    info = ctl.state.ranks[1]
    assert info.pid == 2001 and info.alive and info.exit_code is None, info
    answers = [wire.Codec(KEY, wire.new_sender("controller", 0)).decode(parts[1]) for parts in ctl._router.sent
               if parts[0] == b"r1c"]
    refused = [m.body for m in answers if m.type is wire.MsgType.REGISTERED]
    assert len(refused) == 1 and not refused[0].accepted and "replaced by incarnation 1 (pid 2001)" in refused[0].detail
