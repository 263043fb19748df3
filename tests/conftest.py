"""Session-wide test set-up.

* The embedded corpus is built into a temporary cache, so the suite leaves nothing in
  ``~/.cache`` (every launched rank inherits the variable).
* ``shared_path`` / fixtures ``megatron_lm_tarball``, ``corpus_text_file``: files of the project's read-only
  ``shared/`` folder (beside the checkout, or beside its parent), the one place tests
  look for them.
* Every test has a TMPDIR of its own, removed when it ends; what was left is named in a warning (``_own_tmpdir``).
* Fixture ``uninterrupted``: the uninterrupted 4-rank runs that modules compare with,
  launched once per session and shared by the xdist workers (a file-locked cache).
* Marker ``hog``: the representative multi-process tests that ``.ci/run`` runs a second
  time beside two CPU hogs (``pytest -m hog``). They are listed here, in one place
  (a test file may also mark its own with ``@pytest.mark.hog``).
"""

import os
import warnings

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_TARBALL = "MINDSPEED_HA_MEGATRON_LM_TARBALL"


def shared_path(*parts: str) -> str:
    """A file of the project's shared/ folder, beside the checkout (or its parent)."""
    for base in (os.path.join(REPO, ".."), os.path.join(REPO, "..", "..")):
        path = os.path.join(base, "shared", *parts)
        if os.path.exists(path):
            return os.path.abspath(path)
    return os.path.abspath(os.path.join(REPO, "..", "shared", *parts))


@pytest.fixture(scope="session")
def megatron_lm_tarball() -> str:
    """Megatron-LM core_v0.12.1, pinned and unmodified (``$MINDSPEED_HA_MEGATRON_LM_TARBALL`` wins)."""
    path = os.environ.get(ENV_TARBALL) or shared_path("third_party", "Megatron-LM-core_v0.12.1.tar.gz")
    assert os.path.exists(path), f"Megatron-LM tarball not found: {path} ({ENV_TARBALL})"
    return path


@pytest.fixture(scope="session")
def mindspeed_llm_tarballs() -> dict:
    """MindSpeed-LLM 2.3.0, MindSpeed 2.3.0_core_r0.12.1 and Megatron-LM core_v0.12.1, pinned and
    unmodified: ``key -> path`` (keys of ``mindspeed_ha.testing.mindspeed_llm.TARBALLS``)."""
    from mindspeed_ha.testing.mindspeed_llm import TARBALLS

    paths = {k: shared_path("third_party", name) for k, name in TARBALLS.items()}
    missing = [p for p in paths.values() if not os.path.exists(p)]
    assert not missing, f"third-party tarballs not found: {missing}"
    return paths


@pytest.fixture(scope="session")
def corpus_text_file() -> str:
    """A real text corpus (tinyshakespeare) for building an indexed dataset with Megatron-LM's tools."""
    path = shared_path("data", "tinyshakespeare.txt")
    assert os.path.exists(path), f"corpus not found: {path}"
    return path

#: One of each failure-path family, chosen to stay within a few minutes beside the hogs:
#: a rank killed mid-backward, dying checkpoint compared bitwise and resumed (PP2); a TP
#: peer killed in forward, resumed (TP2); plain torchrun with rank 0 and the controller it
#: spawned (torchrun's 30 s SIGTERM window); replicas bitwise equal to no HA (PP2 x DP2,
#: bf16); a schedule of six in-place recoveries (UCE rolled back and rolled forward, network errors); a rank killed and
#: restarted alone (ARF: DP4, the cheapest layout, 21 CPU-s against TP1 PP2's 29: a rank
#: killed before the update (rejoin), then its new process killed inside the update (roll
#: forward)). tests/test_control.py marks its SIGSTOP (hang) job itself.
HOG_TESTS = (
    "tests/test_dying_checkpoint.py::test_kill_rank_dying_checkpoint[pp_first-backward]",
    "tests/test_dying_checkpoint.py::test_kill_rank_dying_checkpoint[tp_peer-forward]",
    "tests/test_dying_checkpoint.py::test_plain_torchrun_rank0_killed",
    "tests/test_replica_equivalence.py::test_replicas_bitwise_equal_to_no_ha[pp2-dp2-bf16]",
    "tests/test_preemption.py::test_sigterm_to_workers_stops_the_job_gracefully[one_worker]",
    "tests/test_in_place_recovery.py::test_recovered_in_place[tp1pp2]",
    "tests/test_worker_restart.py::test_killed_rank_restarts_alone_and_rejoins[dp4]",
)


