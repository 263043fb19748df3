"""The controller's read-only HTTP port (``--ha-metrics-port``): metrics, probes, status.

=============  =====================================================================
``/metrics``   Prometheus text exposition of the job's registry (:mod:`.metrics`)
``/healthz``   200 while the controller's I/O thread runs (Kubernetes liveness)
``/readyz``    200 when every rank registered and the job runs, else 503 (readiness)
``/status``    the snapshot as JSON (:mod:`.snapshot`)
``/``          a small HTML page of the same (ranks, step per rank, heartbeat ages, events)
=============  =====================================================================

Nothing here changes the job: GET and HEAD only (any other method: 405); the verbs that
act (pause, resume, stop) go through the authenticated CLI. Binds ``127.0.0.1`` unless
``--ha-metrics-addr`` says otherwise. One thread serves (``serve_forever``), requests are
handled in short-lived daemon threads; :meth:`StatusServer.stop` shuts both down and closes
the port (the controller's ``stop()`` calls it).
"""

from __future__ import annotations

import html
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mindspeed_ha.errors import ConfigError

log = logging.getLogger(__name__)

Status = Callable[[], Dict[str, Any]]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: str, port: int, app: "StatusServer"):
        self.address_family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
        self.app = app
        super().__init__((addr, port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "mindspeed-ha"

    def log_message(self, fmt: str, *args: Any) -> None:  # the access log goes to debug, not stderr
        log.debug("http %s: " + fmt, self.address_string(), *args)

    def do_HEAD(self) -> None:
        self.do_GET(head=True)

    def do_GET(self, head: bool = False) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0]
        try:
            code, ctype, body = app.route(path)
        except Exception as exc:  # noqa: BLE001 - a broken page must not end the server thread
            log.exception("http %s failed", path)
            code, ctype, body = 500, "text/plain; charset=utf-8", f"error: {type(exc).__name__}\n".encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _refuse(self) -> None:
        self.send_response(405)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse


class StatusServer:
    """The HTTP port of one controller.

    Args:
        addr, port: where to bind (``--ha-metrics-addr``, ``--ha-metrics-port``; 0: any free port).
        registry: the job's metrics registry.
        status: returns the controller's snapshot (thread-safe; ``up``: its I/O thread runs).
    """

    def __init__(self, addr: str, port: int, registry: CollectorRegistry, status: Status):
        self.addr, self.registry, self.status = addr, registry, status
        self._port = port
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        """The bound port (the chosen one when asked for 0)."""
        return self._server.server_address[1] if self._server is not None else self._port

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}"

    def start(self) -> "StatusServer":
        """Bind and serve. Raises ConfigError naming the flags when the port cannot be bound."""
        try:
            self._server = _Server(self.addr, self._port, self)
        except OSError as exc:
            raise ConfigError(f"--ha-metrics-port={self._port} / --ha-metrics-addr={self.addr}: cannot bind: "
                              f"{exc}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="mindspeed-ha-http", daemon=True)
        self._thread.start()
        log.info("controller: metrics and status on %s (/metrics /healthz /readyz /status)", self.url)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the port (idempotent)."""
        server, self._server = self._server, None
        thread, self._thread = self._thread, None
        if server is None:
            return
        if thread is not None:
            server.shutdown()  # returns once serve_forever did
            thread.join(timeout)
        server.server_close()

    def route(self, path: str):
        """``(HTTP code, content type, body)`` of GET ``path``."""
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == "/healthz":
            up = bool(self.status().get("up"))
            return (200 if up else 503), "text/plain; charset=utf-8", b"ok\n" if up else b"controller stopped\n"
        if path == "/readyz":
            s = self.status()
            ok = s["ready"]
            why = "ready" if ok else (f"phase {s['phase']}, {s['registered']}/{s['world_size']} registered, "
                                      f"ranks {s['ranks_by_state']}")
            return (200 if ok else 503), "text/plain; charset=utf-8", (why + "\n").encode()
        if path == "/status":
            return 200, "application/json", (json.dumps(self.status(), indent=1) + "\n").encode()
        if path in ("/", "/index.html"):
            return 200, "text/html; charset=utf-8", page(self.status()).encode()
        return 404, "text/plain; charset=utf-8", b"not found: /metrics /healthz /readyz /status /\n"


def _subhealth(s: Dict[str, Any], e: Any) -> str:
    """The sub-health line of the page (``--ha-subhealth``; empty when off)."""
    sub = s.get("subhealth")
    if not sub:
        return ""
    flagged = ", ".join(f"rank {f['rank']} {f['signal']} x{f['score']}" for f in sub["flagged"]) or "none"
    return f"<p>sub-health: {e(sub['windows'])} windows of {e(sub['window_s'])} s; flagged: {e(flagged)}</p>"


def page(s: Dict[str, Any]) -> str:
    """The HTML status page of snapshot ``s`` (every value escaped; refreshes every 5 s)."""
    e = lambda v: html.escape("" if v is None else str(v))  # noqa: E731
    rows = "".join(
        f"<tr><td>{e(r['rank'])}</td><td>{e(r['state'])}</td><td>{e(r.get('iteration'))}</td>"
        f"<td>{e(r.get('step'))}</td><td>{e(r.get('heartbeat_age_s'))}</td><td>{e(r.get('step_seconds'))}</td>"
        f"<td>{e(r.get('host'))}</td><td>{e(r.get('pid'))}</td></tr>" for r in s["ranks"])
    recs = "".join(
        f"<tr><td>{e(r['iteration'])}</td><td>{e(r['kind'])}</td><td>{e(r['mode'])}</td><td>{e(r['rank'])}</td>"
        f"<td>{e(json.dumps(r['phase_seconds']))}</td></tr>" for r in reversed(s["recoveries"]))
    events = "".join(
        f"<tr><td>{e(v['ts'])}</td><td>{e(v['type'])}</td><td>{e(v['severity'])}</td><td>{e(v['ranks'])}</td>"
        f"<td>{e(v['iteration'])}</td><td>{e(v['reason'])}</td></tr>" for v in reversed(s["events"]))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='5'>"
        f"<title>mindspeed-ha job {e(s['job'])}</title><style>body{{font-family:sans-serif}}"
        "td,th{padding:2px 8px;text-align:left}</style></head><body>"
        f"<h1>mindspeed-ha job {e(s['job'])}</h1><p>phase <b>{e(s['phase'])}</b>, iteration {e(s['iteration'])}, "
        f"term {e(s['term'])}, {e(s['registered'])}/{e(s['world_size'])} ranks registered, "
        f"ready {e(s['ready'])}, ranks by state {e(s['ranks_by_state'])}</p>{_subhealth(s, e)}"
        "<h2>Ranks</h2><table><tr><th>rank</th><th>state</th><th>iteration</th><th>step</th>"
        f"<th>heartbeat age (s)</th><th>step time (s)</th><th>host</th><th>pid</th></tr>{rows}</table>"
        "<h2>Recoveries</h2><table><tr><th>iteration</th><th>kind</th><th>mode</th><th>rank</th>"
        f"<th>phase seconds</th></tr>{recs}</table>"
        "<h2>Last events</h2><table><tr><th>time</th><th>type</th><th>severity</th><th>ranks</th>"
        f"<th>iteration</th><th>reason</th></tr>{events}</table>"
        "<p>Read-only. <a href='/status'>/status</a> <a href='/metrics'>/metrics</a></p></body></html>")
