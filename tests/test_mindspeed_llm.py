"""MindSpeed-LLM 2.3.0's own pretrain_gpt.py (with MindSpeed 2.3.0_core_r0.12.1 and
Megatron-LM core_v0.12.1, all unmodified) on 4 CPU/gloo ranks, through mindspeed-ha-run.

The three trees are unpacked from ../shared/third_party into a temporary directory and
their file hashes compared after the module; MindSpeed runs on CPU with the project's
stand-in of the NPU stack (tests/npu_double: torch_npu, torchair, acl; on the path of the
test's jobs only, never installed). The training arguments are those of
scripts/pretrain_llama2_7b_ptd_mindspeed_llm.sh (the reference guide's llama2 script with
its four HA flags) at ``TINY=1 CPU=1``: llama2's shape (RMSNorm, SwiGLU, RoPE, untied
embeddings, ``--use-mcore-models``, bf16, distributed optimizer) at 4 layers / hidden 64.

Few jobs, each proving several things (CI time): one uninterrupted run per layout with
every HA flag off (the baseline every faulty job is compared with, bit for bit: losses and
grad norms), and fault schedules (several faults in one job):

* the script itself, the four flags as the guide gives them (no replica, UCE repair, worker
  reboot), TP1 PP2: a UCE recovered in place from the latest periodic checkpoint, then a
  killed rank restarted alone and reloaded in place; exit 0, bitwise. (A kill before any
  periodic checkpoint ends in 76 with "no periodic checkpoint yet": the path every
  framework shares, tests/test_worker_restart.py
  ``test_no_replica_without_a_periodic_checkpoint_takes_the_dying_checkpoint``.)
* the master switch with replicas (+ UCE repair), TP2 PP1: a UCE and a network error
  recovered in place, then a kill: dying checkpoint (75, 0 steps lost), and MindSpeed-LLM's
  own ``--load`` resumes, bitwise.
* flags off: no HA patch active, MindSpeed-LLM's own HA feature off; the faulty jobs equal it.
"""

import json
import os
import shlex
import subprocess
import sys

import pytest

from mindspeed_ha import faults
from mindspeed_ha.testing import megatron_lm as mlm
from mindspeed_ha.testing import mindspeed_llm as msl
from mindspeed_ha.testing.harness import read_jsonl, read_patch_reports, read_rank_loss_logs

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(REPO, "scripts", "pretrain_llama2_7b_ptd_mindspeed_llm.sh")
NPU_DOUBLE = os.path.join(HERE, "npu_double")
ITERS = 8
LAYOUTS = {"pp2": (1, 2), "tp2": (2, 1)}  # (TP, PP) on 4 ranks: DP 2

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def trees(tmp_path_factory, mindspeed_llm_tarballs):
    roots = msl.unpack(mindspeed_llm_tarballs, str(tmp_path_factory.mktemp("third_party")))
    return {"roots": roots, "digests": {k: mlm.tree_digest(r) for k, r in roots.items()}}


def _script_env(layout, **extra):
    tp, pp = LAYOUTS[layout]
    keep = {k: v for k, v in os.environ.items() if k not in ("TP", "PP", "TINY", "CPU", "DRY_RUN")}
    return dict(keep, TINY="1", CPU="1", TP=str(tp), PP=str(pp), TRAIN_ITERS=str(ITERS), SAVE_INTERVAL="2",
                **extra)


