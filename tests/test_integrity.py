"""Integrity of every recovery source (issue 6, item 2): a corrupted copy is never saved.

Units: the digest a rank reports (``dying``) sees a NaN and a single flipped bit and is the
same for a shard in memory and read back from its file; the corruption injector's spec.
End to end on 4 gloo ranks (real megatron-core, ``mindspeed-ha-run``), the injector
corrupting one rank's state (``fault=corrupt``) and another rank SIGKILLed:

* a NaN replica with a good replica left: exit 75, the corrupt rank saves nothing, the
  checkpoint is bit for bit the uninterrupted run's and resumes with the same losses;
* a flipped bit (finite) with 3 agreeing replicas: the majority wins, the same proof;
* no trustworthy copy (NaN + its replica dead; 2 finite replicas that differ): exit 76,
  nothing published (tracker unchanged, no iter dir, no staging dir);
* corruption after the verification, before the save: the saver's re-check fails, exit
  77, nothing published.
"""

import json
import os
import re

import pytest

from mindspeed_ha import faults
from mindspeed_ha.testing.compare import compare_checkpoint_dirs
from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args
from mindspeed_ha.testing.injector import FaultSpec

ITERS = 6  # as tests/test_dying_checkpoint.py: the PP2 uninterrupted run is shared (conftest)
KILL_AT = 3
LAYOUTS = {"pp2": dict(tp=1, pp=2), "dp4": dict(tp=1, pp=1)}  # pp2: 2 replicas per shard; dp4 below: 4
EXTRA = {"pp2": [], "dp4": ["--ha-replica-count", "4"]}


# --------------------------------------------------------------------------- units
def _shard(values):
    import torch

    bucket = {k: torch.tensor(values, dtype=torch.float32) * (i + 1)
              for i, k in enumerate(("param", "exp_avg", "exp_avg_sq"))}
    bucket.update(gbuf_world_numel=2 * len(values), numel_unpadded=2 * len(values) - 1)
    dtype_key = (torch.float32, torch.float32)
    return {"num_shards": 2, "buffers": {0: {"numel_unpadded": 7, "dtypes": {dtype_key: [bucket]}}}}


def test_shard_digest_sees_nan_and_a_flipped_bit_and_survives_the_file(tmp_path):
    import torch

    from mindspeed_ha.checkpoint import integrity
    from mindspeed_ha.checkpoint.formats.torch import atomic_torch_save

    good = integrity.shard_file_digest(_shard([1.0, 2.0, 3.0, 4.0]))
    assert good[0] and good[1].startswith("xxh3-128:") and len(good[1]) == 9 + 32 and not good[2]
    flipped = _shard([1.0, 2.0, 3.0, 4.0])
    flipped["buffers"][0]["dtypes"][(torch.float32, torch.float32)][0]["exp_avg"][:1].view(torch.int32) \
        .bitwise_xor_(1)
    ok, digest, _ = integrity.shard_file_digest(flipped)
    assert ok and digest != good[1]  # finite, only the digest sees it
    nan = _shard([1.0, float("nan"), 3.0, 4.0])
    ok, _, why = integrity.shard_file_digest(nan)
    assert not ok and "param of buffer 0" in why and "1 of 4 values not finite" in why
    path = str(tmp_path / "s.pt")
    atomic_torch_save(dict(_shard([1.0, 2.0, 3.0, 4.0]), iteration=3), path)
    assert integrity.shard_file_digest(torch.load(path, map_location="cpu", weights_only=False)) == good


def test_a_saver_catches_one_changed_byte_and_refuses_a_digest_of_another_version():
    """The saver's check (:func:`integrity.expect`) against the trusted digest: one byte
    changed anywhere in a tensor fails it; a trusted digest of another algorithm (the
    untagged blake2b-128 of versions before issue 21, or another tag) is refused with a
    message naming it, never compared."""
    import hashlib

    import torch

    from mindspeed_ha.checkpoint import integrity
    from mindspeed_ha.errors import IntegrityError

    trusted = integrity.shard_file_digest(_shard([1.0, 2.0, 3.0, 4.0]))[1]
    integrity.expect("shard", integrity.shard_file_digest(_shard([1.0, 2.0, 3.0, 4.0])), trusted)
    for at in range(16):  # every byte of one state tensor, the last one included
        bad = _shard([1.0, 2.0, 3.0, 4.0])
        raw = bad["buffers"][0]["dtypes"][(torch.float32, torch.float32)][0]["exp_avg_sq"].view(torch.uint8)
        raw[at] ^= 0x10
        with pytest.raises(IntegrityError, match="digest .* != trusted"):
            integrity.expect("shard", integrity.shard_file_digest(bad), trusted)
    old = hashlib.blake2b(b"any", digest_size=16).hexdigest()  # what a version before issue 21 sent
    for foreign, algo in ((old, "untagged"), ("sha256:" + "0" * 64, "sha256")):
        with pytest.raises(IntegrityError, match=f"algorithm {algo}.*not xxh3-128.*another mindspeed-ha version"):
            integrity.expect("shard", integrity.shard_file_digest(_shard([1.0, 2.0, 3.0, 4.0])), foreign)


