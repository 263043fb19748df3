"""Wire format: round trip, authentication, version, size cap, replay."""

import msgpack
import pytest

from mindspeed_ha.control import wire
from mindspeed_ha.control.state import Layout

KEY = b"k" * 32


def codecs(max_bytes=wire.DEFAULT_MAX_BYTES):
    return wire.Codec(KEY, "rank-0-aaaa", max_bytes), wire.Codec(KEY, "controller-bbbb", max_bytes)


BODIES = [
    wire.Register(3, 8, 1234, "host", Layout(tp_rank=1, dp_rank=2, dp_size=4, replica_count=2, instance_id=1,
                                            shard_id=0), "/save", "run"),
    wire.Register(0, 1, 1, "h", Layout(), None, ""),
    wire.Registered(3, True, ""),
    wire.Heartbeat(3, 10, "updated"),
    wire.Status(3, "updating", 11),
    wire.Fault(3, 11, "network", "Connection closed by peer", "updating"),
    wire.Stop("rank 2 died"),
    wire.Stopped(3, "updated", 10),
    wire.Action(7, "dump", {"iteration": 10, "shard_savers": [[0, 0, 0, 3]], "save_dir": None}),
    wire.ActionResult(7, 3, False, "disk full"),
    wire.Goodbye(3, 75),
    wire.SwitchView("sw-1", [2, 3], ["start", "commit"]),
    wire.NodeBeat(2, [b"\x00k\x8b\x45\x67", b"\x00k\x8b\x45\x68"]),
    wire.NodeAnswers(2, "stopped", {"status": "updated", "iteration": 10, "pause_at": -1, "step": 11},
                     [b"\x00k\x8b\x45\x67", b"\x00k\x8b\x45\x68"], [16, 17]),
]


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_round_trip(body):
    tx, rx = codecs()
    msg = rx.decode(tx.encode(body))
    assert msg.body == body
    assert wire.BODY_TYPES[msg.type] is type(body)
    assert msg.sender == tx.sender and msg.seq == 1


def test_bad_mac_rejected_and_counted():
    tx, _ = codecs()
    other = wire.Codec(b"x" * 32, "controller-cccc")
    frame = tx.encode(wire.Heartbeat(0, 1, "updated"))
    with pytest.raises(wire.WireError) as ei:
        other.decode(frame)
    assert ei.value.reason == "bad_mac"
    tampered = bytearray(frame)
    tampered[-1] ^= 1
    _, rx = codecs()
    assert rx.try_decode(bytes(tampered)) is None
    assert rx.rejected["bad_mac"] == 1


def _forge(envelope: dict, key=KEY) -> bytes:
    import hashlib
    import hmac

    raw = msgpack.packb(envelope, use_bin_type=True)
    return hmac.new(key, raw, hashlib.sha256).digest() + raw


def test_wrong_version_and_unknown_type_rejected():
    _, rx = codecs()
    body = {"rank": 0, "iteration": 1, "status": "updated"}
    with pytest.raises(wire.WireError) as ei:
        rx.decode(_forge({"v": 99, "type": "heartbeat", "seq": 1, "sender": "s", "body": body}))
    assert ei.value.reason == "bad_version"
    with pytest.raises(wire.WireError) as ei:
        rx.decode(_forge({"v": wire.SCHEMA_VERSION, "type": "pickle", "seq": 2, "sender": "s", "body": body}))
    assert ei.value.reason == "bad_type"
    with pytest.raises(wire.WireError) as ei:
        rx.decode(_forge({"v": wire.SCHEMA_VERSION, "type": "heartbeat", "seq": 3, "sender": "s",
                          "body": {"rank": "zero", "iteration": 1, "status": "updated"}}))
    assert ei.value.reason == "bad_body"
    with pytest.raises(wire.WireError) as ei:
        rx.decode(_forge({"v": wire.SCHEMA_VERSION, "type": "heartbeat", "seq": 4, "sender": "s",
                          "body": dict(body, extra=1)}))
    assert ei.value.reason == "bad_body"
    assert rx.rejected == {"bad_version": 1, "bad_type": 1, "bad_body": 2}


def test_oversize_rejected_both_ways():
    tx, rx = codecs(max_bytes=4096)
    with pytest.raises(wire.WireError) as ei:
        tx.encode(wire.Fault(0, 1, "unknown", "x" * 5000, "updated"))
    assert ei.value.reason == "oversize"
    big_tx = wire.Codec(KEY, "rank-1-dddd", 1 << 20)
    with pytest.raises(wire.WireError) as ei:
        rx.decode(big_tx.encode(wire.Fault(0, 1, "unknown", "x" * 5000, "updated")))
    assert ei.value.reason == "oversize"


def test_replay_and_non_increasing_seq_rejected():
    tx, rx = codecs()
    f1 = tx.encode(wire.Heartbeat(0, 1, "updated"))
    f2 = tx.encode(wire.Heartbeat(0, 2, "updated"))
    assert rx.decode(f2).seq == 2
    with pytest.raises(wire.WireError) as ei:
        rx.decode(f1)  # older seq
    assert ei.value.reason == "replay"
    with pytest.raises(wire.WireError):
        rx.decode(f2)  # same frame again
    # a new incarnation of the same rank is a new sender, accepted from seq 1
    tx2 = wire.Codec(KEY, wire.new_sender("rank", 0))
    assert rx.decode(tx2.encode(wire.Heartbeat(0, 3, "updated"))).seq == 1
    assert rx.rejected["replay"] == 2