def script_args(layout):
    """pretrain_gpt.py's arguments in the script (``DRY_RUN=1``), without --load/--save."""
    r = subprocess.run(["bash", SCRIPT], env=_script_env(layout, DRY_RUN="1"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout)
    argv = argv[next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py")) + 1:]
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--load", "--save"):
            skip = True
        else:
            out.append(a)
    return out + ["--eval-iters", "0"]  # no evaluation: not what is proven here (CI time)


def _without(argv, *flags):
    return [a for a in argv if a not in flags]


def _run(trees, args, env=None):
    r = msl.launch(trees["roots"], [*args, "--ha-controller-port", "0"] if "--enable-high-availability" in args
                   else args, extra_path=[NPU_DOUBLE], env_extra=env)
    assert not r.timed_out, (r.stdout + r.stderr)[-4000:]
    return r




class _Baselines(dict):
    """One uninterrupted run per layout, every HA flag off (launcher and package in place),
    run when a test first asks for its layout (``-m hog`` runs the TP1 PP2 one only)."""

    def __init__(self, trees, tmp_path_factory):
        super().__init__()
        self.trees, self.tmp = trees, tmp_path_factory

    def __missing__(self, layout):
        report = str(self.tmp.mktemp(f"report_{layout}") / "patches")
        args = _without(script_args(layout), *msl.HA_FLAGS)
        r = _run(self.trees, args, env={"MINDSPEED_HA_PATCH_REPORT": report})
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        assert sorted(r.losses) == list(range(1, ITERS + 1))
        assert sorted(r.grad_norms) == list(range(1, ITERS + 1))
        self[layout] = {"losses": r.losses, "grad_norms": r.grad_norms, "report": read_patch_reports(report),
                        "log": r.stdout + r.stderr}
        return self[layout]


@pytest.fixture(scope="module")
def baselines(trees, tmp_path_factory):
    return _Baselines(trees, tmp_path_factory)


def test_flags_off_no_ha_patch_active(baselines):
    """HA off: no HA patch active and no runtime on any rank (so no controller), and nobody
    claims the flags (the start-up line is printed only when they are given)."""
    for layout in LAYOUTS:
        base = baselines[layout]
        assert sorted(base["report"]) == [0, 1, 2, 3], layout
        for rank, row in base["report"].items():
            assert not row["runtime"], (layout, rank)
            assert not [p for p in row["active"] if not p.startswith(("cpu.", "fix.", "compat.", "arguments.",
                                                                     "testing.", "compose."))], row
            assert not set(row["features"]) & {"ha", "replica", "hbm_repair", "worker_reboot"}, row
            assert "cpu.mindspeed_llm_pretrain" in row["active"]
        assert "handled by mindspeed-ha" not in base["log"]


def _free_port():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: the four flags as the guide gives them, one job: (iteration, rank, spec); --save-interval 2
GUIDE_FAULTS = [
    (5, 3, "point=forward,fault=uce,what=param"),  # no replica: every rank reloads iteration 4 in place
    (7, 3, "point=backward,fault=kill"),  # ARF: rank 3 restarted alone, every rank reloads iteration 6
]


@pytest.mark.hog
def test_guide_script_four_flags_uce_and_killed_rank_recovered_in_place(trees, baselines, tmp_path):
    """scripts/pretrain_llama2_7b_ptd_mindspeed_llm.sh (TINY=1 CPU=1, TP1 PP2, the guide's four
    flags, our launcher, TTP_ADDR/GLOO_SOCKET_IFNAME exported) with a UCE and then a SIGKILL
    of the same rank: both recovered in place from the latest periodic checkpoint (no
    replica), the killed rank restarted alone; exit 0, mindspeed-ha owns the flags (MindSpeed-LLM's
    mindio_ttp feature off: it would fail to import), every loss and grad norm bitwise equal
    to the uninterrupted run with the flags off."""
    roots = trees["roots"]
    loss_log, report, patches = (str(tmp_path / n) for n in ("loss", "report.json", "patches"))
    spec = ";".join(f"rank={rank},iteration={k},{what}" for k, rank, what in GUIDE_FAULTS)
    env = _script_env("pp2", **msl.env(roots, [NPU_DOUBLE]), MINDSPEED_LLM=roots["mindspeed_llm"],
                      CKPT_SAVE_DIR=str(tmp_path / "ckpt"), LOG_DIR=str(tmp_path / "logs"), GLOO_SOCKET_IFNAME="lo",
                      MASTER_PORT=str(_free_port()), LAUNCHER=f"{sys.executable} -m mindspeed_ha.launcher --standalone",
                      MINDSPEED_HA_LOSS_LOG=loss_log, MINDSPEED_HA_INJECT=spec, MINDSPEED_HA_REPORT=report,
                      MINDSPEED_HA_PATCH_REPORT=patches)
    proc = subprocess.run(["bash", SCRIPT, "--ha-controller-port", "0", "--eval-iters", "0"], env=env,
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=800, start_new_session=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    assert "the high-availability flags are handled by mindspeed-ha" in out
    with open(report) as f:
        rep = json.load(f)
    assert [(e["rank"], e["incarnation"]) for e in rep["restarts"]] == [(3, 1)], rep["restarts"]
    assert [rec["mode"] for rec in rep["recoveries"]] == ["reload", "reload"], rep["recoveries"]
    on = read_patch_reports(patches)
    assert all(row["runtime"] and "ha.guard.train.mindspeed_llm" in row["active"]
               and "arguments.mindspeed_llm_ha_feature.validate_args" in row["active"]
               and "replica" not in row["features"] for row in on.values()), on
    records, losses = read_rank_loss_logs(loss_log)
    grad_norms = {int(r["iteration"]): r["grad_norm"] for r in records if "lm loss" in r["loss"]}
    assert losses == baselines["pp2"]["losses"]
    assert grad_norms == baselines["pp2"]["grad_norms"]


#: master switch + UCE repair, replicas on (TP2 PP1), one job: in place, in place, then a kill
REPLICA_FAULTS = [
    (4, 1, "point=forward,fault=uce,what=param"),  # repaired from the replica holder
    (5, 2, "point=grad_sync,fault=network"),  # a failed link in DDP's gradient all-reduce
    (6, 3, "point=backward,fault=kill"),  # no worker reboot: dying checkpoint of 5
]
KILL_AT = REPLICA_FAULTS[-1][0]


def test_replicas_in_place_then_dying_checkpoint_and_own_load(trees, baselines, tmp_path):
    """--enable-high-availability --enable-hbmfault-repair (replicas on), TP2 PP1: a UCE and
    a network error recovered in place (same PIDs), then a SIGKILL: exit 75, the dying
    checkpoint holds iteration KILL_AT - 1 (0 steps lost), MindSpeed-LLM's own --load
    resumes; every loss and grad norm bitwise equal to the uninterrupted run."""
    base = baselines["tp2"]
    save = str(tmp_path / "ckpt")
    args = _without(script_args("tp2"), "--enable-worker-reboot", "--distributed-optimizer-no-replica")
    args += ["--save", save, "--load", save, "--save-interval", "1000"]
    fired, after = str(tmp_path / "fired.jsonl"), str(tmp_path / "after.jsonl")
    spec = ";".join(f"rank={rank},iteration={k},{what}" for k, rank, what in REPLICA_FAULTS)
    r = _run(trees, args, env={"MINDSPEED_HA_INJECT": spec, "MINDSPEED_HA_INJECT_LOG": fired,
                               "MINDSPEED_HA_RECOVERY_LOG": after})
    assert r.returncode == faults.EXIT_DYING_CHECKPOINT_SAVED, (r.stdout + r.stderr)[-8000:]
    shot, again = read_jsonl(fired), read_jsonl(after)
    assert [(e["iteration"], e["rank"]) for e in shot] == [(k, rank) for k, rank, _ in REPLICA_FAULTS], shot
    for e in shot[:2]:  # in place: every rank re-ran the faulty iteration, the faulty rank in its own process
        at_k = [a for a in again if a["iteration"] == e["iteration"]]
        assert sorted(a["rank"] for a in at_k) == [0, 1, 2, 3], (e, again)
        assert {a["pid"] for a in at_k if a["rank"] == e["rank"]} == {e["pid"]}, (e, again)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) == KILL_AT - 1
    for k in range(1, KILL_AT):
        assert (r.losses[k], r.grad_norms[k]) == (base["losses"][k], base["grad_norms"][k]), k

    resumed = _run(trees, args)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-6000:]
    assert sorted(resumed.losses) == list(range(KILL_AT, ITERS + 1))
    for k in range(KILL_AT, ITERS + 1):
        assert (resumed.losses[k], resumed.grad_norms[k]) == (base["losses"][k], base["grad_norms"][k]), k


def test_zz_trees_unchanged(trees):
    """Runs last in this module: not one file of the three trees was written."""
    for key, root in trees["roots"].items():
        assert mlm.tree_digest(root) == trees["digests"][key], key


# ---------------------------------------------------------------- unit tests (no job)


def test_provider_default_choice_and_bad_values(monkeypatch, tmp_path):
    from mindspeed_ha.errors import ConfigError
    from mindspeed_ha.integrations import mindspeed_llm as integ

    monkeypatch.delenv("MINDSPEED_HA_PROVIDER", raising=False)
    assert integ.provider() == "mindspeed-ha"
    monkeypatch.setenv("MINDSPEED_HA_PROVIDER", "both")
    with pytest.raises(ConfigError, match="MINDSPEED_HA_PROVIDER='both': accepted mindspeed-ha or mindio_ttp"):
        integ.provider()
    monkeypatch.setenv("MINDSPEED_HA_PROVIDER", "mindio_ttp")
    with pytest.raises(ConfigError, match="mindio_ttp is not installed"):
        integ.provider()
    (tmp_path / "mindio_ttp.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert integ.provider() == "mindio_ttp" and not integ.ours()


def test_mindspeed_llm_feature_sees_the_flags_off_unless_mindio_chosen(monkeypatch, tmp_path):
    """The wrapper on MindSpeed-LLM's HighAvailabilityFeature methods: with mindspeed-ha owning
    the flags the feature gets a copy with them off (its validate_args would import
    mindio_ttp); the caller's namespace is untouched; with mindio_ttp chosen it sees them."""
    import argparse

    from mindspeed_ha.patches import mindspeed_llm as patch

    seen = []
    ns = argparse.Namespace(enable_high_availability=True, enable_worker_reboot=True,
                            distributed_optimizer_no_replica=True, seq_length=32)

    def validate_args(args):
        seen.append((args.enable_high_availability, args.enable_worker_reboot, args.seq_length))

    monkeypatch.delenv("MINDSPEED_HA_PROVIDER", raising=False)
    patch._feature_sees_flags_off(validate_args, None, (ns,), {})
    patch._feature_sees_flags_off(validate_args, None, (), {"args": ns})
    assert seen == [(False, False, 32)] * 2 and ns.enable_high_availability and ns.enable_worker_reboot
    (tmp_path / "mindio_ttp.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MINDSPEED_HA_PROVIDER", "mindio_ttp")
    patch._feature_sees_flags_off(validate_args, None, (ns,), {})
    assert seen[-1] == (True, True, 32)


def test_npu_double_is_not_an_npu():
    """The CPU backend asks torch_npu whether a device exists: the test double on the path
    leaves it on (it was off as soon as any torch_npu could be imported)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([NPU_DOUBLE, os.environ.get("PYTHONPATH", "")]))
    env.pop("MINDSPEED_HA_CPU_BACKEND", None)
    code = ("import importlib.util, torch; from mindspeed_ha.patches.cpu_backend import wanted; "
            "assert importlib.util.find_spec('torch_npu') is not None; print(wanted())")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-3000:]


def test_version_gates_use_the_imported_megatron_core(monkeypatch, caplog):
    """A Megatron-LM tree on PYTHONPATH (no package metadata, or another version installed):
    the version gates check the imported megatron.core's version, and say so once."""
    import types

    from mindspeed_ha.patches import registry

    core = types.ModuleType("megatron.core")
    core.__version__, core.__file__ = "0.12.1", "/tree/megatron/core/__init__.py"
    monkeypatch.setitem(sys.modules, "megatron.core", core)
    monkeypatch.setattr(registry.importlib.metadata, "version",
                        lambda name: (_ for _ in ()).throw(registry.importlib.metadata.PackageNotFoundError(name)))
    registry._version_said.clear()
    with caplog.at_level("WARNING", logger="mindspeed_ha.patches"):
        assert registry._megatron_core_version() == "0.12.1"
        assert registry._supported(registry.Patch("x", "m", "f", lambda *a: None, "core")) is None
    assert "megatron-core 0.12.1 from /tree/megatron/core (installed package: none)" in caplog.text


def test_dummy_apex_adam_is_not_apex(monkeypatch):
    """MindSpeed's stand-in apex.optimizers.FusedAdam (its own AdamW) makes HAVE_APEX_OR_TE
    true: the no_grad resume fix still applies; a real Apex or TE FusedAdam skips it."""
    import types

    from mindspeed_ha.patches import megatron_fixes

    mod = types.ModuleType(megatron_fixes._DO)
    mod.HAVE_APEX_OR_TE = True
    monkeypatch.setitem(sys.modules, megatron_fixes._DO, mod)
    for origin, applies in (("mindspeed.core.optimizer.adamw", True), ("apex.optimizers.fused_adam", False),
                            ("transformer_engine.pytorch.optimizers.fused_adam", False)):
        mod.Adam = type("Adam", (), {"__module__": origin})
        assert megatron_fixes._no_real_apex_or_te() is applies, origin
    mod.HAVE_APEX_OR_TE = False
    assert megatron_fixes._no_real_apex_or_te()


def test_a_nested_guard_reports_once():
    """Our guard on MindSpeed-LLM's train and the one on Megatron-LM's (both layers around
    one function after MindSpeed's patch manager rebinds names): one fault, one report."""
    from mindspeed_ha.patches import training

    reports = []
    rt = type("RT", (), {"handle_fault": lambda self, exc, where: reports.append(where)})()

    def body():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        training._guarded_call(rt, "train", training._guarded_call, (rt, "train", body, (), {}), {})
    assert reports == ["train"] and not training._activity