def test_model_digest_covers_names_dtypes_and_bytes():
    import torch

    from mindspeed_ha.checkpoint import integrity

    state = {"model": {"a.weight": torch.ones(2, 3), "b.bias": torch.zeros(3, dtype=torch.bfloat16),
                       "_extra_state": None}}
    names = {"model": ["a.weight", "b.bias"]}
    ok, digest, _ = integrity.model_state_digest(state, names)
    assert ok
    other = {"model": dict(state["model"], **{"b.bias": torch.zeros(3, dtype=torch.float32)})}
    assert integrity.model_state_digest(other, names)[1] != digest  # same values, other dtype
    state["model"]["a.weight"][1, 2] = float("inf")
    assert not integrity.model_state_digest(state, names)[0]


def test_corrupt_spec():
    spec = FaultSpec.parse("rank=2,iteration=4,point=between,fault=corrupt,what=main_param,how=bitflip")
    assert (spec.fault, spec.what, spec.how) == ("corrupt", "main_param", "bitflip")
    assert FaultSpec.parse("rank=0,iteration=1,point=dying,fault=corrupt,what=param").how == "nan"
    for bad, why in [("rank=0,iteration=1,point=backward,fault=corrupt,what=param", "only at points"),
                     ("rank=0,iteration=1,point=between,fault=corrupt,what=grad", "needs what="),
                     ("rank=0,iteration=1,point=between,fault=corrupt,what=param,how=zero", "how="),
                     ("rank=0,iteration=1,point=between,what=param", "fault=corrupt only")]:
        with pytest.raises(ValueError, match=why):
            FaultSpec.parse(bad)


def test_integrity_wire_round_trip():
    from mindspeed_ha.control import wire
    from mindspeed_ha.control.state import Layout

    tx, rx = wire.Codec(b"k" * 32, "rank-0-a"), wire.Codec(b"k" * 32, "controller-b")
    for body in (wire.Integrity(3, 7, False, "ab" * 16, True, "cd" * 16, "exp_avg: 1 of 4 values not finite"),
                 wire.Register(0, 4, 1, "h", Layout(), "/s", "run", "updated", 2, True)):
        assert rx.decode(tx.encode(body)).body == body


