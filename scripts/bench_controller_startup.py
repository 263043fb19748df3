#!/usr/bin/env python
"""Controller start-up: seconds from ``python -m mindspeed_ha.control.controller`` to a listening port.

Under plain torchrun global rank 0 starts the controller as its own process (runtime.py,
``_ensure_controller``); ranks register as soon as it listens. The controller imports no
torch (checked here too), so this is interpreter start + pyzmq + our control modules.
Prints min / median / max over ``--repeat`` starts.

    python scripts/bench_controller_startup.py [--repeat 5]
"""

from mindspeed_ha import env as ha_env
import argparse
import os
import socket
import statistics
import subprocess
import sys
import time


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _one() -> float:
    port = _free_port()
    env = dict(os.environ, **{ha_env.AUTH_KEY: os.urandom(32).hex()})
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mindspeed_ha.control.controller", "--world-size", "4",
                             "--port", str(port), "--bind", "127.0.0.1", "--registration-timeout", "5"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:  # a benchmark may poll: it measures, it does not synchronise a test
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return time.perf_counter() - start
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"controller exited with {proc.returncode} before listening")
                time.sleep(0.002)
    finally:
        proc.kill()
        proc.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ns = ap.parse_args()
    probe = subprocess.run([sys.executable, "-c", "import sys, mindspeed_ha.control.controller; "
                            "print('torch' in sys.modules)"], capture_output=True, text=True, check=True)
    seconds = sorted(_one() for _ in range(ns.repeat))
    print(f"{'starts':>6} {'min s':>7} {'median s':>9} {'max s':>7} {'imports torch':>14}")
    print(f"{ns.repeat:6d} {seconds[0]:7.3f} {statistics.median(seconds):9.3f} {seconds[-1]:7.3f} "
          f"{probe.stdout.strip():>14}")


if __name__ == "__main__":
    main()
