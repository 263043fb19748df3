"""Bad input gets a clear error naming the flag / env var, before any work can be lost."""

import socket

import re

import pytest

from mindspeed_ha.config import ConfigError
from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args


@pytest.fixture
def parse(monkeypatch):
    """Megatron-shaped parse_args with the HA patch, as rank 0 of a 4-rank job."""
    from mindspeed_ha import runtime
    from mindspeed_ha.patches import registry
    from mindspeed_ha.testing.trainer import arguments

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    for var in ("TTP_ADDR", "CONTROLLER_ADDR", "TTP_PORT"):
        monkeypatch.delenv(var, raising=False)
    before = set(registry.enabled_features())
    yield lambda extra: arguments.parse_args(args=tiny_gpt_args(pp=2) + list(extra))
    registry.disable(*(set(registry.enabled_features()) - before))
    runtime.reset()


def test_wrong_replica_count_names_flag(parse):
    with pytest.raises(ConfigError, match=r"--ha-replica-count"):
        parse(["--enable-high-availability", "--ha-replica-count", "3"])


def test_repair_without_master_switch(parse):
    with pytest.raises(ConfigError, match=r"--enable-high-availability"):
        parse(["--enable-hbmfault-repair"])


def test_empty_ttp_addr_names_env(parse, monkeypatch):
    monkeypatch.setenv("TTP_ADDR", "")
    with pytest.raises(ConfigError, match="TTP_ADDR"):
        parse(["--enable-high-availability"])


def test_no_replica_activates_no_replica_patch(parse):
    from mindspeed_ha.patches import registry

    args = parse(["--enable-high-availability", "--distributed-optimizer-no-replica"])
    assert args.num_distributed_optimizer_instances == 1
    assert not registry.is_enabled("replica")
    assert registry.active("replica") == []


def test_ha_flags_off_enable_nothing(parse):
    from mindspeed_ha.patches import registry

    args = parse([])
    assert args.num_distributed_optimizer_instances == 1
    assert not registry.is_enabled("ha") and not registry.is_enabled("replica")


