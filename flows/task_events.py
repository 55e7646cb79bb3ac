"""Prefect's events of the training flow's stage task runs, sent beside generation and training.

Prefect 3 records a task run only through events: each stage task run emits Pending, Running and
Completed, and Prefect's events worker sends each over a websocket as soon as it is emitted. Its
threads take Python's GIL for every event (serialising it, the websocket's framing and
compression), and between the step's long stages (the rollout's generation, the update's train
loop) the stages are short pure-Python work that waits each time: on the CPU the peer work's
logprob, reward and advantage stages took 6.5-8 ms alone and 8-12 ms beside the events.

With orchestration.task_events_hold_s > 0 the training flow's steps run inside
`paced_task_events`: Prefect's events worker is given the events client Prefect's own process-pool
task runner gives its subprocesses (ProcessPoolForwardingEventsClient, which puts each event on
a queue for the parent to send), and the queue is an EventPacer, which holds each event until the
step's rollout or update starts (`EventPacer.release`, called by flows.step.execute_stage) or it
has waited task_events_hold_s seconds, whichever is first, then sends the held events in order
with Prefect's websocket client (PrefectEventsClient, in the events worker's loop), beside the
generation or training. Nothing is dropped: leaving the context waits for what is still on its
way and sends what is held (at most 10 s: a server that stopped answering fails those sends as
it would unpaced, after Prefect's reconnection attempts and a warning). The Prefect UI and API show a task run's state up to
task_events_hold_s later (the local server's task run recorder writes states in batches once a
second already: flows/prefect_server.py).

Only for a self-hosted Prefect server (PREFECT_API_URL not Prefect Cloud's); elsewhere events go
out as Prefect sends them."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time

from prefect.events.clients import PrefectEventsClient
from prefect.events.worker import (EventsWorker, ProcessPoolForwardingEventsClient, emit_events_to_cloud,
                                   should_emit_events_to_running_server)
from prefect.settings import PREFECT_API_URL

log = logging.getLogger("stagerl.task_events")


class EventPacer:
    """The queue the forwarding events client puts events on (`put`, in the loop of Prefect's
    events worker): held until `release()` (any thread) or until the oldest has waited hold_s
    seconds, then sent in the order they came by the pacer's own websocket client (Prefect's
    PrefectEventsClient, entered in that loop on the first send)."""

    def __init__(self, hold_s: float, api_url: str):
        self.hold_s = float(hold_s)
        self.api_url = api_url
        self.held: list = []
        self.sent = 0  # events released to the client, over the pacer's life
        self.closed = False
        self._lock = threading.Lock()
        self._clock = None  # the pending hold's token (its timer runs in the events worker's loop)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: PrefectEventsClient | None = None
        self._sending = asyncio.Lock()  # bound to the events worker's loop on first use

    def put(self, item) -> None:
        """ProcessPoolForwardingEventsClient's call, (item type, event), in Prefect's events
        worker's event loop: hold the event; the first one held starts the hold's clock."""
        _, event = item
        with self._lock:
            self.held.append(event)
            self._loop = self._loop or asyncio.get_running_loop()
            if self._clock is None and not self.closed:
                self._clock = clock = object()
                self._loop.call_later(self.hold_s, self._due, clock)
        if self.closed:
            self.release()

    def _due(self, clock) -> None:
        if clock is self._clock:  # not released since this hold began
            self.release()

    def release(self) -> concurrent.futures.Future | None:
        """Start sending every held event (from any thread, without waiting); the future of
        that send, or None when nothing was held."""
        with self._lock:
            events, self.held, self._clock = self.held, [], None
            if not events or self._loop is None or self._loop.is_closed():
                return None
            self.sent += len(events)
            return asyncio.run_coroutine_threadsafe(self._send(events), self._loop)

    async def _send(self, events: list) -> None:
        async with self._sending:  # one batch after the other, each in order
            try:
                if self._client is None:
                    client = PrefectEventsClient(api_url=self.api_url)
                    await client.__aenter__()
                    self._client = client
                for event in events:
                    await self._client.emit(event)
            except Exception as exc:  # noqa: BLE001 - Prefect's client warned of its connection
                log.warning("%d Prefect events not sent: %s: %s", len(events), type(exc).__name__, exc)

    def close(self, forwarding=None, timeout_s: float = 10.0) -> None:
        """Pass every later event straight on, wait until `forwarding` (the events worker that
        puts events here) has handed over what it had, send what is held, and close the client:
        at most timeout_s in all (a server that stopped answering: what is left is dropped)."""
        deadline = time.monotonic() + timeout_s
        self.closed = True
        if forwarding is not None:
            waiter = threading.Thread(target=forwarding.wait_until_empty, daemon=True)
            waiter.start()
            waiter.join(timeout_s)
        sends = [self.release()]
        if self._loop is not None and not self._loop.is_closed():
            sends.append(asyncio.run_coroutine_threadsafe(self._close_client(), self._loop))
        for send in filter(None, sends):
            try:
                send.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - never hide the run's own outcome
                log.warning("Prefect events of the run's last stages not sent: %s", type(exc).__name__)

    async def _close_client(self) -> None:
        async with self._sending:  # after the sends before it
            if self._client is not None:
                client, self._client = self._client, None
                await client.__aexit__(None, None, None)


@contextlib.contextmanager
def paced_task_events(cfg: dict):
    """Within: the events this process emits are held by an EventPacer (yielded), when
    orchestration.task_events_hold_s > 0 and the API is a self-hosted server; else yields None
    and changes nothing. On exit the held events are handed to Prefect's events worker."""
    hold_s = float((cfg.get("orchestration") or {}).get("task_events_hold_s") or 0.0)
    if hold_s <= 0 or emit_events_to_cloud() or not should_emit_events_to_running_server():
        yield None
        return
    pacer = EventPacer(hold_s, PREFECT_API_URL.value())
    before = EventsWorker._client_override
    EventsWorker.set_client_override(ProcessPoolForwardingEventsClient, event_queue=pacer, item_type="event")
    try:
        yield pacer
    finally:
        try:
            pacer.close(EventsWorker.instance())  # the forwarding worker (started if none was)
        finally:
            EventsWorker._client_override = before