def test_garbage_never_raises_from_try_decode():
    _, rx = codecs()
    for junk in (b"", b"x" * 10, b"\x00" * 40, _forge([1, 2, 3]), _forge({"v": 1})):
        assert rx.try_decode(junk) is None
    assert sum(rx.rejected.values()) == 5


def test_rejections_are_counted_and_logged_at_a_bounded_rate(caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="mindspeed_ha.control.wire")
    _, rx = codecs()
    for i in range(10_000):  # 10 s of garbage from one peer at 1 kHz
        assert rx.try_decode(b"x", peer="evil", now=i / 1000) is None
    assert rx.rejected["short"] == 10_000
    assert len(caplog.records) <= 2  # the first one, then at most one per interval with the count


def test_seq_memory_is_bounded():
    """A receiver remembers a bounded number of senders (CURVE keeps frames from being
    captured, so a forgotten sender's old frames cannot be replayed from outside)."""
    rx = wire.Codec(KEY, "controller-bbbb", max_senders=3)
    senders = [wire.Codec(KEY, f"rank-{i}-x") for i in range(5)]
    first = [tx.encode(wire.Heartbeat(0, 1, "updated")) for tx in senders]
    for frame in first:
        rx.decode(frame)
    with pytest.raises(wire.WireError):  # remembered: a replay
        rx.decode(first[-1])
    assert rx.decode(first[0]).seq == 1  # the least recently heard sender was forgotten


def test_short_key_refused():
    with pytest.raises(ValueError, match="MINDSPEED_HA_AUTH_KEY"):
        wire.Codec(b"short", "x")


def test_endpoint_ipv6():
    assert wire.endpoint("::1", 80) == "tcp://[::1]:80"
    assert wire.endpoint("10.0.0.1", 80) == "tcp://10.0.0.1:80"


def test_close_all_ends_sockets_and_context_with_pending_messages():
    """A frame queued for a peer that never came must not keep the context alive."""
    import socket

    import zmq

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, -1)  # the default: wait forever; close_all overrides it
    dealer.connect(wire.endpoint("127.0.0.1", port))
    dealer.send(b"queued", zmq.NOBLOCK)
    idle = ctx.socket(zmq.ROUTER)
    wire.close_all(ctx, dealer, idle, None)
    assert dealer.closed and idle.closed and ctx.closed
    wire.close_all(ctx, dealer)  # idempotent


def test_node_beat_subs_must_be_bytes_and_bounded():
    """NODE_BEAT (schema 13): ``subs`` are binary identities, at most MAX_BEAT_SUBS of them."""
    tx, rx = codecs()
    for subs in (["text"], [b"x"] * (wire.MAX_BEAT_SUBS + 1), [b"x" * 256]):
        env = {"v": wire.SCHEMA_VERSION, "type": "node_beat", "seq": 1, "sender": "relay-0-aaaa",
               "body": {"node_rank": 0, "subs": subs}}
        with pytest.raises(wire.WireError) as ei:
            rx.decode(_forge(env))
        assert ei.value.reason == "bad_body"


def test_node_answers_merge_only_routine_answers_and_expand_per_rank():
    """NODE_ANSWERS (schema 14): only a STOPPED, an ACTION_RESULT ok or a FAULT aborted may be
    merged; the common body is checked against the type (no ``rank`` in it), subs and ranks
    pair up; each named rank gets its own body."""
    tx, rx = codecs()
    ok = wire.NodeAnswers(0, "action_result", {"action_id": 7, "ok": True, "detail": ""}, [b"a", b"b"], [4, 5])
    got = rx.decode(tx.encode(ok)).body.bodies()
    assert got == [wire.ActionResult(7, 4, True, ""), wire.ActionResult(7, 5, True, "")]
    fault = {"iteration": 3, "message": "m", "status": "updated", "where": "train_step"}
    bad = [("heartbeat", {"iteration": 1, "status": "updated"}, [b"a"], [0]),
           ("action_result", {"action_id": 7, "ok": False, "detail": "disk full"}, [b"a"], [0]),
           ("action_result", {"action_id": 7, "ok": 1, "detail": ""}, [b"a"], [0]),
           ("fault", {**fault, "kind": "uce"}, [b"a"], [0]),
           ("stopped", {"rank": 1, "status": "updated", "iteration": 1}, [b"a"], [0]),
           ("stopped", {"status": "updated", "iteration": "1"}, [b"a"], [0]),
           ("stopped", {"status": "updated", "iteration": 1}, [b"a", b"b"], [0]),
           ("stopped", {"status": "updated", "iteration": 1}, [b"x" * 256], [0]),
           ("stopped", {"status": "updated", "iteration": 1}, [b"a"] * (wire.MAX_BEAT_SUBS + 1),
            [0] * (wire.MAX_BEAT_SUBS + 1))]
    for seq, (answer, body, subs, ranks) in enumerate(bad, start=1):
        env = {"v": wire.SCHEMA_VERSION, "type": "node_answers", "seq": seq, "sender": "relay-0-aaaa",
               "body": {"node_rank": 0, "answer": answer, "body": body, "subs": subs, "ranks": ranks}}
        with pytest.raises(wire.WireError) as ei:
            rx.decode(_forge(env))
        assert ei.value.reason == "bad_body", answer
    assert wire.NodeAnswers(0, "fault", {**fault, "kind": "aborted"}, [b"a"], [3]).bodies()[0].rank == 3