def test_controller_port_in_use_fails_before_workers_start(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = launch(2, tiny_gpt_args(train_iters=2) + ["--enable-high-availability", "--ha-controller-port", str(port),
                                                      "--save", str(tmp_path / "ckpt")],
                   launcher=launcher_command(2),
                   timeout_s=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert str(port) in r.stderr and "--ha-controller-port" in r.stderr
    assert "training ..." not in r.stdout  # no worker started
    assert not (tmp_path / "ckpt").exists()


def test_unwritable_save_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = launch(2, tiny_gpt_args(train_iters=2) + ["--enable-high-availability", "--save", str(blocker / "ckpt")],
               launcher=launcher_command(2),
               timeout_s=120, env={"TTP_PORT": "0"})
    assert r.returncode != 0
    assert "--save" in r.stdout + r.stderr
    assert "iteration        1/" not in r.stdout


def test_launcher_reads_flags_without_abbreviations():
    """As Megatron-LM's parser (allow_abbrev=False): --num-layers is not a prefix match for
    --num-layers-per-virtual-pipeline-stage (which, with torch_dist, fails the start-up)."""
    from mindspeed_ha.launcher import ha_args as _ha_args

    ns = _ha_args(["--num-layers", "4", "--enable-high-availability"])
    assert ns.num_layers_per_virtual_pipeline_stage is None


@pytest.mark.parametrize("flags,names", [(["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2"),
                                         (["--num-distributed-optimizer-instances", "4"],
                                          "--num-distributed-optimizer-instances=4"),
                                         (["--use-custom-fsdp"], "--use-custom-fsdp")])
def test_launcher_refuses_layouts_replicas_or_the_dying_checkpoint_cannot_serve(flags, names):
    """Refused by the launcher before any worker starts (the workers refuse them too)."""
    from mindspeed_ha.launcher import _check_before_start, _parse

    argv = ["--standalone", "--nproc-per-node", "4", "-m", "x", "--use-distributed-optimizer",
            "--enable-high-availability", "--ckpt-format", "torch", *flags]
    targs, ns = _parse(argv)
    with pytest.raises(ConfigError, match=re.escape(names)):
        _check_before_start(targs, ns)


def test_conflicting_optimizer_instances_name_both_flags(parse):
    """HA sets Megatron's --num-distributed-optimizer-instances to the replica count; another
    value would be overridden without a word."""
    with pytest.raises(ConfigError, match=r"--num-distributed-optimizer-instances=4 .*--ha-replica-count"):
        parse(["--enable-high-availability", "--num-distributed-optimizer-instances", "4"])
    args = parse(["--enable-high-availability", "--num-distributed-optimizer-instances", "2"])
    assert args.num_distributed_optimizer_instances == 2


def test_custom_fsdp_with_replicas_names_flag():
    """megatron-core's custom FSDP ignores the optimizer instances: no replicas to hold."""
    import argparse

    from mindspeed_ha.config import validate_ha_args

    def ns(**kw):
        return argparse.Namespace(enable_high_availability=True, use_distributed_optimizer=True,
                                  use_custom_fsdp=True, **kw)

    with pytest.raises(ConfigError, match=r"--use-custom-fsdp .*--ha-replica-count=2"):
        validate_ha_args(ns(), 4, 1, 1, env={})
    assert validate_ha_args(ns(distributed_optimizer_no_replica=True), 4, 1, 1, env={}).replica_count == 1


def test_flag_refused_in_a_rank_exits_2(tmp_path):
    """A flag only the rank's parse_args reads (the launcher does not) is refused there as
    argparse refuses a bad flag: one ``error:`` line naming it, status 2."""
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text("from mindspeed_ha.testing.trainer import arguments\narguments.parse_args()\n")
    argv = tiny_gpt_args() + ["--enable-high-availability", "--ha-replica-count", "1",
                              "--num-distributed-optimizer-instances", "2"]
    env = dict(os.environ, WORLD_SIZE="4", RANK="0")
    r = subprocess.run([sys.executable, "-m", "mindspeed_ha.boot", str(script)] + argv, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("train.py: error: --num-distributed-optimizer-instances=2"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr

# --- issue 21: every bad flag or environment value: one line naming it and the range, exit 2 ----------------------

def _exit2_one_line(cmd, env=None, timeout=120):
    """Run ``cmd`` (a CLI entry point) with ``env`` added; assert exit 2 and one line on stderr, no traceback."""
    import os
    import subprocess

    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})))
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
    return r.stderr


def _launcher(*args):
    import sys

    return [sys.executable, "-m", "mindspeed_ha.launcher", "--standalone", "--nproc-per-node", "2", *args,
            "-m", "mindspeed_ha.testing.trainer.pretrain_gpt", "--enable-high-availability"]


def test_launcher_bad_report_path_exits_2_before_torch(tmp_path):
    err = _exit2_one_line(_launcher(), {"MINDSPEED_HA_REPORT": str(tmp_path / "missing" / "report.json")})
    assert "MINDSPEED_HA_REPORT" in err and "writable directory" in err


def test_launcher_log_level_loud_exits_2():
    err = _exit2_one_line(_launcher(), {"MINDSPEED_HA_LOG": "LOUD"})
    assert "MINDSPEED_HA_LOG='LOUD'" in err and "DEBUG|INFO|WARNING|ERROR|CRITICAL" in err


def test_launcher_lease_inf_exits_2():
    """inf would mean a standby never takes over: failover silently off."""
    err = _exit2_one_line(_launcher(), {"MINDSPEED_HA_LEASE_S": "inf"})
    assert "MINDSPEED_HA_LEASE_S='inf'" in err and "(0, 3600]" in err


def test_launcher_unknown_disabled_patch_exits_2():
    err = _exit2_one_line(_launcher(), {"MINDSPEED_HA_DISABLE_PATCHES": "cpu.causal_mask,cpu.causal_mas"})
    assert "MINDSPEED_HA_DISABLE_PATCHES" in err and "cpu.causal_mas " in err and "did you mean cpu.causal_mask" in err


def test_launcher_nnodes_abc_exits_2():
    """torchrun's own flags are read after torch is imported (a few seconds), still before anything starts."""
    err = _exit2_one_line(_launcher("--nnodes", "abc"))
    assert "--nnodes='abc'" in err and "MIN:MAX" in err


def test_controller_port_out_of_range_exits_2():
    """``controller --port 70000`` bound 4464 (the port taken modulo 65536)."""
    import sys

    err = _exit2_one_line([sys.executable, "-m", "mindspeed_ha.cli", "controller", "--world-size", "2",
                           "--port", "70000"], {"MINDSPEED_HA_AUTH_KEY": "ab" * 32})
    assert "--port=70000" in err and "0..65535" in err


# the same class, checked in process (each is what the launcher prints before exit 2)
LAUNCHER_ENV = [
    ("MINDSPEED_HA_LOG", "verbose"), ("MINDSPEED_HA_LEASE_S", "nan"), ("MINDSPEED_HA_LEASE_S", "-1"),
    ("MINDSPEED_HA_LEASE_S", "1e9"), ("MINDSPEED_HA_LEASE_S", "soon"),
    ("MINDSPEED_HA_DYING_GRACE_S", "inf"), ("MINDSPEED_HA_DYING_GRACE_S", "nan"), ("MINDSPEED_HA_DYING_GRACE_S", "0"),
    ("MINDSPEED_HA_DYING_GRACE_S", "ten"), ("MINDSPEED_HA_WARM_SPARES", "2"), ("MINDSPEED_HA_CPU_BACKEND", "yes"),
    ("MINDSPEED_HA_DISABLE_PATCHES", "no.such.patch"), ("MINDSPEED_HA_INJECT", "rank=x"),
    ("MINDSPEED_HA_RELAY", "/tmp/some.sock"),
]


@pytest.mark.parametrize("name,value", LAUNCHER_ENV, ids=[f"{n}={v}" for n, v in LAUNCHER_ENV])
def test_launcher_env_checked_before_start(monkeypatch, name, value):
    from mindspeed_ha.launch import checks

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name if name != "MINDSPEED_HA_INJECT" else "rank"):
        checks.check_env()


