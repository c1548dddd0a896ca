"""The engine loop: one thread drives rounds (:func:`batchspec.engine.schedulers.drive.drive`, the
driver ``batchspec.generate`` uses) over the requests that arrive.

Between two rounds the loop hands new requests to the scheduler, which admits them while it has room (their
prompt is read apart, in chunks while other rows decode), and retires rows whose client left. After a round
every row's new text is decoded and pushed to its handler; rows that met EOS, their budget or a stop string
leave at once, and their KV is released. An exception in a round fails the requests of that round only.

``batchspec serve`` drives the rounds on the thread that loaded the models (its main thread, :meth:`EngineLoop.drive`;
HTTP runs beside it): torch's OpenMP runtime (libgomp) keeps a pool of workers for each thread that runs parallel
work, and once two pools hold more threads than the host has CPUs it stops its workers spinning between kernels, so
every step pays their wake-ups: on 2 vCPUs a round of another thread than the loader's took 69 ms where the loader's
took 52 (the 1.5B target at B = 1, int8); ``bench --online`` does the same. Servers in a background thread (tests)
drive them on a thread of the loop's own (:meth:`EngineLoop.start`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchspec.engine import FINISH_LENGTH, Engine, Scheduler, Sequence, drive
from batchspec.server.events import Failed, Finished, RequestHandle, Tokens
from batchspec.server.prometheus import ServerMetrics
from batchspec.server.text import TextTracker

logger = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"
RETRY_AFTER_S = 1


class QueueFull(Exception):
    """The admission queue holds ``max_queue`` requests already; retry after ``retry_after`` seconds."""

    def __init__(self, max_queue: int) -> None:
        super().__init__(f"the server is busy: {max_queue} requests are already waiting; retry later")
        self.retry_after = RETRY_AFTER_S


class ServerClosing(Exception):
    """The loop is draining for shutdown and admits no new requests."""


@dataclass
class Job:
    """One choice of a request inside the loop: its handle, the choice's index, its row and its text so far."""

    handle: RequestHandle
    choice: int
    row: Sequence
    text: TextTracker
    sent_tokens: int = 0
    sent_prompt_logprobs: bool = False


@dataclass(frozen=True)
class LoopStatus:
    """A snapshot: requests waiting for admission, rows admitted, and whether the thread runs."""

    queued: int
    running: int
    alive: bool