#: The modules that take longest (seconds of wall time measured on 2 cores, 2026-12-04/05),
#: run first: with ``-n 2`` (pytest-xdist, ``--dist loadfile``) a worker takes whole modules
#: in this order, so the longest one does not start last while the other worker idles.
HEAVY_FIRST = (
    "test_stock_megatron_lm.py",  # ~700 s: 26 stock pretrain_gpt.py jobs
    "test_integrity.py", "test_two_nodes.py", "test_soak.py", "test_pause_job.py", "test_worker_restart.py",
    "test_preemption.py", "test_fault_coverage.py", "test_in_place_recovery.py", "test_megatron_counters.py",
    "test_replica_equivalence.py", "test_in_place_reload.py", "test_mindspeed_llm.py", "test_switch_job.py",
    "test_dying_checkpoint.py", "test_training.py",
)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(item.nodeid.split("::")[0]), len(rank)))  # stable
    by_id = {item.nodeid: item for item in items}
    for nodeid in HOG_TESTS:
        if nodeid in by_id:
            by_id[nodeid].add_marker(pytest.mark.hog)
    if "hog" in (config.option.markexpr or "") and not any("::" in a for a in config.args):
        files = {nodeid.split("::")[0] for nodeid in by_id}
        missing = [n for n in HOG_TESTS if n.split("::")[0] in files and n not in by_id]
        if missing:  # a renamed test would silently shrink the hog pass
            raise pytest.UsageError(f"tests/conftest.py HOG_TESTS names tests that do not exist: {missing}")


@pytest.fixture(scope="session", autouse=True)
def _private_corpus_cache(tmp_path_factory):
    old = os.environ.get("MINDSPEED_HA_CACHE")
    os.environ["MINDSPEED_HA_CACHE"] = str(tmp_path_factory.mktemp("corpus_cache"))
    yield
    if old is None:
        os.environ.pop("MINDSPEED_HA_CACHE", None)
    else:
        os.environ["MINDSPEED_HA_CACHE"] = old


HIDDEN = os.path.join(REPO, "tests", "_hidden")
FORKSERVER = "MINDSPEED_HA_FORKSERVER"


def _pythonpath_without(path: str) -> str:
    return os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != path)