def test_launcher_env_defaults_pass(monkeypatch):
    from mindspeed_ha.launch import checks

    for name, _ in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MINDSPEED_HA_LOG", "warning")
    monkeypatch.setenv("MINDSPEED_HA_DISABLE_PATCHES", "cpu.causal_mask")
    checks.check_env()
    assert checks.log_level() == "WARNING" and checks.grace_s() == 600


def test_report_dir_is_refused(tmp_path):
    from mindspeed_ha.launch.report import check_path

    with pytest.raises(ConfigError, match="MINDSPEED_HA_REPORT=.*a directory"):
        check_path(str(tmp_path), "MINDSPEED_HA_REPORT")
    check_path(str(tmp_path / "report.json"), "MINDSPEED_HA_REPORT")  # a new file in a writable dir: fine


def test_report_write_failure_is_a_warning(tmp_path, monkeypatch, caplog):
    """The report's directory vanished during the job: a warning, no exception (the job's
    exit status, computed before, stays), nothing half-written left."""
    from mindspeed_ha.launch import report

    gone = tmp_path / "gone"
    monkeypatch.setenv("MINDSPEED_HA_REPORT", str(gone / "report.json"))
    monkeypatch.setattr(report, "report", lambda controller: {"phase": "done"})
    with caplog.at_level("WARNING", logger="mindspeed_ha.launcher"):
        assert report.write_report(object()) is False
    assert "MINDSPEED_HA_REPORT" in caplog.text and "exit status is unchanged" in caplog.text
    monkeypatch.setenv("MINDSPEED_HA_REPORT", str(tmp_path / "report.json"))
    assert report.write_report(object()) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


TORCHRUN_FLAGS = [(["--nnodes", "3:2"], "--nnodes"), (["--nnodes", "0"], "--nnodes"),
                  (["--nproc-per-node", "abc"], "--nproc-per-node"), (["--nproc-per-node", "0"], "--nproc-per-node"),
                  (["--node-rank", "1"], "--node-rank"), (["--master-port", "70000"], "--master-port"),
                  (["--max-restarts", "-1"], "--max-restarts"), (["--monitor-interval", "nan"], "--monitor-interval"),
                  (["--monitor-interval", "-1"], "--monitor-interval")]


@pytest.mark.parametrize("flags,needle", TORCHRUN_FLAGS, ids=[" ".join(f) for f, _ in TORCHRUN_FLAGS])
def test_torchrun_numeric_flags(flags, needle):
    from torch.distributed.run import get_args_parser

    from mindspeed_ha.launch.checks import check_torchrun_args

    targs = get_args_parser().parse_args(["--standalone", *flags, "x.py"])
    with pytest.raises(ConfigError, match=needle):
        check_torchrun_args(targs)


def _ha_parser():
    import argparse

    from mindspeed_ha.config import add_ha_arguments

    return add_ha_arguments(argparse.ArgumentParser())


