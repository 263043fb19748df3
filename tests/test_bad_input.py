"""Bad input gets a clear error naming the flag / env var, before any work can be lost."""

import socket

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
