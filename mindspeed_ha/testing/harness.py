"""Run the shipped GPT trainer as real processes and collect its per-iteration losses.

Shipped for users' own integration tests (CPU/gloo works everywhere)::

    from mindspeed_ha.testing.harness import launch, tiny_gpt_args
    r = launch(4, tiny_gpt_args(tp=2, train_iters=4), timeout_s=120)
    assert r.returncode == 0, r.stderr
    r.losses  # {1: '0x1.8c...p+2', 2: ...}  (float.hex of lm loss, bitwise comparable)
"""

from __future__ import annotations

from mindspeed_ha import env as ha_env
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Dict, List, Mapping, Optional, Sequence

TRAINER_MODULE = "mindspeed_ha.testing.trainer.pretrain_gpt"
ENV_LOSS_LOG = ha_env.LOSS_LOG  # patches/testing.py


@dataclasses.dataclass
class RunResult:
    """Outcome of :func:`launch`.

    Attributes:
        returncode: launcher exit status (-9 style negatives for signals; None: timed out).
        stdout, stderr: decoded output of the whole process group.
        losses: iteration -> ``float.hex()`` of lm loss, from the loss log.
        grad_norms: iteration -> ``float.hex()`` of the grad norm (``script`` runs only).
        loss_log_path: the JSON-lines loss log the run wrote.
        timed_out: the run exceeded ``timeout_s`` and its process group was killed.
    """

    returncode: Optional[int]
    stdout: str
    stderr: str
    losses: Dict[int, str]
    loss_log_path: str
    timed_out: bool = False
    loss_records: List[dict] = dataclasses.field(default_factory=list)
    grad_norms: Dict[int, str] = dataclasses.field(default_factory=dict)

    def records(self) -> List[dict]:
        """The loss log's JSON lines (read when the run ended; the file may be gone)."""
        return list(self.loss_records)


