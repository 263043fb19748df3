"""A restarted worker rejoins the running job: its start-up is replayed, not run (recovery/rejoin.py).

Four plain ``torch.distributed`` processes on gloo (no Megatron), with mindspeed-ha's patches
and the ``ha`` feature on, on the test's TCPStore (torchrun's agent store,
``TORCHELASTIC_USE_AGENT_STORE``). The start-up of every rank: ``init_process_group``, five
``new_group`` calls (two with the same ranks, one rank 2 is not in), a broadcast from rank 0 of
a flags tensor that rank 0 draws at random, a barrier, an all_reduce over WORLD, an all_gather
on a sub-group; then ``rejoin.startup_done()`` (the record goes into the store) and one real
all_reduce. Rank 2 SIGKILLs itself; the survivors' next all_reduce fails (the test's stand-in
for the controller calls ``comm.abort`` once the test saw rank 2 die) and they reset. The test
starts a new rank-2 process with ``MINDSPEED_HA_INCARNATION=1``: it runs the same start-up
code while the survivors stay parked in a store wait, and gets the same flags (rank 0's random
draw, replayed), the same all_reduce / all_gather results, on deferred groups. Then every rank
calls ``rebuild_process_groups(generation=1)``: the new rank's deferred groups become real gloo
groups with the names the survivors use; real all_reduces over WORLD and each sub-group give
the right sums and ``stale_holders`` is empty on every rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

WORLD = 4
DEAD = 2
#: the job's key (MINDSPEED_HA_AUTH_KEY): start-up records are sealed with it
JOB_KEY = bytes(range(32))

WORKER = textwrap.dedent('''
    import datetime, json, os, sys, threading

    import mindspeed_ha  # installs the patch hooks
    from mindspeed_ha.patches import enable

    enable("ha")  # what the runtime does once --enable-high-availability is parsed

    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore

    from mindspeed_ha.recovery import comm, groups, rejoin

    OUT = sys.argv[1]
    RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    INC = rejoin.incarnation()
    WAIT = datetime.timedelta(seconds=60)
    TEST = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=WAIT)  # the test's own coordination keys
    G = {}  # module global: a holder the rebuild swaps


    def startup():
        dist.init_process_group("gloo", timeout=WAIT)
        G["pair01"] = dist.new_group([0, 1])
        G["pair23"] = dist.new_group([2, 3])
        G["even"] = dist.new_group([0, 2])
        G["even_twin"] = dist.new_group([0, 2])  # same ranks: a distinct group
        G["gloo_world"] = dist.new_group(list(range(WORLD)), backend="gloo")
        flags = torch.zeros(3, dtype=torch.int64)
        if RANK == 0:  # decided once by rank 0 (like Megatron's do_train/valid/test flags)
            flags.copy_(torch.tensor(list(os.urandom(3)), dtype=torch.int64))
        dist.broadcast(flags, src=0)
        dist.barrier()
        total = torch.tensor([float(RANK + 1)])
        dist.all_reduce(total)
        mine = "pair23" if RANK in (2, 3) else "pair01"
        gathered = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(gathered, torch.tensor([RANK, 10.0 * RANK]), group=G[mine])
        return {"flags": flags.tolist(), "total": total.item(), "gathered": [g.tolist() for g in gathered]}


    def dump(name, record):
        with open(os.path.join(OUT, f"{name}.json"), "w") as f:
            json.dump(record, f)


    def sums():
        out = {}
        for key, ranks in (("world", None), ("pair01", [0, 1]), ("pair23", [2, 3]), ("even", [0, 2]),
                           ("even_twin", [0, 2]), ("gloo_world", None)):
            if ranks is not None and RANK not in ranks:
                continue
            t = torch.tensor([float(RANK + 1)])
            dist.all_reduce(t, group=None if key == "world" else G[key])
            out[key] = t.item()
        return out


    def names():
        w = dist.distributed_c10d._world
        return {k: str(w.pg_names[g]) for k, g in G.items() if g in w.pg_names}


    seen = startup()
    seen["mode"] = rejoin.mode()
    if INC:
        seen["backend_before_rebuild"] = str(dist.get_backend())
        seen["intended"] = {k: v[0] for k, v in groups.INTENDED_BACKENDS.items()}
    seen["blob_bytes"] = rejoin.startup_done()
    seen["rejoined"], seen["omitted"] = rejoin.rejoined(), rejoin.omitted()
    seen["pid"] = os.getpid()
    seen["names_before"] = names()
    dump(f"start{RANK}.{INC}", seen)

    if INC == 0:
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        assert t.item() == WORLD, t
        if RANK == %(dead)d:
            os.kill(os.getpid(), 9)
        # the controller's part: once the dead rank is seen, abort this rank's collectives
        watcher = threading.Thread(target=lambda: (TEST.wait(["test/dead"]), comm.abort("rank died")))
        watcher.start()
        failed = None
        try:
            dist.all_reduce(torch.tensor([1.0]))
        except Exception as exc:  # gloo's link error or CollectiveAborted, whichever first
            failed = type(exc).__name__
        watcher.join(WAIT.total_seconds())
        assert failed and not watcher.is_alive(), (failed, watcher.is_alive())
        comm.reset()
        TEST.wait(["test/replayed"])  # parked until the new process finished its start-up
    else:
        TEST.set("test/replayed", "1")

    old_world = id(dist.group.WORLD)  # an id: a list of the groups would be swapped by the rebuild
    report = groups.rebuild_process_groups(1, timeout=WAIT)
    result = {"pid": os.getpid(), "failed": INC == 0 and failed, "sums": sums(), "names": names(),
              "groups": report.groups, "unswapped": report.unswapped,
              "backend": str(dist.get_backend()), "world_is_new": id(dist.group.WORLD) != old_world}
    result["stale"] = groups.stale_holders(groups.retired_groups())
    dump(f"end{RANK}", result)
    TEST.set(f"test/end{RANK}", "1")
    TEST.wait([f"test/end{r}" for r in range(WORLD)])  # nobody leaves while a peer still needs it
    sys.stdout.flush()
    # the survivors' old groups hold an abandoned gloo op: skip their destructors at exit
    os._exit(0)
''') % {"dead": DEAD}


def _read(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.timeout(240)
def test_restarted_rank_replays_startup_and_rejoins_rebuilt_groups(tmp_path):
    from torch.distributed import TCPStore

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    store = TCPStore("127.0.0.1", 0, WORLD + 2, is_master=True, wait_for_workers=False)
    logs = {}

    def start(rank, incarnation):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), OMP_NUM_THREADS="1",
                   TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
                   MINDSPEED_HA_AUTH_KEY=JOB_KEY.hex())  # the records are sealed with it
        env.pop("MINDSPEED_HA_INJECT", None)
        env.pop("MINDSPEED_HA_INCARNATION", None)
        if incarnation:
            env["MINDSPEED_HA_INCARNATION"] = str(incarnation)
        log = open(tmp_path / f"rank{rank}.{incarnation}.log", "w")
        logs[(rank, incarnation)] = log
        return subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, stdout=log,
                                stderr=subprocess.STDOUT)

    def tail(rank, incarnation):
        return (tmp_path / f"rank{rank}.{incarnation}.log").read_text()[-3000:]

    procs = {}
    try:
        for rank in range(WORLD):
            procs[rank] = start(rank, 0)
        deadline = time.monotonic() + 200
        assert procs[DEAD].wait(timeout=100) == -signal.SIGKILL, tail(DEAD, 0)
        store.set("test/dead", "1")
        first = procs[DEAD]
        procs[DEAD] = start(DEAD, 1)
        for rank, p in procs.items():
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        for rank, p in procs.items():
            assert p.returncode == 0, (rank, tail(rank, 1 if rank == DEAD else 0))
    finally:
        for p in list(procs.values()) + ([first] if "first" in locals() else []):
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs.values():
            log.close()
        del store

    start0 = [_read(tmp_path / f"start{r}.0.json") for r in range(WORLD)]
    replayed = _read(tmp_path / f"start{DEAD}.1.json")
    ends = [_read(tmp_path / f"end{r}.json") for r in range(WORLD)]
    # recording on every rank; the same flags everywhere (rank 0's random draw)
    assert all(s["mode"] == "record" and s["blob_bytes"] > 0 for s in start0), start0
    assert len({tuple(s["flags"]) for s in start0}) == 1
    # the new process got exactly what its first incarnation got, on deferred groups
    assert replayed["mode"] == "replay" and replayed["blob_bytes"] is None
    assert replayed["rejoined"] and replayed["omitted"] == [] and not any(s["rejoined"] for s in start0)
    for key in ("flags", "total", "gathered", "names_before"):
        assert replayed[key] == start0[DEAD][key], (key, replayed[key], start0[DEAD][key])
    assert replayed["total"] == sum(range(1, WORLD + 1))
    assert replayed["backend_before_rebuild"] == "ha_deferred"
    assert set(replayed["intended"].values()) == {"gloo"}, replayed["intended"]
    assert replayed["pid"] != start0[DEAD]["pid"]
    # survivors: same processes throughout; their collective failed once rank 2 died
    for r in range(WORLD):
        if r != DEAD:
            assert ends[r]["pid"] == start0[r]["pid"] and ends[r]["failed"], ends[r]
    # after the rebuild: real groups with one name per group on every member, right sums
    expect = {"world": 10.0, "gloo_world": 10.0, "pair01": 3.0, "pair23": 7.0, "even": 4.0, "even_twin": 4.0}
    for r, e in enumerate(ends):
        assert e["sums"] == {k: v for k, v in expect.items() if k in e["sums"]}, (r, e["sums"])
        assert len(e["sums"]) == (5 if r in (0, 2) else 3), (r, e["sums"])
        assert e["stale"] == [] and e["unswapped"] == [], (r, e["stale"], e["unswapped"])
        assert e["backend"] == "gloo" and e["world_is_new"], e
        for key, name in e["names"].items():
            assert name.endswith(".ha1"), (r, key, name)
            for other in ends:
                assert other["names"].get(key, name) == name, (r, key, name, other["names"])
    assert ends[0]["names"]["even"] != ends[0]["names"]["even_twin"]
    print(f"\nstart-up record per rank (bytes): {[s['blob_bytes'] for s in start0]}; "
          f"groups rebuilt on rank {DEAD}: {len(ends[DEAD]['groups'])}")


#: what the one-process replay scripts share: a new "incarnation" of the process, and a
#: refusal as text (inserted at their ``# REPLAY_HELPERS`` line)
REPLAY_HELPERS = textwrap.dedent('''
    def again(incarnation):
        dist.destroy_process_group()
        rejoin.reset()
        os.environ["MINDSPEED_HA_INCARNATION"] = str(incarnation)


    def refused(fn):
        try:
            fn()
        except rejoin.RejoinError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None
''')


def _script(template: str) -> str:
    return template.replace("# REPLAY_HELPERS\n", REPLAY_HELPERS)


REFUSALS = textwrap.dedent('''
    import json, os, sys

    import mindspeed_ha  # noqa: F401
    from mindspeed_ha.patches import enable

    enable("ha")
    import torch
    import torch.distributed as dist

    from mindspeed_ha.recovery import rejoin

    STORE = dist.HashStore()
    out = {}


    def start(x, on_subgroup=False, ops=True):
        dist.init_process_group("gloo", store=STORE, rank=0, world_size=1)
        g = dist.new_group([0])
        t = torch.tensor([x])
        big = torch.full((100000,), x)  # 400 kB: over MAX_OUTPUT_BYTES, recorded without data
        if ops:
            dist.all_reduce(t, group=g if on_subgroup else None)
            dist.broadcast(big, 0)
        return t.item(), big[0].item()


    # REPLAY_HELPERS


    out["recorded"] = start(5.0)
    out["bytes"] = rejoin.startup_done()
    again(1)  # replayed: the recorded 5.0 comes back for an input of 7.0; big is left as it is
    out["replayed"] = start(7.0)
    out["backend"] = str(dist.get_backend())
    out["omitted"] = rejoin.omitted()
    out["done"] = rejoin.startup_done()
    out["rejoined"] = rejoin.rejoined()
    again(1)
    out["mismatch"] = refused(lambda: start(7.0, on_subgroup=True))
    again(1)
    start(7.0, ops=False)
    out["unserved"] = refused(rejoin.startup_done)
    again(1)
    start(7.0)
    out["past_end"] = refused(lambda: dist.barrier())
    out["deferred_op"] = refused(lambda: dist.distributed_c10d._world.default_pg.barrier())
    out["missing"] = refused(lambda: rejoin.load(STORE, rank=7))
    again(0)
    rejoin.MAX_BLOB_BYTES = 64
    start(5.0)
    out["too_big_bytes"] = rejoin.startup_done()
    again(1)
    out["too_big"] = refused(lambda: start(7.0))
    again(0)
    rejoin.MAX_BLOB_BYTES = 4 << 20
    start(5.0)
    with dist.distributed_c10d._coalescing_manager(async_ops=False):  # not replayable
        dist.all_reduce(torch.ones(2))
    out["unsupported_bytes"] = rejoin.startup_done()
    again(1)
    out["unsupported"] = refused(lambda: start(7.0))
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.timeout(120)
def test_replay_serves_recorded_values_and_refuses_clearly(tmp_path):
    """One rank, in a child process: a replay hands back the recorded value (not the one
    computed now), leaves an output recorded without data as it is, and refuses with the call
    index and both sides when the start-up differs, ends early, runs past the record, has no
    record, was too big or used ``_coalescing_manager``; an op on a deferred group raises
    instead of hanging."""
    script = tmp_path / "refusals.py"
    script.write_text(_script(REFUSALS))
    env = dict(os.environ, OMP_NUM_THREADS="1", MINDSPEED_HA_AUTH_KEY=JOB_KEY.hex())
    env.pop("MINDSPEED_HA_INCARNATION", None)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert out["recorded"] == [5.0, 5.0] and 0 < out["bytes"] < 2000, out
    assert out["replayed"] == [5.0, 7.0] and out["backend"] == "ha_deferred", out
    assert out["done"] is None and out["rejoined"], out
    assert len(out["omitted"]) == 1 and "#1 broadcast" in out["omitted"][0], out["omitted"]
    assert out["mismatch"].startswith("RejoinMismatch: rejoin: start-up call 0 differs"), out["mismatch"]
    assert "now #0 all_reduce on group 1 ranks [0]" in out["mismatch"], out["mismatch"]
    assert "recorded #0 all_reduce on group 0 ranks [0]" in out["mismatch"], out["mismatch"]
    assert "ended after 0 collective(s)" in out["unserved"] and "recorded 2" in out["unserved"], out
    assert "past the end of the record" in out["past_end"] and "#2 barrier" in out["past_end"], out
    assert "deferred process group" in out["deferred_op"], out
    assert "no start-up record" in out["missing"], out
    assert out["too_big_bytes"] < 400 and "'too_big'" in out["too_big"], out
    assert out["unsupported_bytes"] < 400 and "'unsupported'" in out["unsupported"], out
    assert "_coalescing_manager" in out["unsupported"], out


def test_a_start_up_record_not_sealed_with_the_job_key_is_refused(tmp_path, monkeypatch, caplog):
    """torchrun's store and the lease directory are reachable by others: a record that a
    stranger wrote (unsealed, sealed with another key, or rank 2's valid record copied to
    rank 3's key) is refused with a clear error, never replayed; a forged lease copy is
    ignored (logged)."""
    import torch.distributed as dist

    from mindspeed_ha.control import sealed
    from mindspeed_ha.errors import RejoinError
    from mindspeed_ha.recovery import startup_blob

    monkeypatch.setenv("MINDSPEED_HA_AUTH_KEY", JOB_KEY.hex())
    monkeypatch.setenv("MINDSPEED_HA_LEASE_DIR", str(tmp_path / "lease"))
    head = {"format": startup_blob.FORMAT, "version": startup_blob.VERSION, "status": "ok", "reason": "",
            "rank": 3, "torch": "x"}
    blob = startup_blob.encode(head, [])
    store, k2, k3 = dist.HashStore(), startup_blob.KEY.format(rank=2), startup_blob.KEY.format(rank=3)
    store.set(k3, sealed.seal(JOB_KEY, k3, blob))
    assert startup_blob.load(store, 3)["rank"] == 3
    for forged, why in ((blob, "not a sealed file"), (sealed.seal(b"k" * 32, k3, blob), "does not match"),
                        (sealed.seal(JOB_KEY, k2, blob), "does not match")):
        store.set(k3, forged)
        with pytest.raises(RejoinError, match=f"{k3}.* is refused: .*{why}.*not sealed with the job's key is never replayed"):
            startup_blob.load(store, 3)
    # the lease copy (read when the store has none): sealed and verified too
    startup_blob.write_lease_copy(3, blob)
    assert startup_blob.load(dist.HashStore(), 3)["rank"] == 3
    (tmp_path / "lease" / "startup-rank3.msgpack").write_bytes(blob)  # a stranger's
    with pytest.raises(RejoinError, match="no start-up record"):
        startup_blob.load(dist.HashStore(), 3)
    assert "startup-rank3.msgpack ignored (SealError" in caplog.text


LOAD_SECTION = textwrap.dedent('''
    import json, os

    import mindspeed_ha  # noqa: F401
    from mindspeed_ha.patches import enable

    enable("ha")
    import torch
    import torch.distributed as dist
    import wrapt

    from mindspeed_ha.recovery import rejoin

    STORE = dist.HashStore()
    found = {"iteration": 4}  # the latest checkpoint in --load (= --save) now
    ran = []  # iterations the loader really loaded


    def load_checkpoint():  # like Megatron-LM's: collectives of its own (tracker all_reduce, barrier)
        t = torch.tensor([found["iteration"]])
        dist.all_reduce(t)
        dist.barrier()
        ran.append(int(t.item()))
        return int(t.item()), 1.5 * t.item()


    loader = wrapt.FunctionWrapper(load_checkpoint, rejoin.load_section)  # what ha.rejoin.load.* does


    def start(with_load=True):
        dist.init_process_group("gloo", store=STORE, rank=0, world_size=1)
        dist.barrier()
        got = loader() if with_load else None
        dist.all_reduce(torch.ones(1))
        return got


    # REPLAY_HELPERS


    out = {"first": start()}  # the first start-up resumes checkpoint 4
    rejoin.startup_done()
    out["record"] = [e["op"] for e in rejoin.load()["entries"]]  # the default store, rank 0
    found["iteration"] = 8  # periodic saves since
    out["after"] = loader()  # after the start-up (e.g. a reload) the loader runs as usual
    again(1)
    out["replayed"] = start()  # the restarted process: not loaded, the first start-up's outcome
    out["unserved"] = refused(rejoin.startup_done)
    out["rejoined"] = rejoin.rejoined()
    again(1)
    out["without_load"] = refused(lambda: start(with_load=False))
    again(0)
    start(with_load=False)
    rejoin.startup_done()
    again(1)
    out["unexpected_load"] = refused(start)
    out["ran"] = ran
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.timeout(120)
def test_startup_load_is_one_entry_and_not_run_when_replayed(tmp_path):
    """``--load`` = ``--save``: the first start-up resumed checkpoint 4, periodic saves wrote
    8 since. The start-up's load_checkpoint is recorded as one entry with what it returned,
    not as its own collectives (its all_reduce and barrier); a restarted process does not
    load (8 would take other collectives and state the survivors never had) and gets (4, 6.0),
    the first start-up's outcome; after the start-up the loader runs as usual; a start-up
    that loads where the record did not, or the reverse, is refused naming both sides."""
    script = tmp_path / "load_section.py"
    script.write_text(_script(LOAD_SECTION))
    env = dict(os.environ, OMP_NUM_THREADS="1", MINDSPEED_HA_AUTH_KEY=JOB_KEY.hex())  # records are sealed
    env.pop("MINDSPEED_HA_INCARNATION", None)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert out["first"] == [4, 6.0] and out["record"] == ["barrier", "load_checkpoint", "all_reduce"], out
    assert out["replayed"] == [4, 6.0] and out["unserved"] is None and out["rejoined"], out
    assert out["after"] == [8, 12.0] and out["ran"] == [4, 8], out
    assert "call 1 differs" in out["without_load"] and "now #1 all_reduce" in out["without_load"], out
    assert "recorded #1 load_checkpoint" in out["without_load"], out
    assert "now #1 load_checkpoint" in out["unexpected_load"] and "recorded #1 all_reduce" in out["unexpected_load"], out
