"""Deciding without the controller needs no full mesh: a group per node and one of the nodes'
leaders (``runtime.bootstrap.fallback_group`` / ``exchange``; issue 19).

The layout is a pure function; the exchange runs in 3 processes on CPU/gloo (no Megatron):
nodes of 2 ranks (the last of 1), every rank gets every record in rank order, each rank is
in its node's group and only a leader in the leaders' group; a rank that is gone fails
every other rank's next exchange (each rank that sees it exits, as the processor does).
"""

import json
import os
import subprocess
import sys

import pytest

from mindspeed_ha.runtime.bootstrap import fallback_layout

pytestmark = pytest.mark.timeout(180)


def test_nodes_are_blocks_of_local_world_size_and_their_first_rank_leads():
    assert fallback_layout(5, 16, 8) == (list(range(0, 8)), [0, 8])
    assert fallback_layout(9, 16, 8) == (list(range(8, 16)), [0, 8])
    assert fallback_layout(4, 5, 2) == ([4], [0, 2, 4])  # a last node with fewer ranks
    assert fallback_layout(3, 4, 4) == ([0, 1, 2, 3], [0])  # one node: one group, no leaders' group
    assert fallback_layout(2, 4, 1) == ([2], [0, 1, 2, 3])  # a rank per node: the leaders' group is everyone
    for rank, world, local in ((0, 4, 0), (0, 4, 5), (4, 4, 2), (-1, 4, 2)):
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
            fallback_layout(rank, world, local)


RANK_SCRIPT = r"""
import json, os, sys, types
import torch.distributed as dist
from mindspeed_ha.runtime import bootstrap
rank, world, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
groups = bootstrap.fallback_group(types.SimpleNamespace(action_timeout_s=60.0, heartbeat_timeout_s=10.0))
print("GROUPS", json.dumps({"node": dist.get_world_size(groups.node) if groups.node else 1,
                            "leaders": dist.get_world_size(groups.leaders) if groups.leaders else 0}), flush=True)
records = bootstrap.exchange(groups, {"rank": rank, "pause_at": 10 * rank, "pad": "x" * (100 * rank)})
print("RECORDS", json.dumps(records), flush=True)
if rank == 1:
    os._exit(0)  # gone before the next exchange
try:
    bootstrap.exchange(groups, {"rank": rank})
    print("AGREED", flush=True)
except Exception as exc:  # the processor's path: the rank ends at once (exit 78)
    print("FAILED", type(exc).__name__, flush=True)
    sys.stdout.flush()
    os._exit(78)
os._exit(0)
"""


def test_exchange_over_node_groups_and_leaders_and_a_gone_rank_fails_everyone(tmp_path):
    world = 3
    env = dict(os.environ, LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               MASTER_ADDR="127.0.0.1")
    init = f"file://{tmp_path / 'store'}"
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(world), init], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=150)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    expected = [{"rank": r, "pause_at": 10 * r, "pad": "x" * (100 * r)} for r in range(world)]
    sizes = {0: (2, 2), 1: (2, 0), 2: (1, 2)}  # (node group, leaders' group)
    for rank, (code, out, err) in enumerate(outs):
        lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
        assert "GROUPS" in lines, (rank, code, out, err[-3000:])
        groups = json.loads(lines["GROUPS"])
        assert (groups["node"], groups["leaders"]) == sizes[rank], (rank, out, err[-3000:])
        assert json.loads(lines["RECORDS"]) == expected, (rank, err[-3000:])
        if rank == 1:
            assert code == 0
        else:  # nobody agrees without rank 1: its node fails first, then every leader, then their nodes
            assert code == 78 and "FAILED" in lines and "AGREED" not in out, (rank, code, out, err[-3000:])