def test_control_plane_verify_round_excludes_the_corrupt_rank():
    """Controller + 4 processors over real ZeroMQ (TP1 PP1 DP4, N=2: shard s on ranks s and
    s+2). Each rank answers VERIFY with a report; rank 0's shard is NaN; rank 3 vanishes.
    Shard 0 must be saved by rank 2, with the trusted digests in the DUMP."""
    import contextlib
    import threading

    from mindspeed_ha.config import HAConfig
    from mindspeed_ha.control.controller import Controller
    from mindspeed_ha.control.integrity import IntegrityReport
    from mindspeed_ha.control.policy import ActionKind, DumpPlan
    from mindspeed_ha.control.processor import Processor
    from mindspeed_ha.control.state import Layout

    cfg = HAConfig(enabled=True, distributed_optimizer=True, replica_count=2, auth_key=b"t" * 32,
                   controller_addr="127.0.0.1", heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0,
                   stop_timeout_s=5.0, action_timeout_s=10.0, connect_timeout_s=5.0, save_dir=None)
    calls, exits, lock = {"verify": [], "dump": []}, {}, threading.Lock()
    with contextlib.ExitStack() as stack:
        ctl = Controller(cfg, 4, "127.0.0.1", 0, tick_s=0.01).start()
        stack.callback(ctl.stop)
        procs = []
        for r in range(4):
            lay = Layout(dp_rank=r, dp_size=4, replica_count=2, instance_id=r // 2, shard_id=r % 2)
            p = Processor(cfg, r, lay, "/save", port=ctl.port, exit_handler=lambda c, why, r=r: exits.setdefault(r, c))

            def verify(params, r=r, p=p):
                status, k = p.status()
                p.report_integrity(IntegrityReport(k, r != 0, f"shard{r % 2}", True, "model"))
                with lock:
                    calls["verify"].append(r)
                return True, "verified"

            def record(kind, r=r):
                def handle(params):
                    with lock:
                        calls.setdefault(kind, []).append((r, params))
                    return True, kind
                return handle

            p.on_action("verify", verify)
            for kind in ("dump", "assemble", "commit"):
                p.on_action(kind, record(kind))
            stack.callback(p.close, None)
            procs.append(p.start())
        assert all(ctl.state.ranks[r].verifies for r in range(4))
        for p in procs:
            p.begin_update(1)
            p.end_update(1)
        procs[3].close(None)  # vanishes: connection closed
        out = ctl.wait_done(15)
        assert out is not None and out.exit_code == 75, out
        assert [e.action for e in out.events][:3] == [ActionKind.STOP_ALL, ActionKind.VERIFY, ActionKind.DUMP]
        assert sorted(calls["verify"]) == [0, 1, 2] and "verify" in out.timings
        plan = out.plan
        assert plan.shard_savers == {(0, 0, 0): 2, (0, 0, 1): 1} and 0 not in plan.savers()
        assert plan.shard_digests == {(0, 0, 0): "shard0", (0, 0, 1): "shard1"} and plan.model_digests == {
            (0, 0): "model"}
        for r, params in calls["dump"]:  # each saver gets its own part of the plan, digests included
            own = DumpPlan.from_params(params)
            assert own.roles(r) == plan.roles(r) and own.iteration == plan.iteration
            assert own.shard_digests == {k: d for k, d in plan.shard_digests.items() if plan.shard_savers[k] == r}
        for r in (0, 1, 2):
            for _ in range(500):
                if r in exits:
                    break
                threading.Event().wait(0.01)
            assert exits.get(r) == 75


# --------------------------------------------------------------------------- end to end
def _args(layout, *extra):
    return tiny_gpt_args(train_iters=ITERS, **LAYOUTS[layout]) + [
        "--enable-high-availability", "--ha-controller-port", "0", *EXTRA[layout], *extra]


def _run(args, env=None):
    r = launch(4, args, launcher=launcher_command(4), env=env, timeout_s=240)
    assert not r.timed_out, r.stderr[-4000:]
    return r


def _tracker(save):
    path = os.path.join(save, "latest_checkpointed_iteration.txt")
    return int(open(path).read()) if os.path.exists(path) else None


def _faulty(tmp_path, layout, inject, *extra):
    save, report = str(tmp_path / "ckpt"), str(tmp_path / "report.json")
    r = _run(_args(layout, "--save", save, *extra), env={"MINDSPEED_HA_INJECT": inject,
                                                          "MINDSPEED_HA_REPORT": report})
    with open(report) as f:
        return save, r, json.load(f)


def _savers(report):
    """Ranks the DUMP went to (from the plan's reason) and that reason."""
    dump = [e for e in report["events"] if e["action"] == "dump"]
    if not dump:
        return None, ""
    reason = dump[0]["reason"]
    return {int(r) for r in re.search(r"saved by ranks \[([\d, ]*)\]", reason).group(1).split(",")}, reason


@pytest.fixture(scope="module")
def baselines(uninterrupted):
    """layout -> (losses, save) of the uninterrupted run per layout, saving a normal
    checkpoint at every iteration (the session's shared run: tests/conftest.py)."""
    return {layout: uninterrupted(LAYOUTS[layout]["tp"], LAYOUTS[layout]["pp"], ITERS, *EXTRA[layout])
            for layout in LAYOUTS}


def _assert_good_checkpoint(save, faulty, report, baselines, layout, corrupt_rank):
    assert faulty.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, faulty.stderr[-6000:]
    k = _tracker(save)
    assert k == KILL_AT - 1
    savers, reason = _savers(report)
    assert corrupt_rank not in savers and f"excluded {{{corrupt_rank}: " in reason, reason
    assert "verify" in report["phase_seconds"]
    assert not [d for d in os.listdir(save) if d.startswith(".")], "staging left behind"
    base_losses, base_save = baselines[layout]
    for it, loss in faulty.losses.items():
        assert loss == base_losses[it], f"iteration {it} before the fault differs"
    name_k = f"iter_{k:07d}"
    diffs = compare_checkpoint_dirs(os.path.join(save, name_k), os.path.join(base_save, name_k))
    assert not diffs, "dying checkpoint != uninterrupted checkpoint:\n" + "\n".join(diffs[:20])
    return k


def test_nan_replica_is_not_saved_and_the_good_one_resumes_bitwise(tmp_path, baselines):
    """PP2 DP2: rank 0's exp_avg gets a NaN after iteration 2; rank 3 (other stage) dies in
    iteration 3. Stage 0's shard has holders 0 (NaN) and 1 (good): rank 1 saves it."""
    inject = f"rank=0,iteration={KILL_AT - 1},point=between,fault=corrupt,what=exp_avg;" \
             f"rank=3,iteration={KILL_AT},point=backward"
    save, faulty, report = _faulty(tmp_path, "pp2", inject)
    k = _assert_good_checkpoint(save, faulty, report, baselines, "pp2", corrupt_rank=0)
    assert "not finite" in _savers(report)[1]
    resumed = _run(_args("pp2", "--load", save, "--save", save))
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert sorted(resumed.losses) == list(range(k + 1, ITERS + 1))
    base_losses = baselines["pp2"][0]
    for it, loss in resumed.losses.items():
        assert loss == base_losses[it], \
            f"iteration {it}: resumed {float.fromhex(loss)} != {float.fromhex(base_losses[it])}"


def test_bit_flipped_replica_is_outvoted(tmp_path, baselines):
    """DP4 with 4 replicas of one shard: rank 0's fp32 main param (a view of its model
    parameter) gets one flipped bit, still finite; rank 3 dies. Ranks 1 and 2 agree: rank 0
    is outvoted on both its shard and its model digests and saves nothing."""
    inject = f"rank=0,iteration={KILL_AT - 1},point=between,fault=corrupt,what=main_param,how=bitflip;" \
             f"rank=3,iteration={KILL_AT},point=backward"
    save, faulty, report = _faulty(tmp_path, "dp4", inject)
    _assert_good_checkpoint(save, faulty, report, baselines, "dp4", corrupt_rank=0)
    assert "differs from" in _savers(report)[1] and "majority" in _savers(report)[1]


@pytest.mark.parametrize("case", ["nan_and_replica_dead", "two_replicas_disagree"])
def test_no_trustworthy_copy_exits_76_and_publishes_nothing(tmp_path, case):
    """No good copy of stage 0's shard: NaN on rank 0 and its replica rank 1 dead; or a
    finite bit flip on rank 0 while both replicas live (2 holders that differ: no majority).
    A periodic checkpoint of iteration 2 exists: the tracker must stay at 2."""
    if case == "nan_and_replica_dead":
        inject = f"rank=0,iteration={KILL_AT},point=between,fault=corrupt,what=exp_avg_sq;" \
                 f"rank=1,iteration={KILL_AT + 1},point=backward"
    else:
        inject = f"rank=0,iteration={KILL_AT},point=between,fault=corrupt,what=exp_avg,how=bitflip;" \
                 f"rank=3,iteration={KILL_AT + 1},point=backward"
    save, faulty, report = _faulty(tmp_path, "pp2", inject, "--save-interval", "2")
    assert faulty.returncode == faults.EXIT_NO_COMPLETE_DATA, faulty.stderr[-6000:]
    assert "no trustworthy copy" in report["reason"] and "shard (tp=0, pp=0, shard=0)" in report["reason"]
    assert ("not finite" if case == "nan_and_replica_dead" else "disagree") in report["reason"]
    assert _tracker(save) == 2
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_corruption_after_verification_is_caught_by_the_saver(tmp_path):
    """Rank 1 dies; rank 0, the only holder of stage 0, is verified clean, then its exp_avg
    is corrupted while it saves: the read-back check fails, exit 77, nothing published."""
    inject = f"rank=1,iteration={KILL_AT},point=backward;" \
             f"rank=0,iteration={KILL_AT - 1},point=dying,fault=corrupt,what=exp_avg,how=bitflip"
    save, faulty, report = _faulty(tmp_path, "pp2", inject)
    assert faulty.returncode == faults.EXIT_FAULT_UNRECOVERABLE, faulty.stderr[-6000:]
    assert "dumping failed on rank 0" in report["reason"] and "changed after verification" in report["reason"]
    assert os.listdir(save) == [], f"left behind: {os.listdir(save)}"