SECONDS_ENV = ["MINDSPEED_HA_HEARTBEAT_INTERVAL", "MINDSPEED_HA_HEARTBEAT_TIMEOUT", "MINDSPEED_HA_STOP_TIMEOUT",
               "MINDSPEED_HA_ACTION_TIMEOUT", "MINDSPEED_HA_CONNECT_TIMEOUT", "MINDSPEED_HA_PREEMPTION_DEADLINE"]
CONFIG_BAD = ([({name: v}, [], name) for name in SECONDS_ENV for v in ("nan", "inf", "-1", "abc")]
              + [({}, [flag, v], flag) for flag in ("--ha-heartbeat-interval", "--ha-stop-timeout",
                                                    "--ha-action-timeout", "--ha-connect-timeout",
                                                    "--ha-preemption-deadline") for v in ("nan", "inf", "-1")]
              + [({"TTP_PORT": v}, [], "TTP_PORT") for v in ("70000", "-1", "http")]
              + [({}, ["--ha-controller-port", "70000"], "--ha-controller-port")]
              + [({}, ["--ha-metrics-port", v], "--ha-metrics-port") for v in ("70000", "-1")]
              + [({"MINDSPEED_HA_MAX_MESSAGE_BYTES": v}, [], "MINDSPEED_HA_MAX_MESSAGE_BYTES") for v in ("abc", "10")]
              + [({}, ["--ha-network-retries", "-1"], "--ha-network-retries"),
                 ({}, ["--ha-replica-count", "-2"], "--ha-replica-count")])


@pytest.mark.parametrize("env,argv,needle", CONFIG_BAD, ids=[f"{e or ' '.join(a)}" for e, a, _ in CONFIG_BAD])
def test_every_numeric_setting_names_itself_and_its_range(env, argv, needle):
    """NaN, inf, negative, non-numeric, out-of-range ports: each HAConfig setting's error names
    the variable or flag and says what is accepted."""
    from mindspeed_ha.config import HAConfig

    with pytest.raises(ConfigError) as ei:
        HAConfig.from_args(_ha_parser().parse_args(["--enable-high-availability", *argv]), env)
    msg = str(ei.value)
    assert needle in msg and any(w in msg for w in ("accepted", "> 0", "range")), msg


def test_disabled_patch_names_are_checked(monkeypatch):
    from mindspeed_ha.patches import registry

    monkeypatch.setenv("MINDSPEED_HA_DISABLE_PATCHES", " cpu.causal_mask , ")
    registry.check_disabled()
    monkeypatch.setenv("MINDSPEED_HA_DISABLE_PATCHES", "cpu.causal_mask,nothing.here")
    with pytest.raises(ConfigError, match=r"MINDSPEED_HA_DISABLE_PATCHES: unknown patch name\(s\) nothing.here;"):
        registry.check_disabled()


DEMO_BAD = [(["--nproc", "1"], "--nproc=1"), (["--train-iters", "0"], "--train-iters=0"),
            (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size=0"),
            (["--nproc", "6", "--pipeline-model-parallel-size", "4"], "--nproc=6: accepted multiples")]


@pytest.mark.parametrize("argv,needle", DEMO_BAD, ids=[" ".join(a) for a, _ in DEMO_BAD])
def test_demo_numeric_options(argv, needle, tmp_path):
    import argparse

    from mindspeed_ha.testing.demo import check_options

    ns = argparse.Namespace(fault="kill", reboot=False, kill_point=None, kill_rank=1, kill_iteration=1, nproc=4,
                            train_iters=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=2, report=None)
    for flag, value in zip(argv[::2], argv[1::2]):
        setattr(ns, flag.lstrip("-").replace("-", "_"), int(value))
    assert needle in (check_options(ns) or "")
    ns = argparse.Namespace(**dict(vars(ns), nproc=4, train_iters=4, tensor_model_parallel_size=1,
                                   pipeline_model_parallel_size=2, report=str(tmp_path / "no" / "r.json")))
    assert "--report" in (check_options(ns) or "")


def test_soak_bad_report_path_exits_2_before_any_run(tmp_path, capsys):
    import argparse

    from mindspeed_ha.testing import soak

    ns = argparse.Namespace(faults=3, seed=0, kinds="uce=1", layout="tp1pp2", workdir=None,
                            report=str(tmp_path / "missing" / "soak.json"))
    assert soak.main(ns) == 2
    assert "--report=" in capsys.readouterr().out
