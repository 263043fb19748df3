"""Start-up of a rank's HA side, once the model-parallel groups exist: its layout, the
job's auth key, the controller (without ``mindspeed-ha-run``), the processor thread and
the fallback group for deciding without the controller."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from mindspeed_ha import env as ha_env

log = logging.getLogger("mindspeed_ha.runtime")

#: bytes per rank and exchange over the fallback group (a JSON record: status, layout, digests)
EXCHANGE_BYTES = 4096


def layout_of_this_rank(args):
    """This rank's :class:`~mindspeed_ha.control.state.Layout` (TP/PP/DP/CP ranks, replica and shard)."""
    from megatron.core import parallel_state as mpu

    from mindspeed_ha import replica
    from mindspeed_ha.control.state import Layout

    n = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    dp = mpu.get_data_parallel_world_size(with_context_parallel=True)
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    if getattr(args, "use_distributed_optimizer", False):
        instance_id, shard_id = replica.instance_and_shard(dp_rank, dp, n)
        replica_count = n
    else:  # every DP rank holds the whole optimizer state
        instance_id, shard_id, replica_count = dp_rank, 0, dp
    return Layout(
        tp_rank=mpu.get_tensor_model_parallel_rank(), tp_size=mpu.get_tensor_model_parallel_world_size(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(), pp_size=mpu.get_pipeline_model_parallel_world_size(),
        dp_rank=dp_rank, dp_size=dp, cp_rank=mpu.get_context_parallel_rank(),
        replica_count=replica_count, instance_id=instance_id, shard_id=shard_id,
        cp_size=mpu.get_context_parallel_world_size(),
    )


def agree_auth_key() -> bytes:
    """The job's CURVE key: the launcher's (environment), else one rank 0 draws and
    broadcasts once, at start-up (a collective of every rank)."""
    env = os.environ.get(ha_env.AUTH_KEY)
    if env:
        return bytes.fromhex(env)
    import torch
    import torch.distributed as dist

    from mindspeed_ha.accelerator import collective_device

    buf = torch.zeros(32, dtype=torch.uint8, device=collective_device())
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    key = bytes(buf.cpu().tolist())
    os.environ[ha_env.AUTH_KEY] = key.hex()
    return key


def ensure_controller(config, rank: int, key: bytes):
    """Without ``mindspeed-ha-run``, global rank 0 starts the controller as a detached
    process (returned; None elsewhere or with a hosted controller).

    Detached (own session) so that the controller outlives a SIGKILL of rank 0 and can
    still drive the dying checkpoint; it exits by itself when the job is over.

    Raises:
        ConfigError: ``--ha-controller-port 0`` without the launcher.
    """
    if os.environ.get(ha_env.CONTROLLER_HOSTED) == "1":
        return None
    if config.controller_port == 0:
        from mindspeed_ha.config import ConfigError

        raise ConfigError("--ha-controller-port 0 (pick a free port) needs the mindspeed-ha-run launcher")
    if rank != 0:
        return None
    env = dict(os.environ, **{ha_env.AUTH_KEY: key.hex()})
    cmd = [sys.executable, "-m", "mindspeed_ha.control.controller",
           "--world-size", os.environ.get("WORLD_SIZE", "1"),
           "--port", str(config.controller_port), "--bind", config.controller_addr]
    if config.events_file:
        cmd += ["--events-file", os.path.abspath(config.events_file)]
    if config.metrics_port is not None:
        cmd += ["--metrics-port", str(config.metrics_port), "--metrics-addr", config.metrics_addr]
    cmd += config.subhealth.to_argv()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    log.info("rank 0 started controller pid %d on port %d", proc.pid, config.controller_port)
    return proc


def make_processor(config, rank: int, layout, args, exit_handler, pause_task=None):
    """This rank's :class:`~mindspeed_ha.control.processor.Processor` (not started);
    ``pause_task(task) -> result``: the runtime's pause tasks (``runtime/pause_tasks.py``)."""
    import torch.distributed as dist

    from mindspeed_ha.control.processor import Processor

    processor = Processor(config, rank, layout, getattr(args, "save", None),
                          world_size=dist.get_world_size(), exit_handler=exit_handler)
    # ARF: with --enable-worker-reboot a restarted process of this rank rejoins
    # (recovery/rejoin.py replays its start-up, rejoin_after_setup repairs it)
    processor.rejoins = bool(config.worker_reboot)
    from mindspeed_ha.recovery import comm, groups

    processor.set_recovery_hooks(abort=comm.abort, aborted=comm.CollectiveAborted,
                                 use_store=groups.use_rendezvous_store, pause_task=pause_task)
    return processor


class FallbackGroups:
    """The groups for deciding without the controller: this rank's node, and the nodes' leaders.

    Ranks are grouped in nodes of ``LOCAL_WORLD_SIZE`` consecutive global ranks (torchrun
    numbers a node's workers consecutively: ``node_rank * nproc_per_node + local_rank``); a
    node's lowest rank is its leader. Each rank is connected to the other ranks of its node,
    and a leader also to the other leaders: ``local - 1`` connections per rank, plus
    ``nodes - 1`` per leader, instead of ``world - 1`` per rank for one group of every rank
    (16,384 ranks on 8 per node: 7 and 2,047 instead of 16,383).

    Attributes:
        node: the gloo group of this node's ranks (None on a node of one rank).
        leaders: the gloo group of every node's leader (None off a leader, or with one node).
        node_ranks / leader_ranks: their global ranks, ascending.
    """

    def __init__(self, node, leaders, node_ranks, leader_ranks, world: int, local: int):
        self.node, self.leaders = node, leaders
        self.node_ranks, self.leader_ranks = list(node_ranks), list(leader_ranks)
        self.world, self.local = world, local

    def node_size(self, leader: int) -> int:
        """Ranks of the node ``leader`` leads (the last node may have fewer)."""
        return min(self.local, self.world - leader)

    def groups(self) -> list:
        """The process groups made (for the recovery's ``exclude`` and ``comm.exempt``)."""
        return [g for g in (self.node, self.leaders) if g is not None]


def fallback_layout(rank: int, world: int, local: int):
    """(this rank's node's ranks, every node's leader) for nodes of ``local`` consecutive ranks.

    Raises:
        ValueError: ``local`` outside 1..world, or ``rank`` outside 0..world-1.
    """
    if not 1 <= local <= world or not 0 <= rank < world:
        raise ValueError(f"LOCAL_WORLD_SIZE={local}, rank {rank}: accepted 1 <= LOCAL_WORLD_SIZE <= world size "
                         f"({world}) and 0 <= rank < world size")
    first = rank - rank % local
    return list(range(first, min(world, first + local))), list(range(0, world, local))


def fallback_group(config):
    """The groups for deciding without the controller, made at start-up (:class:`FallbackGroups`).

    If the controller is lost, the ranks agree among themselves over them (the processor's
    ``on_controller_lost`` exchange, :func:`exchange`): their connections were made now, so
    they work when the controller, torchrun's store (both in the launcher process) and new
    groups are gone. Used from the processor's own thread only, never by the training
    thread, so they cannot interleave with training collectives. Their timeout bounds
    each exchange: ``action_timeout_s + heartbeat_timeout_s`` (a save step, plus the
    time ranks take to notice the loss); a dead rank fails it at once (its node's group
    first; the rank that sees it exits, which fails its leader's, and so on). Cost: a node
    group and, on a leader, the leaders' group at start-up (a rank connects only to the
    members of its groups), nothing per iteration. ``LOCAL_WORLD_SIZE`` (torchrun
    sets it) sizes a node; unset, one node of every rank (one group of all, as before).
    """
    import datetime

    import torch.distributed as dist

    from mindspeed_ha.recovery import comm

    timeout = datetime.timedelta(seconds=config.action_timeout_s + config.heartbeat_timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get(ha_env.LOCAL_WORLD_SIZE) or world)
    node_ranks, leader_ranks = fallback_layout(rank, world, local)
    node = leaders = None
    # every rank calls new_group for every group, in the same order (a non-member's call only
    # counts the group: torch names groups by that count). Not use_local_synchronization:
    # torch 2.13 names such a group by its ranks and how many groups the caller has, which
    # differs between a leader and the other ranks of its node (measured: the leaders'
    # group then never rendezvouses)
    for first in leader_ranks:
        block = list(range(first, min(world, first + local)))
        if len(block) > 1:
            group = dist.new_group(block, backend="gloo", timeout=timeout)
            if rank in block:
                node = group
    if len(leader_ranks) > 1:
        group = dist.new_group(leader_ranks, backend="gloo", timeout=timeout)
        leaders = group if rank in leader_ranks else None
    out = FallbackGroups(node, leaders, node_ranks, leader_ranks, world, local)
    # the processor thread uses them while a recovery has aborted the training collectives
    for group in out.groups():
        comm.exempt(group)
    return out


def _encode(record) -> "torch.Tensor":  # noqa: F821 - torch is imported lazily
    import json

    import torch

    data = json.dumps(record, sort_keys=True).encode()
    if len(data) > EXCHANGE_BYTES - 4:
        raise ValueError(f"exchange record of {len(data)} bytes > {EXCHANGE_BYTES - 4}")
    buf = torch.zeros(EXCHANGE_BYTES, dtype=torch.uint8)
    buf[:4] = torch.tensor(list(len(data).to_bytes(4, "big")), dtype=torch.uint8)
    buf[4:4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def _decode(buf) -> dict:
    import json

    raw = buf.numpy().tobytes()
    n = int.from_bytes(raw[:4], "big")
    return json.loads(raw[4:4 + n].decode())


def exchange(groups: FallbackGroups, record: dict) -> list:
    """Every rank's JSON ``record``, in rank order, on every rank (over :class:`FallbackGroups`).

    Three steps: an all-gather in the node, an all-gather of the nodes' blocks among the
    leaders, and the leader's broadcast of the whole list (its length, then the JSON) to its
    node. Each rank sends ``EXCHANGE_BYTES`` and, on a leader, ``local * EXCHANGE_BYTES``.

    Raises:
        ValueError: the record is larger than ``EXCHANGE_BYTES``.
        RuntimeError: (gloo) a rank is gone, or silent past the groups' timeout.
    """
    import json

    import torch
    import torch.distributed as dist

    buf = _encode(record)
    if groups.node is not None:
        out = [torch.zeros_like(buf) for _ in groups.node_ranks]
        dist.all_gather(out, buf, group=groups.node)
        block = torch.cat(out)
    else:
        block = buf
    leader = groups.node_ranks[0]
    if dist.get_rank() == leader:
        if groups.leaders is not None:  # node blocks padded to a whole node (the last may have fewer ranks)
            width = groups.local * EXCHANGE_BYTES
            padded = [torch.zeros(width, dtype=torch.uint8) for _ in groups.leader_ranks]
            mine = torch.zeros(width, dtype=torch.uint8)
            mine[:block.numel()] = block
            dist.all_gather(padded, mine, group=groups.leaders)
            blocks = [p[:groups.node_size(r) * EXCHANGE_BYTES] for p, r in zip(padded, groups.leader_ranks)]
            everything = torch.cat(blocks)
        else:
            everything = block
        records = [_decode(part) for part in everything.split(EXCHANGE_BYTES)]
        if groups.node is None:
            return records
        payload = json.dumps(records).encode()
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, leader, group=groups.node)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), leader, group=groups.node)
        return records
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, leader, group=groups.node)
    payload = torch.zeros(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, leader, group=groups.node)
    return json.loads(payload.numpy().tobytes().decode())


def sweep_save_dir(save_dir: str) -> None:
    """What killed dying checkpoints left in ``save_dir``, before any save of this run
    (:func:`mindspeed_ha.checkpoint.leftovers.at_start_up`; each directory logged)."""
    from mindspeed_ha.checkpoint import leftovers

    try:
        leftovers.at_start_up(save_dir, os.environ.get(ha_env.KEEP_FAILED_STAGING) == "1")
    except OSError as exc:  # a start-up clean-up never stops the run
        log.warning("%s: start-up clean-up of dying checkpoint leftovers failed: %s", save_dir, exc)
