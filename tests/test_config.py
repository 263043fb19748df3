"""HAConfig from args + env; each error names its flag / env var."""

import argparse
import dataclasses

import pytest

from mindspeed_ha.config import ConfigError, HAConfig, add_ha_arguments, validate_ha_args
from mindspeed_ha.control import wire


def replica_patch_active(cfg):
    """The replica optimizer patches apply (never with N = 1)."""
    return cfg.enabled and cfg.distributed_optimizer and not cfg.no_replica and cfg.replica_count > 1


def effective_replica_count(cfg, dp_size):
    """Copies of each optimizer shard in a DP group of ``dp_size`` ranks (non-distributed: all d)."""
    return cfg.replica_count if cfg.distributed_optimizer else dp_size


def parse(argv, extra=()):
    p = argparse.ArgumentParser()
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--save", default=None)
    add_ha_arguments(p)
    return p.parse_args(list(argv) + list(extra))


def test_group_and_defaults():
    p = argparse.ArgumentParser()
    add_ha_arguments(p)
    assert "high availability" in [g.title for g in p._action_groups]
    cfg = HAConfig.from_args(parse([]), env={})
    assert not cfg.enabled and cfg.replica_count == 2 and cfg.controller_port == 8000
    assert cfg.controller_addr == "127.0.0.1" and cfg.auth_key is None and cfg.save_dir is None


def test_full_flags_and_env():
    args = parse(["--enable-high-availability", "--enable-hbmfault-repair", "--enable-worker-reboot",
                  "--use-distributed-optimizer", "--ha-replica-count", "4", "--save", "/ckpt"])
    env = {"TTP_ADDR": "fd00::1", "TTP_PORT": "9000", "MINDSPEED_HA_AUTH_KEY": "ab" * 16,
           "MINDSPEED_HA_HEARTBEAT_INTERVAL": "0.5", "PROCESSOR_ADDR": "pod-1.svc"}
    cfg = HAConfig.from_args(args, env)
    assert cfg.enabled and cfg.hbm_repair and cfg.worker_reboot and cfg.replica_count == 4
    assert cfg.controller_addr == "fd00::1"
    assert wire.endpoint(cfg.controller_addr, cfg.controller_port) == "tcp://[fd00::1]:9000"
    assert cfg.auth_key == b"\xab" * 16 and cfg.heartbeat_interval_s == 0.5 and cfg.save_dir == "/ckpt"
    assert cfg.processor_addr == "pod-1.svc" and replica_patch_active(cfg)


def test_address_precedence():
    args = parse(["--ha-controller-addr", "10.0.0.3"])
    assert HAConfig.from_args(args, {}).controller_addr == "10.0.0.3"
    assert HAConfig.from_args(args, {"TTP_ADDR": "10.0.0.2"}).controller_addr == "10.0.0.2"
    env = {"TTP_ADDR": "10.0.0.2", "CONTROLLER_ADDR": "master-0.job"}
    assert HAConfig.from_args(args, env).controller_addr == "master-0.job"
    assert HAConfig.from_args(parse(["--ha-controller-port", "7000"]), {"TTP_PORT": "7001"}).controller_port == 7001


def test_no_replica_forces_one():
    cfg = HAConfig.from_args(parse(["--enable-high-availability", "--distributed-optimizer-no-replica",
                                    "--use-distributed-optimizer"]), {})
    assert cfg.replica_count == 1 and not replica_patch_active(cfg)


