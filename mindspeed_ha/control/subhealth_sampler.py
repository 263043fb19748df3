"""The rank's sub-health samplers: a thread of the processor, never the training thread.

Two things are sampled, neither with a collective nor with any work on the training thread:

* **busy**: every :data:`SAMPLE_S` the sampler looks at the training thread's Python stack
  (``sys._current_frames()``, a statistical profiler's view) and counts whether it is
  waiting inside a ``torch.distributed`` call (a frame of ``distributed_c10d.py`` or of
  mindspeed-ha's interruptible collectives, ``recovery/comm.py``). In a synchronous job a
  slow rank makes every rank's step slow, so step times alone cannot say which rank it is;
  the slow rank is the one that waits least: the controller multiplies a rank's step time
  by its busy fraction (its own seconds per iteration). On CUDA/NPU with NCCL/HCCL a
  collective returns once queued, so the wait is in a synchronisation instead and the
  fraction reads high on every rank: the device counters are the signal there.
* **device counters** through a small backend interface (:class:`DeviceSource`):
  :class:`NvmlSource` (``nvidia-ml-py``'s ``pynvml``, when it is installed and sees a GPU),
  :class:`NpuSmiSource` (``npu-smi``, when on the ``PATH``), :class:`FakeSource` (tests).
  None is a dependency: without one, only ``busy`` is sent.

Every quarter window (at most :data:`REPORT_S`) one HEALTH message
(:class:`~mindspeed_ha.control.wire.Health`) goes through the processor's outbox.
Cost: one walk of the training thread's stack per sample (verdicts cached per code object),
measured 11.5 us for an 80-frame stack (2-core VM, load ~12, 2026-12-05), i.e. 0.02% of a
core at 20 samples a second, each holding the GIL that long; the effect on a healthy
step's time was not measured (too small for this machine's noise).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, Mapping, Optional

log = logging.getLogger("mindspeed_ha.control.processor")

#: seconds between two looks at the training thread's stack
SAMPLE_S = 0.05
#: seconds between two HEALTH messages: a quarter window, at most this (one frame per rank every
#: 7.5 s with the default 30 s window: a fraction of the heartbeats' traffic at scale)
REPORT_S = 10.0
#: seconds between two reads of a slow device source (npu-smi starts a process)
SLOW_SOURCE_S = 5.0
#: file name endings of frames that mean "waiting in a torch.distributed call"
WAIT_FILES = ("distributed_c10d.py", os.path.join("recovery", "comm.py"))


class DeviceSource:
    """A device-counter backend: ``read()`` -> counter name -> value (names from
    :data:`mindspeed_ha.control.policy.subhealth.SIGNALS`; cumulative counters as they
    are, the controller takes their delta). ``slow``: reading takes a process start."""

    name = "none"
    slow = False

    def read(self) -> Dict[str, float]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class FakeSource(DeviceSource):
    """Counters a test sets: ``values`` (a dict it may change) or ``fn()`` returning one."""

    name = "fake"

    def __init__(self, values: Optional[Mapping[str, float]] = None, fn: Optional[Callable[[], Mapping]] = None):
        self.values, self.fn = dict(values or {}), fn

    def read(self) -> Dict[str, float]:
        return dict(self.fn() if self.fn is not None else self.values)


class NvmlSource(DeviceSource):
    """One GPU through NVML (``pynvml`` of the ``nvidia-ml-py`` package, NVIDIA's NVML
    bindings): SM clock (MHz), temperature (C), volatile corrected ECC errors (cumulative;
    0 where ECC is off), and whether a slowdown clock-event reason is active (hardware,
    thermal or power brake: ``nvmlDeviceGetCurrentClocksEventReasons``; idle and
    application-clock settings are not slowdowns).

    Args:
        pynvml: the module (tests pass a stand-in).
        index: the NVML device index (:func:`nvml_index`).

    Raises:
        whatever ``nvmlInit`` raises (no driver): :func:`select_source` then tries the next.
    """

    name = "nvml"
    #: nvmlClocksEventReason* bits that mean the clocks are held down (nvml.h): HW slowdown 0x8,
    #: SW thermal 0x20, HW thermal 0x40, HW power brake 0x80 (not idle, power cap or a clock setting)
    SLOWDOWN = 0x8 | 0x20 | 0x40 | 0x80

    def __init__(self, pynvml: Any, index: int):
        self.nv = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def read(self) -> Dict[str, float]:
        nv, h, out = self.nv, self.handle, {}
        for name, fn in (("sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                         ("temperature_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                         ("ecc_corrected", lambda: nv.nvmlDeviceGetTotalEccErrors(
                             h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)),
                         ("throttle", lambda: 1.0 if self._reasons(h) & self.SLOWDOWN else 0.0)):
            try:
                out[name] = float(fn())
            except Exception:  # noqa: BLE001 - a counter this device does not have (NVMLError_NotSupported)
                continue
        return out

    def _reasons(self, h: Any) -> int:
        fn = getattr(self.nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            self.nv.nvmlDeviceGetCurrentClocksThrottleReasons  # the name before NVML 12.2
        return int(fn(h))

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


class NpuSmiSource(DeviceSource):
    """One Ascend NPU through ``npu-smi info -t common -i ID`` (a ``key : value`` table;
    temperature and AI Core frequency are read where their keys say so). Untested on NPU
    hardware (none was lent); a read that fails or times out gives no counters."""

    name = "npu-smi"
    slow = True
    KEYS = (("sm_clock_mhz", re.compile(r"aicore.*(cur)?freq", re.I)), ("temperature_c", re.compile(r"temperature", re.I)))

    def __init__(self, path: str, npu_id: int, timeout_s: float = 3.0):
        self.path, self.npu_id, self.timeout_s = path, npu_id, timeout_s

    def read(self) -> Dict[str, float]:
        try:
            text = subprocess.run([self.path, "info", "-t", "common", "-i", str(self.npu_id)], capture_output=True,
                                  text=True, timeout=self.timeout_s, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            return {}
        return parse_npu_smi(text, self.KEYS)


def parse_npu_smi(text: str, keys=NpuSmiSource.KEYS) -> Dict[str, float]:
    """The counters of one ``npu-smi info -t common`` output (first match of each key)."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        m = re.match(r"\s*(-?\d+(\.\d+)?)", value)
        for name, pattern in keys:
            if m and name not in out and pattern.search(key):
                out[name] = float(m.group(1))
    return out