def read_loss_log(path: str) -> List[dict]:
    """The JSON-lines records of a ``--loss-log`` file (missing file: [])."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses_from_log(path: str) -> Dict[int, str]:
    """iteration -> lm_loss_hex; a later record for the same iteration wins."""
    return {int(r["iteration"]): r["lm_loss_hex"] for r in read_loss_log(path)}


def read_rank_loss_logs(prefix: str):
    """Records and losses of the ``testing.loss_log`` patch (files ``<prefix>.rank<R>``).

    Returns:
        ``(records, losses)``: every rank's records (``rank`` added), and iteration ->
        ``float.hex()`` of ``lm loss`` from the ranks that report it (the last pipeline
        stage); a later record for the same iteration wins.
    """
    records: List[dict] = []
    for path in sorted(glob.glob(f"{glob.escape(prefix)}.rank*")):
        rank = int(path.rsplit(".rank", 1)[1])
        records += [dict(r, rank=rank) for r in read_loss_log(path)]
    losses = {int(r["iteration"]): r["loss"]["lm loss"] for r in records if "lm loss" in r["loss"]}
    return records, losses


def read_patch_reports(prefix: str) -> Dict[int, dict]:
    """rank -> the JSON patch report each rank wrote (``MINDSPEED_HA_PATCH_REPORT=<prefix>``:
    files ``<prefix>.rank<R>``, the ``testing`` feature's)."""
    rows = {}
    for path in glob.glob(f"{glob.escape(prefix)}.rank*"):
        with open(path) as f:
            rows[int(path.rsplit(".rank", 1)[1])] = json.load(f)
    return rows


def torchrun_command(nproc: int) -> List[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def launcher_command(nproc: int) -> List[str]:
    """``python -m mindspeed_ha.launcher --standalone --nproc-per-node N`` (``mindspeed-ha-run``)."""
    return [sys.executable, "-m", "mindspeed_ha.launcher", "--standalone", f"--nproc-per-node={nproc}"]


def tiny_gpt_args(tp: int = 1, pp: int = 1, train_iters: int = 8, **overrides) -> List[str]:
    """The standard tiny GPT every test uses (4 layers, hidden 64, 4 heads, seq 32, mbs 2,
    gbs 8, byte-level tokenizer, distributed optimizer, dropout 0.1).

    ``overrides``: ``flag_name=value`` (underscores become dashes; ``True`` adds a bare
    switch, ``False``/``None`` removes the flag).
    """
    flags = {
        "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
        "max_position_embeddings": 32, "micro_batch_size": 2, "global_batch_size": 8,
        "train_iters": train_iters, "lr": 1e-3, "min_lr": 1e-4, "lr_decay_style": "cosine",
        "lr_warmup_iters": 1, "weight_decay": 0.01, "clip_grad": 1.0, "hidden_dropout": 0.1,
        "attention_dropout": 0.1, "seed": 1234, "tokenizer_type": "ByteLevelTokenizer",
        "make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp, "use_distributed_optimizer": True, "log_interval": 1,
    }
    flags.update(overrides)
    return flags_to_argv(flags)


def flags_to_argv(flags: Mapping[str, object]) -> List[str]:
    """``{flag_name: value}`` -> argv: underscores become dashes, ``True`` is a bare
    switch, ``False``/``None`` drop the flag."""
    out: List[str] = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        out.append("--" + name.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out


def launch(nproc: int, train_args: Sequence[str], *, env: Optional[Mapping[str, str]] = None,
           timeout_s: float = 300, launcher: Optional[Sequence[str]] = None,
           cwd: Optional[str] = None, module: str = TRAINER_MODULE,
           loss_log: Optional[str] = None, script: Optional[str] = None) -> RunResult:
    """Run ``<launcher> -m <module> <train_args> --loss-log <fresh file>`` and wait.

    With ``script`` (e.g. Megatron-LM's own ``pretrain_gpt.py``) the command is
    ``<launcher> <script> <train_args>`` and the losses come from the ``testing.loss_log``
    patch (``MINDSPEED_HA_LOSS_LOG``, one file per rank) instead of ``--loss-log``.

    Args:
        nproc: ranks (``--nproc-per-node``) for the default torchrun launcher.
        launcher: command prefix; default :func:`torchrun_command` (``nproc``). Any
            command that accepts ``-m module args...`` works (e.g. ``mindspeed-ha-run``).
        env: extra environment (``OMP_NUM_THREADS=1`` is set unless given; ``TMPDIR`` is a
            directory of the run's own, removed with everything in it when the run ends,
            unless given).
        timeout_s: the launcher and every process under it are SIGKILLed after this (also when
            the wait is interrupted, e.g. by KeyboardInterrupt); ``timed_out`` set.
        loss_log: path for ``--loss-log`` (default: a new file in a temp dir; an existing
            file is truncated first so only this run's lines are read).
    """
    cmd = list(launcher) if launcher is not None else torchrun_command(nproc)
    scratch = tempfile.mkdtemp(prefix="mindspeed_ha_run_")  # removed below, whatever happens
    try:
        own_log = loss_log is None
        if own_log:
            loss_log = os.path.join(scratch, "loss.jsonl")
        open(loss_log, "w").close()
        # torchrun's per-run logs go to our scratch dir too (default: a new /tmp dir per run).
        cmd += ["--log-dir", os.path.join(scratch, "torchrun")]
        run_env = dict(os.environ)
        run_env.setdefault("OMP_NUM_THREADS", "1")
        # the job's temporary files (the node relay's socket directory, a multiprocessing
        # manager's pymp-* listener directory, caches) in the scratch directory, removed
        # below: a launcher or worker ended by SIGKILL (a fault, a timeout) cannot remove its own
        os.makedirs(os.path.join(scratch, "tmp"))
        run_env["TMPDIR"] = os.path.join(scratch, "tmp")
        if script is None:
            cmd += ["-m", module, *train_args, "--loss-log", loss_log]
        else:
            cmd += [script, *train_args]
            run_env[ENV_LOSS_LOG] = loss_log
            for stale in glob.glob(f"{glob.escape(loss_log)}.rank*"):
                os.remove(stale)
        if env:
            run_env.update(env)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=run_env,
                                cwd=cwd, start_new_session=True, text=True)
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            end_run(proc.pid)
            try:
                out, err = proc.communicate(timeout=_DRAIN_S)
            except subprocess.TimeoutExpired:  # a process outside the group holds the pipes open
                proc.kill()
                for pipe in (proc.stdout, proc.stderr):
                    pipe.close()
                proc.wait()
                out, err = "", f"(output lost: the pipes stayed open {_DRAIN_S} s after the kill)"
        finally:
            if proc.poll() is None:  # interrupted (KeyboardInterrupt, ...): the launcher and its workers
                end_run(proc.pid)
                proc.wait()
        _kill_group(proc.pid)  # stragglers that outlived the launcher
        grad_norms: Dict[int, str] = {}
        if script is None:
            records, losses = read_loss_log(loss_log), losses_from_log(loss_log)
        else:
            records, losses = read_rank_loss_logs(loss_log)
            grad_norms = {int(r["iteration"]): r["grad_norm"] for r in records if "lm loss" in r["loss"]}
        return RunResult(None if timed_out else proc.returncode, out, err, losses, loss_log,
                         timed_out, records, grad_norms)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


#: seconds to drain the pipes after the process group was killed on timeout
_DRAIN_S = 30


def end_run(pid: int) -> None:
    """SIGKILL the launcher ``pid`` and every process under it (its workers run in sessions of
    their own, out of reach of a signal to its process group)."""
    from mindspeed_ha.launch.proctree import end_tree

    end_tree(pid, include_root=True)
    _kill_group(pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def time_full_restart(args: List[str], k: int, workdir: str, nproc: int = 4) -> float:
    """Seconds a full job restart takes from the periodic checkpoint of iteration ``k - 1``
    (benchmarks compare in-process recoveries with it): a first run (once per ``workdir``)
    saves that checkpoint and exits (``--save-interval``/``--exit-interval k-1``); the timed
    run is the same job started again with ``--load`` and ``--train-iters k``: process start,
    imports, init, model build, checkpoint load and one iteration, until the launcher returns.
    A lower bound of a real restart, which also redoes the steps since the checkpoint.

    Args:
        args: the job's training arguments with ``--train-iters`` and without ``--save`` /
            ``--load``.

    Raises:
        SystemExit: a run failed (its stderr's tail in the message).
    """
    import os
    import time

    ckpt = os.path.join(workdir, "periodic")
    if not os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt")):
        r = launch(nproc, list(args) + ["--save", ckpt, "--save-interval", str(k - 1), "--exit-interval", str(k - 1)],
                   launcher=launcher_command(nproc), timeout_s=600)
        if r.returncode != 0:
            raise SystemExit(f"periodic checkpoint run failed:\n{r.stderr[-3000:]}")
    timed = list(args) + ["--load", ckpt]
    timed[timed.index("--train-iters") + 1] = str(k)
    t0 = time.monotonic()
    r = launch(nproc, timed, launcher=launcher_command(nproc), timeout_s=600)
    dt = time.monotonic() - t0
    if r.returncode != 0 or sorted(r.losses) != [k]:
        raise SystemExit(f"restart run failed ({r.returncode}, losses {sorted(r.losses)}):\n{r.stderr[-3000:]}")
    return dt


def read_jsonl(path: str) -> list:
    """The JSON objects of a JSON-lines file (the injector's and the recovery logs); [] when
    the file does not exist (nothing fired)."""
    import json
    import os

    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


#: (TP, PP, extra flags) of the 4-rank layouts the recovery tests use: DP 2 with the
#: default 2 optimizer replicas, or DP 4 with 2 replicas
FOUR_RANK_LAYOUTS = {"tp1pp2": (1, 2, []), "tp2pp1": (2, 1, []), "dp4": (1, 1, ["--ha-replica-count", "2"])}


def four_rank_args(layout: str, train_iters: int, *flags: str) -> List[str]:
    """The tiny GPT in one of :data:`FOUR_RANK_LAYOUTS` with the HA master switch, a free
    controller port and ``flags`` (the feature under test, then per-run extras)."""
    tp, pp, more = FOUR_RANK_LAYOUTS[layout]
    return tiny_gpt_args(tp=tp, pp=pp, train_iters=train_iters) + [
        "--enable-high-availability", "--ha-controller-port", "0", *more, *flags]


def run_four(args: List[str], env: Optional[Dict[str, str]] = None, timeout_s: float = 300):
    """:func:`launch` of 4 ranks through ``mindspeed-ha-run``; fails the test on a timeout."""
    r = launch(4, args, launcher=launcher_command(4), env=env, timeout_s=timeout_s)
    assert not r.timed_out, (r.stdout + r.stderr)[-6000:]
    return r


class Baselines:
    """Uninterrupted runs' losses per layout, each run once per test module (a module-scoped
    fixture holds one): :meth:`get` runs ``args_of(layout)`` the first time."""

    def __init__(self, args_of, train_iters: int):
        self.args_of, self.train_iters, self.losses = args_of, train_iters, {}

    def get(self, layout: str) -> Dict[int, str]:
        if layout not in self.losses:
            r = run_four(self.args_of(layout))
            assert r.returncode == 0, r.stderr[-4000:]
            assert sorted(r.losses) == list(range(1, self.train_iters + 1))
            self.losses[layout] = r.losses
        return self.losses[layout]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS may hand it out again later: use at once)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TwoNodeJob:
    """One job as two ``mindspeed-ha-run`` launchers on loopback (``--nnodes 2``, node 0
    and node 1, ``nproc`` workers each, torchrun's static rendezvous at
    ``127.0.0.1:master_port``), the controller in node 0's launcher at ``controller_port``.

    :meth:`start` starts a node's launcher (again: a replacement launcher, same command);
    :meth:`wait` waits for it; :meth:`close` (also on ``with`` exit) SIGKILLs whatever is
    left of every launcher's process group and removes the scratch directory. Each
    launcher's stdout/stderr go to a file (``output(node)``), read after it ended.
    """

    def __init__(self, train_args: Sequence[str], *, nproc: int = 2, env: Optional[Mapping[str, str]] = None,
                 module: str = TRAINER_MODULE):
        self.scratch = tempfile.mkdtemp(prefix="mindspeed_ha_2n_")
        self.loss_log = os.path.join(self.scratch, "loss.jsonl")
        open(self.loss_log, "w").close()
        self.master_port, self.controller_port = free_port(), free_port()
        self.nproc, self.module, self.train_args = nproc, module, list(train_args)
        self.env = dict(os.environ)
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env[ha_env.AUTH_KEY] = os.urandom(32).hex()
        self.env[ha_env.TTP_PORT] = str(self.controller_port)
        # temporary files of the launchers (the node relay's socket directory) in the scratch
        # directory: a launcher the test SIGKILLs (a lost node) cannot remove its own
        os.makedirs(os.path.join(self.scratch, "tmp"))
        self.env["TMPDIR"] = os.path.join(self.scratch, "tmp")
        self.env.update(env or {})
        self.procs: Dict[int, List[subprocess.Popen]] = {0: [], 1: []}

    def command(self, node: int) -> List[str]:
        return [sys.executable, "-m", "mindspeed_ha.launcher", "--nnodes", "2", "--node-rank", str(node),
                f"--nproc-per-node={self.nproc}", "--master-addr", "127.0.0.1", "--master-port",
                str(self.master_port), "--log-dir", os.path.join(self.scratch, f"torchrun{node}"),
                "-m", self.module, *self.train_args, "--loss-log", self.loss_log]

    def start(self, node: int, env: Optional[Mapping[str, str]] = None) -> subprocess.Popen:
        n = len(self.procs[node])
        run_env = dict(self.env, **(env or {}))
        out = open(os.path.join(self.scratch, f"node{node}.{n}.out"), "w")
        with out:
            proc = subprocess.Popen(self.command(node), stdout=out, stderr=subprocess.STDOUT, env=run_env,
                                    start_new_session=True, text=True)
        self.procs[node].append(proc)
        return proc

    def wait(self, proc: subprocess.Popen, timeout_s: float) -> Optional[int]:
        """``proc``'s exit code, or None when it ran past ``timeout_s`` (then killed)."""
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
            return None

    def output(self, node: int, n: int = -1) -> str:
        n = n % len(self.procs[node])
        with open(os.path.join(self.scratch, f"node{node}.{n}.out")) as f:
            return f.read()

    def losses(self) -> Dict[int, str]:
        return losses_from_log(self.loss_log)

    def close(self) -> None:
        import psutil

        for procs in self.procs.values():
            for proc in procs:
                _kill_group(proc.pid)
                if proc.poll() is None:
                    proc.wait()
        # workers run in sessions of their own (torch's handler), and a lost node's launcher
        # cannot take them with it: every process whose command line names this job's scratch
        for p in psutil.process_iter(["cmdline"]):
            if any(self.scratch in part for part in (p.info["cmdline"] or ())):
                try:
                    p.kill()
                except psutil.Error:
                    pass
        shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> "TwoNodeJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
