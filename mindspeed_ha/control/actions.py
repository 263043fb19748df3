"""The rank's action thread and its handler registry.

The controller's ACTIONs arrive on the I/O thread and are queued here; one daemon thread
runs them in order, so a long save never delays heartbeats:

* EXIT: ``on_exit(code, reason, action)`` (the processor closes, then its exit handler
  ends the process);
* RETRY: delivered to the training thread (it waits in ``report_fault``); it answers the
  result itself once recovered (``Processor.action_result``);
* every other kind: the handler registered for it, ``handler(params) -> (ok, detail)``;
  an exception is a failed result, not a crash. ``on_done(action, ok, detail)`` sends
  the result.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable, Deque, Dict, Optional, Tuple, Union

from mindspeed_ha.control import wire
from mindspeed_ha.control.policy import ActionKind
from mindspeed_ha.faults import describe

#: the processor's logger: every line of the rank's control plane keeps the name operators and tests filter on
log = logging.getLogger("mindspeed_ha.control.processor")

Handler = Callable[[Dict[str, Any]], Tuple[bool, str]]

#: actions whose arrival is delivered to the main thread (report_fault / begin_update)
MAIN_THREAD_KINDS = frozenset({ActionKind.RETRY.value, ActionKind.EXIT.value})


class ActionRunner:
    """The handlers of one rank and the thread that runs the controller's actions.

    Args:
        rank: global rank (log lines, results).
        on_exit: ``on_exit(code, reason, action)`` for EXIT (action thread; code 1 and
            reason "" when the action names none).
        on_done: ``on_done(action, ok, detail)`` after every other action (action thread).
    """

    def __init__(self, rank: int, on_exit: Callable[[int, str, wire.Action], None],
                 on_done: Callable[[wire.Action, bool, str], None]):
        self.rank = rank
        self._on_exit, self._on_done = on_exit, on_done
        self._handlers: Dict[str, Handler] = {}
        self._queue: Deque[Optional[wire.Action]] = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self.thread: Optional[threading.Thread] = None

    def register(self, kind: Union[str, ActionKind], handler: Handler) -> None:
        """``handler(params) -> (ok, detail)`` for ACTIONs of ``kind`` (ValueError: no such kind)."""
        with self._cv:
            self._handlers[ActionKind(kind).value] = handler

    def handler(self, kind: Union[str, ActionKind]) -> Optional[Handler]:
        with self._cv:
            return self._handlers.get(ActionKind(kind).value)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name=f"mindspeed-ha-action-{self.rank}", daemon=True)
        self.thread.start()

    def put(self, action: Optional[wire.Action]) -> None:
        """Queue ``action`` (None: end the thread after the actions queued before it)."""
        with self._cv:
            self._queue.append(action)
            self._cv.notify()

    def _run(self, action: wire.Action, handler: Optional[Handler]) -> Tuple[bool, str]:
        if handler is None and action.kind not in MAIN_THREAD_KINDS:
            return False, f"no handler for action {action.kind!r} on rank {self.rank}"
        if handler is None:
            return True, "delivered to the main thread"
        try:
            return handler(dict(action.params))
        except Exception as exc:  # noqa: BLE001 - a failed action is a result, not a crash
            log.exception("rank %d: action %s failed", self.rank, action.kind)
            return False, describe(exc)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                action = self._queue.popleft()
                handler = self._handlers.get(action.kind) if action is not None else None
            if action is None:
                return
            log.info("rank %d: action %s #%d", self.rank, action.kind, action.action_id)
            if action.kind == ActionKind.EXIT.value:
                self._on_exit(int(action.params.get("code", 1)), str(action.params.get("reason", "")), action)
                continue
            ok, detail = self._run(action, handler)
            self._on_done(action, ok, detail)