def nvml_index(env: Mapping[str, str]) -> Optional[int]:
    """This rank's NVML device index: ``LOCAL_RANK`` through ``CUDA_VISIBLE_DEVICES`` when that
    lists indices (None when it lists UUIDs: not mapped)."""
    local = int(env.get("LOCAL_RANK", "0") or 0)
    visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return local
    if local < len(visible) and visible[local].isdigit():
        return int(visible[local])
    return None


def select_source(env: Mapping[str, str] = os.environ) -> Optional[DeviceSource]:
    """NVML when ``pynvml`` imports and initialises, else ``npu-smi`` when on the PATH, else None."""
    try:
        import pynvml  # nvidia-ml-py: optional
    except ImportError:
        pynvml = None
    index = nvml_index(env)
    if pynvml is not None and index is not None:
        try:
            return NvmlSource(pynvml, index)
        except Exception as exc:  # noqa: BLE001 - no driver, no such device: not a GPU host
            log.debug("sub-health: NVML not usable (%s)", exc)
    path = shutil.which("npu-smi")
    if path:
        return NpuSmiSource(path, int(env.get("LOCAL_RANK", "0") or 0))
    return None


def waiting(frame: Any, cache: Dict[Any, bool]) -> bool:
    """Whether a stack whose innermost frame is ``frame`` waits in a ``torch.distributed``
    call (``cache``: code object -> verdict)."""
    while frame is not None:
        code = frame.f_code
        hit = cache.get(code)
        if hit is None:
            hit = cache[code] = code.co_filename.endswith(WAIT_FILES)
        if hit:
            return True
        frame = frame.f_back
    return False


class SubhealthSampler:
    """The sampler thread of one rank.

    Args:
        rank: global rank.
        send: ``send(health)`` queues a :class:`~mindspeed_ha.control.wire.Health` (thread-safe).
        iteration: returns the rank's last completed iteration.
        window_s: the detector's window (a HEALTH at least every quarter of it).
        source: the device backend (None: none).
        thread_id: the training thread's ident (default: the main thread; None: busy not sampled).
    """

    def __init__(self, rank: int, send: Callable[[Any], None], iteration: Callable[[], int], window_s: float,
                 source: Optional[DeviceSource] = None, thread_id: Optional[int] = -1):
        self.rank, self.send, self.iteration, self.source = rank, send, iteration, source
        self.report_s = min(REPORT_S, window_s / 4)
        self.sample_s = min(SAMPLE_S, self.report_s / 5)
        self.thread_id = threading.main_thread().ident if thread_id == -1 else thread_id
        self._stop = threading.Event()
        self._cache: Dict[Any, bool] = {}
        self._busy = self._samples = 0
        self._counters: Dict[str, float] = {}
        self._next_source = 0.0
        self.thread: Optional[threading.Thread] = None

    def start(self) -> "SubhealthSampler":
        self.thread = threading.Thread(target=self._run, name=f"mindspeed-ha-subhealth-{self.rank}", daemon=True)
        self.thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        t = self.thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        if self.source is not None:
            self.source.close()

    def sample(self) -> None:
        """One look at the training thread's stack."""
        if self.thread_id is None:
            return
        frame = sys._current_frames().get(self.thread_id)
        if frame is None:
            return
        self._samples += 1
        if not waiting(frame, self._cache):
            self._busy += 1

    def report(self, now: float) -> Any:
        """The HEALTH since the last one (and reset the counts)."""
        from mindspeed_ha.control.wire import Health

        if self.source is not None and now >= self._next_source:
            try:
                self._counters = self.source.read()
            except Exception as exc:  # noqa: BLE001 - a sampler never ends the rank
                log.warning("rank %d: sub-health source %s failed: %s", self.rank, self.source.name, exc)
                self._counters = {}
            self._next_source = now + (SLOW_SOURCE_S if self.source.slow else 0.0)
        busy = self._busy / self._samples if self._samples else -1.0
        body = Health(self.rank, int(self.iteration()), float(busy), int(self._samples), dict(self._counters))
        self._busy = self._samples = 0
        return body

    def _run(self) -> None:
        next_report = time.monotonic() + self.report_s
        try:
            while not self._stop.wait(self.sample_s):
                self.sample()
                now = time.monotonic()
                if now >= next_report:
                    self.send(self.report(now))
                    next_report = now + self.report_s
        except Exception:  # noqa: BLE001 - keep the reason, never crash silently
            log.exception("rank %d: sub-health sampler failed", self.rank)


__all__ = ["DeviceSource", "FakeSource", "NvmlSource", "NpuSmiSource", "SubhealthSampler", "select_source",
           "nvml_index", "parse_npu_smi", "waiting", "WAIT_FILES"]
