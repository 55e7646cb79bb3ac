"""Prefect's events of the training flow's stage task runs, sent beside generation and training.

Prefect 3 records a task run only through events: each stage task run emits Pending, Running and
Completed. Prefect's events worker takes each one as it is emitted: its threads attach the run's
related resources to it (flow run, flow, tags) and send it over a websocket, taking Python's GIL
every time. Between the step's long computes (the rollout's generation, the update's train loop)
the stages are short pure-Python work that waits each time: on the CPU the peer work's logprob,
reward and advantage stages took 6.5-8 ms alone and 8-12 ms beside the events, and the worker's
threads took 4-5 ms of the GIL there a step even with the websocket's sends held back.

With orchestration.task_events_hold_s > 0 the training flow's steps run inside
`paced_task_events`: an EventPacer takes the place of Prefect's events worker's `send` (on the
worker's one instance, while the context lasts) and holds each event, with the context it was
emitted in, until a stage starts a long compute (`RunSession.compute_starts`: the generation, the
train loop, a rank job; `EventPacer.release`, registered with `RunSession.on_compute`) or the
oldest has waited task_events_hold_s seconds, whichever is first; then it hands them to the worker
in order, each in its own context, so the worker attaches what it always attaches and sends them
beside the compute. Nothing is dropped: leaving the context hands over what is held and waits
(at most 10 s) until the worker has sent it. The Prefect UI and API show a task run's state up
to task_events_hold_s later (the local server's task run recorder writes states in batches once a
second already: flows/prefect_server.py).

Only for a self-hosted Prefect server (PREFECT_API_URL not Prefect Cloud's); elsewhere events go
out as Prefect sends them."""
from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time

from prefect.events.worker import EventsWorker, emit_events_to_cloud, should_emit_events_to_running_server

log = logging.getLogger("stagerl.task_events")


class EventPacer:
    """Holds the events given to Prefect's events worker (`put`, in place of the worker's `send`,
    from any thread) until `release()` or until the oldest has waited hold_s seconds (its clock
    thread looks four times per hold_s), then hands them to the worker's own `send` in the order
    they came, each in the context it was emitted in."""

    def __init__(self, hold_s: float, worker):
        self.hold_s = float(hold_s)
        self.worker = worker
        self.held: list = []  # (context, event)
        self.sent = 0  # events handed to the worker, over the pacer's life
        self.closed = False
        self.by_session = False  # released by a RunSession's compute_starts (paced_task_events)
        self._send = worker.send  # the worker's own
        self._since = 0.0  # when the oldest held event came (time.monotonic)
        self._lock = threading.Lock()  # the held list
        self._order = threading.Lock()  # one release after the other: the events stay in order
        self._stop = threading.Event()
        self._clock = threading.Thread(target=self._tick, name="task-events-clock", daemon=True)

    def start(self) -> "EventPacer":
        self.worker.send = self.put
        self._clock.start()
        return self

    def put(self, event) -> None:
        context = contextvars.copy_context()  # the task run's: the worker attaches its resources
        with self._lock:
            if not self.closed:
                if not self.held:
                    self._since = time.monotonic()
                self.held.append((context, event))
                return
        context.run(self._send, event)

    def _tick(self) -> None:
        while not self._stop.wait(self.hold_s / 4):
            with self._lock:
                due = bool(self.held) and time.monotonic() - self._since >= self.hold_s
            if due:
                self.release()

    def release(self) -> int:
        """Hand every held event to the worker (from any thread, without waiting for their
        sending); how many there were."""
        with self._order:
            with self._lock:
                held, self.held = self.held, []
                self.sent += len(held)
            for context, event in held:
                try:
                    context.run(self._send, event)
                except RuntimeError:  # the worker stopped: Prefect's current one takes it
                    context.run(EventsWorker.instance().send, event)
        return len(held)

    def close(self, timeout_s: float = 10.0) -> None:
        """Pass later events straight on, hand over what is held, give the worker its own send
        back and wait until it has sent everything (at most timeout_s: a server that stopped
        answering: what is left is sent or dropped by Prefect's worker as it would unpaced)."""
        with self._lock:
            self.closed = True
        self._stop.set()
        self.release()
        if self.worker.__dict__.get("send") == self.put:
            del self.worker.send
        waiter = threading.Thread(target=self.worker.wait_until_empty, daemon=True)
        waiter.start()
        waiter.join(timeout_s)
        if waiter.is_alive():
            log.warning("Prefect events of the run's last stages not sent within %.0f s", timeout_s)


@contextlib.contextmanager
def paced_task_events(cfg: dict, session=None):
    """Within: the events this process emits are held by an EventPacer (yielded; released when
    `session`'s stages start a long compute: RunSession.on_compute; without a session, by the
    caller: flows.step.execute_stage where a rollout or update starts), when
    orchestration.task_events_hold_s > 0 and the API is a self-hosted server; else yields None
    and changes nothing. On exit the held events are handed to Prefect's events worker and sent."""
    hold_s = float((cfg.get("orchestration") or {}).get("task_events_hold_s") or 0.0)
    if hold_s <= 0 or emit_events_to_cloud() or not should_emit_events_to_running_server():
        yield None
        return
    pacer = EventPacer(hold_s, EventsWorker.instance()).start()
    if session is not None:
        session.on_compute(ON_COMPUTE, pacer.release)
        pacer.by_session = True
    try:
        yield pacer
    finally:
        if session is not None:
            session.on_compute(ON_COMPUTE, None)
        pacer.close()


ON_COMPUTE = "flows.task_events: release"