ERRORS = [
    (["--enable-hbmfault-repair"], {}, "--enable-hbmfault-repair requires --enable-high-availability"),
    (["--enable-worker-reboot"], {}, "--enable-worker-reboot requires --enable-high-availability"),
    (["--distributed-optimizer-no-replica"], {}, "--distributed-optimizer-no-replica requires"),
    (["--enable-high-availability", "--distributed-optimizer-no-replica", "--ha-replica-count", "2"], {},
     "--ha-replica-count=1"),
    (["--enable-high-availability", "--ha-replica-count", "0"], {}, "--ha-replica-count=0: accepted"),
    (["--enable-high-availability", "--enable-hbmfault-repair"], {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
     "PYTORCH_NO_CUDA_MEMORY_CACHING"),
    (["--enable-high-availability", "--enable-hbmfault-repair"], {"PYTORCH_NO_NPU_MEMORY_CACHING": ""},
     "PYTORCH_NO_NPU_MEMORY_CACHING"),
    ([], {"TTP_ADDR": ""}, "TTP_ADDR is set but empty"),
    ([], {"TTP_ADDR": "master-0"}, "TTP_ADDR='master-0' is not an IPv4 or IPv6"),
    ([], {"TTP_ADDR": "10.0.0.300"}, "TTP_ADDR"),
    (["--ha-controller-addr", "bad host!"], {}, "--ha-controller-addr"),
    ([], {"CONTROLLER_ADDR": "-x-"}, "CONTROLLER_ADDR"),
    (["--ha-controller-port", "70000"], {}, "--ha-controller-port=70000 is out of range (accepted range 0..65535"),
    ([], {"TTP_PORT": "http"}, "TTP_PORT='http' is not an integer port"),
    ([], {"TTP_PORT": "-1"}, "TTP_PORT"),
    ([], {"MINDSPEED_HA_HEARTBEAT_TIMEOUT": "-1"}, "MINDSPEED_HA_HEARTBEAT_TIMEOUT"),
    (["--ha-heartbeat-timeout", "1", "--ha-heartbeat-interval", "1"], {}, "MINDSPEED_HA_HEARTBEAT_TIMEOUT=1.0 must be >= 2 x"),
    ([], {"MINDSPEED_HA_ACTION_TIMEOUT": "soon"}, "MINDSPEED_HA_ACTION_TIMEOUT"),
    ([], {"MINDSPEED_HA_AUTH_KEY": "zz"}, "MINDSPEED_HA_AUTH_KEY must be hex"),
    ([], {"MINDSPEED_HA_AUTH_KEY": "abcd"}, "MINDSPEED_HA_AUTH_KEY must encode at least 16 bytes"),
    ([], {"MINDSPEED_HA_MAX_MESSAGE_BYTES": "10"}, "MINDSPEED_HA_MAX_MESSAGE_BYTES"),
]


@pytest.mark.parametrize("argv,env,needle", ERRORS, ids=[e[2][:40] for e in ERRORS])
def test_errors_name_the_flag(argv, env, needle):
    with pytest.raises(ConfigError) as ei:
        HAConfig.from_args(parse(argv), env)
    assert needle in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_validate_replica_divisibility():
    on = ["--enable-high-availability", "--use-distributed-optimizer"]
    cfg = validate_ha_args(parse(on + ["--ha-replica-count", "2"]), world_size=16, tp=2, pp=2, cp=1, env={})
    assert cfg.replica_count == 2
    with pytest.raises(ConfigError) as ei:
        validate_ha_args(parse(on + ["--ha-replica-count", "3"]), world_size=16, tp=2, pp=2, env={})
    msg = str(ei.value)
    assert "--ha-replica-count=3" in msg and "d=4" in msg and "[1, 2, 4]" in msg
    with pytest.raises(ConfigError, match="--ha-replica-count=8"):
        validate_ha_args(parse(on + ["--ha-replica-count", "8"]), world_size=16, tp=2, pp=2, env={})
    with pytest.raises(ConfigError, match="not divisible"):
        validate_ha_args(parse(on), world_size=10, tp=4, pp=1, env={})


def test_validate_replicas_need_distributed_optimizer():
    args = parse(["--enable-high-availability", "--ha-replica-count", "2"])
    with pytest.raises(ConfigError, match="--ha-replica-count=2 requires --use-distributed-optimizer"):
        validate_ha_args(args, world_size=8, tp=1, pp=2, env={})
    cfg = validate_ha_args(parse(["--enable-high-availability"]), world_size=8, tp=1, pp=2, env={})
    assert effective_replica_count(cfg, 4) == 4 and not replica_patch_active(cfg)


def test_validate_off_is_a_no_op():
    cfg = validate_ha_args(parse([]), world_size=7, tp=2, pp=1, env={})
    assert not cfg.enabled


def test_frozen_and_with_auth_key():
    cfg = HAConfig()
    with pytest.raises(Exception):
        cfg.enabled = True  # type: ignore[misc]
    assert dataclasses.replace(cfg, auth_key=b"k" * 16).auth_key == b"k" * 16
    with pytest.raises(ConfigError):
        dataclasses.replace(cfg, auth_key=b"short")