class EngineLoop:
    """Continuous admission around one :class:`~batchspec.engine.core.Engine`, driven by one thread: the caller of
    :meth:`drive`, or a thread of its own from :meth:`start`."""

    def __init__(
        self, engine: Engine, scheduler: Scheduler, tokenizer, *, max_queue: int, metrics: ServerMetrics
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0; got {max_queue}")
        self.engine = engine
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.metrics = metrics
        self._inbox: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}
        self._running = 0
        self._queued = 0
        self._round_started = time.perf_counter()
        self._cond = threading.Condition()
        self._stopping = False
        self._ids = itertools.count()
        self._claimed = False  # a thread drives the rounds, or did: see _claim
        self._done = threading.Event()

    def start(self) -> None:
        """Drive the rounds on a thread of the loop's own, unless a thread drives them already (:meth:`drive`)."""
        if self._claim():
            threading.Thread(target=self._drive, name="batchspec-engine", daemon=True).start()

    def drive(self, started: Callable[[], None]) -> None:
        """Drive the rounds on the calling thread until :meth:`stop`; ``started`` runs once the loop takes requests
        (it starts what sends them)."""
        if not self._claim():
            raise RuntimeError("the engine loop is driven already")
        started()
        self._drive()

    def stop(self, timeout: float | None = None) -> None:
        """Admit nothing new, finish every admitted and queued request, then stop driving (waits up to ``timeout``
        seconds for that)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            claimed = self._claimed
        if claimed:
            self._done.wait(timeout)

    def status(self) -> LoopStatus:
        return LoopStatus(queued=len(self._inbox) + self._queued, running=self._running, alive=self._alive)

    @property
    def _alive(self) -> bool:
        """Whether a thread drives the rounds now: claimed, and not done."""
        return self._claimed and not self._done.is_set()

    def submit(self, handle: RequestHandle) -> None:
        """Queue ``handle``'s request, one row per choice (each counts against ``max_queue``); raises
        :class:`QueueFull` or :class:`ServerClosing`."""
        params = handle.params
        jobs = [
            Job(handle, choice, params.sequence(next(self._ids), seed), TextTracker(self.tokenizer, params.stop))
            for choice, seed in enumerate(params.row_seeds())
        ]
        with self._cond:
            if self._stopping or not self._alive:
                raise ServerClosing("the server is shutting down")
            free = self.scheduler.capacity - self._running
            if len(self._inbox) + self._queued + len(jobs) - free > self.max_queue:
                raise QueueFull(self.max_queue)
            self._inbox.extend(jobs)
            self._cond.notify()

    def _claim(self) -> bool:
        """Whether the caller is the loop's one driver (the first to ask); from then on it takes requests."""
        with self._cond:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def _drive(self) -> None:
        try:
            with torch.inference_mode():
                drive(self.engine, self.scheduler, self)
        finally:
            self._done.set()
            logger.info("engine loop stopped")

    def admit(self, scheduler: Scheduler) -> bool:
        """Before every round: wait for work, hand new requests to the scheduler and retire cancelled rows; False
        once drained for shutdown."""
        with self._cond:
            while not self._inbox and not self._jobs and not self._stopping:
                self._cond.wait()
            if self._stopping and not self._inbox and not self._jobs:
                return False
            newcomers = list(self._inbox)
            self._inbox.clear()
        for job in newcomers:
            if job.handle.cancelled:
                self.metrics.cancelled.inc()
                continue
            self._jobs[job.row.index] = job
            scheduler.add(job.row)
        self._drop_cancelled()
        self._count()
        self._round_started = time.perf_counter()
        return True

    def ran(self, rows: list[Sequence], finished: list[Sequence]) -> None:
        """Push every row's new text; rows that met a stop string just now leave the scheduler too (before any
        client hears that its request is done)."""
        seconds = time.perf_counter() - self._round_started
        outbox: list[tuple[Job, list[Tokens | Finished]]] = []
        for row in rows:
            job = self._jobs.get(row.index)
            if job is None:
                continue
            try:
                outbox.append((job, self._advance(job)))
            except Exception as error:
                self.failed([row], error)
        left = {id(row) for row in finished}
        stopped = [row for row in rows if row.finished and id(row) not in left]
        if stopped:
            self.scheduler.remove(stopped)
        self._count()
        for job, events in outbox:
            for event in events:
                job.handle.push(event)
        self.metrics.observe_round(len(rows), self.engine.config.batch_size, seconds)

    def failed(self, rows: list[Sequence], error: Exception) -> None:
        logger.error("round over %d rows failed; failing those requests", len(rows), exc_info=error)
        self._fail(rows, f"generation failed: {type(error).__name__}: {error}")

    def _count(self) -> None:
        self._running = self.scheduler.running
        self._queued = self.scheduler.waiting

    def _drop_cancelled(self) -> None:
        gone = [job for job in self._jobs.values() if job.handle.cancelled]
        for job in gone:
            job.row.retire(FINISH_ABORT)
            del self._jobs[job.row.index]
            logger.info("request %s cancelled by its client; row released", job.handle.request_id)
        if gone:
            self.scheduler.remove([job.row for job in gone])
            self.metrics.cancelled.inc(len(gone))

    def _advance(self, job: Job) -> list[Tokens | Finished]:
        """The row's new text, and the end of the request when the row finished or met a stop string."""
        row = job.row
        update = job.text.update(row.output, final=row.finished)
        if update.stopped:
            row.retire(FINISH_STOP)
        end = update.stop_tokens if update.stopped else len(row.output)
        new_tokens = row.output[job.sent_tokens : end]
        job.sent_tokens = end
        events: list[Tokens | Finished] = []
        prompt_logprobs = None if job.sent_prompt_logprobs else row.prompt_token_logprobs
        job.sent_prompt_logprobs = True
        if update.delta or new_tokens or prompt_logprobs is not None:
            logprobs = None if row.logprobs is None else row.token_logprobs[end - len(new_tokens) : end]
            events.append(Tokens(update.delta, new_tokens, logprobs, job.choice, prompt_logprobs))
        if row.finished:
            reason = FINISH_LENGTH if row.finish_reason == FINISH_LENGTH else FINISH_STOP
            events.append(Finished(reason, len(row.prompt), row.output[:end], job.choice, row.cached_tokens))
            del self._jobs[row.index]
        return events

    def _fail(self, rows: list[Sequence], message: str) -> None:
        for row in rows:
            job = self._jobs.pop(row.index, None)
            if job is not None:
                job.handle.push(Failed(message))
                self.metrics.failed.inc()
            row.retire(FINISH_ERROR)