@pytest.fixture(scope="session", autouse=True)
def _job_environment():
    """What every job a test launches runs with, unless the test asks for :func:`as_users_run`:

    * nvidia-modelopt hidden (``tests/_hidden`` first on ``PYTHONPATH``: ``import modelopt``
      raises ImportError). megatron-core 0.12's PyPI package requires it, and Megatron-LM's
      ``megatron/training/checkpointing.py`` imports ``modelopt.torch.opt.plugins`` at
      start-up when it can (``has_nvidia_modelopt``): 4.1 of the 8.0 CPU-seconds a stock
      pretrain_gpt.py rank spends importing here (with ``transformers`` installed, whose
      plugin it loads too). It only acts on models that modelopt converted (none here).
    * ``MINDSPEED_HA_FORKSERVER=1``: ``mindspeed-ha-run`` forks the workers of a job from one
      pre-imported process (:mod:`mindspeed_ha.forkserver`), so a 4-rank job imports torch
      and megatron-core once instead of 4 times.

    Tests that run as users run (both off): tests/test_pause_job.py and
    tests/test_stock_megatron_lm.py ``test_recovered_in_place`` (whose HA-on run is compared bitwise with
    baselines made with both on), the example script test."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", FORKSERVER)}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HIDDEN, _pythonpath_without(HIDDEN)) if p)
    os.environ.setdefault(FORKSERVER, "1")
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def as_users_run(monkeypatch):
    """The jobs of this test run as users' jobs do: nvidia-modelopt visible where it is
    installed, workers started by torchrun (no fork server)."""
    monkeypatch.setenv("PYTHONPATH", _pythonpath_without(HIDDEN))
    monkeypatch.delenv(FORKSERVER, raising=False)


@pytest.fixture(scope="session", autouse=True)
def _no_torch_compile_start_up():
    """Every job a test launches runs with ``TORCHDYNAMO_DISABLE=1`` (unless the caller's
    environment says otherwise): megatron-core decorates its fusions with ``torch.compile``
    at import (megatron/core/jit.py), which imports dynamo and inductor, 1.4 of the 4.8
    CPU-seconds one rank spends importing megatron-core here. A test compares runs that
    share this environment (the baseline and the faulted run alike), so no assertion
    depends on it; the stock Megatron-LM runs set it already (testing/megatron_lm.py)."""
    old = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    yield
    if old is None:
        os.environ.pop("TORCHDYNAMO_DISABLE", None)


#: ``MINDSPEED_HA_TEST_COST=FILE``: one JSON line per test appended to FILE: its wall seconds
#: and the CPU seconds of the processes it started and waited for (``RUSAGE_CHILDREN``, user
#: + system; a launcher waits for its workers, so a job's ranks are included). CPU seconds do
#: not depend on the machine's load, unlike ``--durations``: they say where CI's time goes.
_COST_FILE = os.environ.get("MINDSPEED_HA_TEST_COST")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _COST_FILE:
        yield
        return
    import json
    import resource
    import time

    def cpu():
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    cpu0, wall0 = cpu(), time.monotonic()
    yield
    row = {"test": item.nodeid, "wall_s": round(time.monotonic() - wall0, 2), "child_cpu_s": round(cpu() - cpu0, 2)}
    with open(_COST_FILE, "a") as f:
        f.write(json.dumps(row) + "\n")


#: torch's compile cache (``TORCHINDUCTOR_CACHE_DIR``, else ``$TMPDIR/torchinductor_<user>``), which
#: ``import megatron.core`` creates (its ``torch.compile`` decorators, megatron/core/jit.py): one per
#: session, made before anything imports megatron-core, removed at its end
_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def pytest_configure(config):
    if _INDUCTOR_CACHE not in os.environ:
        import tempfile

        config.msha_inductor_cache = os.environ[_INDUCTOR_CACHE] = tempfile.mkdtemp(prefix="msha-inductor-")


def pytest_unconfigure(config):
    own = getattr(config, "msha_inductor_cache", None)
    if own is not None:
        import shutil

        shutil.rmtree(own, ignore_errors=True)  # made by mkdtemp in pytest_configure: ours
        os.environ.pop(_INDUCTOR_CACHE, None)


@pytest.fixture(scope="session", autouse=True)
def _session_temp_dirs(tmp_path_factory):
    """What lives as long as this pytest process is made in the real temp directory before
    any test sets its own TMPDIR (below): pytest's base temp directory, and this process's
    ``multiprocessing`` temp directory (``pymp-*``, made on first use), removed at the end
    of the session (a pytest-xdist worker may skip the exit handler that would)."""
    from multiprocessing import util

    tmp_path_factory.getbasetemp()
    util.get_temp_dir()
    yield
    for finalizer in list(util._finalizer_registry.values()):  # multiprocessing's own exit finalizer of it
        if getattr(finalizer, "_callback", None) is util._remove_temp_dir:
            finalizer()


@pytest.fixture(autouse=True)
def _own_tmpdir(monkeypatch, _session_temp_dirs):
    """Every test runs with ``TMPDIR`` (inherited by every process it starts) and
    ``tempfile``'s directory set to a fresh directory of its own; anything left there when
    the test ends is removed and named in a warning. Tests leave no files behind: before, a
    day of runs left thousands of ``pymp-*`` (a multiprocessing manager's listener socket)
    and ``torchelastic_*`` (torchrun without ``--log-dir``) directories in ``/tmp``."""
    import shutil
    import tempfile

    own = tempfile.mkdtemp(prefix="msha-t-")  # short: AF_UNIX socket paths under it stay < 108 bytes
    monkeypatch.setenv("TMPDIR", own)
    monkeypatch.setattr(tempfile, "tempdir", own)
    yield
    left = sorted(os.listdir(own))
    shutil.rmtree(own, ignore_errors=True)  # made by mkdtemp above: ours
    if left:  # reported, not failed: a SIGKILLed rank cannot remove its own (the stock pause and llama2 jobs)
        warnings.warn(f"the test left files in its TMPDIR (removed): {left[:10]}", stacklevel=1)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """The uninterrupted runs that several modules compare with, each launched once per
    session: ``uninterrupted(tp, pp, iters, *flags, save=True) -> (losses, save_dir)``.

    The run: the tiny GPT (``tiny_gpt_args``) on 4 ranks through ``mindspeed-ha-run``, HA on
    (``--enable-high-availability``, port 0), then ``flags``; with ``save``, ``--save
    <save_dir> --save-interval 1`` (a checkpoint of every iteration; otherwise ``save_dir``
    is None). ``losses``: iteration -> ``float.hex()``, every iteration checked present.
    Callers only read ``save_dir``. HA on trains bit for bit like HA off
    (tests/test_replica_equivalence.py), so HA-off runs compare with it too.

    With pytest-xdist the workers of a session share one cache (the basetemp root, an
    ``fcntl`` lock per run): a run wanted by modules on two workers is launched once, the
    second worker waits for it."""
    import fcntl
    import json
    import re
    import tempfile

    from mindspeed_ha.testing.harness import launch, launcher_command, tiny_gpt_args

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's root, shared by its workers
    cache = root / "uninterrupted"
    cache.mkdir(exist_ok=True)
    seen = {}

    def get(tp: int, pp: int, iters: int, *flags: str, save: bool = True):
        key = re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join([f"tp{tp}pp{pp}", f"i{iters}", "save" if save else "nosave",
                                                         *(f.lstrip("-") for f in flags)]))
        if key not in seen:
            done = cache / f"{key}.json"
            with open(cache / f"{key}.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                if not done.exists():
                    save_dir = tempfile.mkdtemp(prefix=f"{key}-", dir=cache) if save else None
                    args = tiny_gpt_args(tp=tp, pp=pp, train_iters=iters) + [
                        "--enable-high-availability", "--ha-controller-port", "0", *flags]
                    if save:
                        args += ["--save", save_dir, "--save-interval", "1"]
                    r = launch(4, args, launcher=launcher_command(4), timeout_s=300)
                    assert r.returncode == 0 and not r.timed_out, (key, (r.stdout + r.stderr)[-6000:])
                    assert sorted(r.losses) == list(range(1, iters + 1)), (key, r.losses)
                    tmp = cache / f".{key}.json.tmp"
                    tmp.write_text(json.dumps({"losses": {str(k): v for k, v in r.losses.items()}, "save": save_dir}))
                    os.replace(tmp, done)
            rec = json.loads(done.read_text())
            seen[key] = ({int(k): v for k, v in rec["losses"].items()}, rec["save"])
        return seen[key]

    return get
