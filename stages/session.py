"""What a training run keeps alive between its steps, passed to every stage as `ctx.session`.

A stage never needs a session: without one (a one-off stage run, a stage deployment on another
machine, most tests) it starts what it needs and stops it again. With one, the expensive things
start once per run:

- `engines()`: the rollout replicas' engines (stages.engines.service.RolloutEngines, resident);
- `scorers(spec, num_workers, timeout_s)`: the reward scorer processes (stages.scoring.pool);
- `tools(tool_config_path, num_workers, timeout_s)`: the multi-turn tool workers (stages.tools);
- `defer(...)` / `wait_commits()`: a stage's commit (uploads, then its manifest) in a background
  thread, overlapping the next stage (the update's, with the next step's rollout);
- `compute_starts()`: called by a stage right before a long compute (the rollout's generation,
  the update's train loop, a rank job it waits for): starts the background work held for that
  moment (`defer(..., at_compute=True)`, `start_background(..., at_compute=True)`) and calls the
  functions given to `on_compute` (the training flow's: send the held Prefect events). Between
  those computes the step runs short Python stages, which every other thread taking Python's
  GIL slows; beside a compute that work costs the step least;
- `memo(key, make)`: small things derived from immutable inputs (a tokenizer by its files'
  checksum, ...), made once per run; also what a stage keeps between its own calls (the update's
  DeepSpeed engines: stages.training.worker), released by `on_close`;
- `rank_pool`: the run's resident ranks (stages.ranks.pool), set by the training flow;
  stages.ranks.launch.run_ranks submits N-rank jobs to it instead of launching them;
- `spawner`: a fork server (stages.ranks.zygote) that imported torch, transformers and DeepSpeed once;
  the CPU rank pool and hf rollout workers are forked from it (set by the training flow).

A rank process of the pool has a session of its own (stages.ranks.server), so what a stage keeps
there lives as long as the pool.

The training flow (flows/train.py) makes one session per run and closes it when the run ends,
also when it fails. A session holds processes, so it is never written to the store or sent to a
rank: StageContext.to_json leaves it out."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor


class DeferredCommitError(RuntimeError):
    """A stage's background commit failed: the stage stays incomplete (a resume runs it again).
    `stage`, `step`: the commit; `cause`: its error in one line (type and message)."""

    def __init__(self, message: str, stage: str = "?", step: int | None = None, cause: str = ""):
        super().__init__(message)
        self.stage, self.step, self.cause = stage, step, cause


class RunSession:
    def __init__(self, log_dir=None, retries: int = 3, retry_delay_s: float = 2.0, retryable=None):
        self.log_dir = log_dir
        self._engines = None
        self._memo: dict = {}
        self._pending: dict = {}  # (stage, step) -> {"fingerprint", "thread", "error", "local_weights"}
        self.retries, self.retry_delay_s = int(retries), float(retry_delay_s)
        self.retryable = retryable or (lambda exc: False)
        self._on_close: dict = {}
        self._background: dict = {}  # name -> [its one-thread executor, its newest work's future]
        self._at_compute: dict = {}  # name -> fn called by compute_starts (on_compute)
        self._held: list = []  # what waits for compute_starts: (key, its start function), in order
        self._held_lock = threading.Lock()
        self.rank_pool = None  # stages.ranks.pool.RankPool of this run (not closed by the session)
        self.spawner = None  # stages.ranks.zygote.Zygote: CPU workers and ranks forked, not started (closed last)
        self.closed = False

    def on_close(self, name: str, fn) -> None:
        """Call fn() when the run ends (once per name): state a stage keeps in this process."""
        self._on_close.setdefault(name, fn)

    # ---- work beside the long computes ----------------------------------------------------------
    def on_compute(self, name: str, fn) -> None:
        """Call fn() (quick, from the stage's thread) each time a stage starts a long compute;
        None removes it."""
        if fn is None:
            self._at_compute.pop(name, None)
        else:
            self._at_compute[name] = fn

    def compute_starts(self) -> None:
        """A stage is about to generate, train, or wait for ranks that do: start the work held
        for this moment, then call the on_compute functions."""
        self._start_held()
        for fn in list(self._at_compute.values()):
            fn()

    def _hold(self, key, start) -> None:
        with self._held_lock:
            self._held.append((key, start))

    def _start_held(self, key=None) -> None:
        """Start held work, in the order it was given: all of it, or that under `key` (what a
        caller is about to wait for)."""
        with self._held_lock:
            starts = [start for k, start in self._held if key is None or k == key]
            self._held = [] if key is None else [(k, start) for k, start in self._held if k != key]
        for start in starts:
            start()

    def engines(self):
        """The run's resident rollout engines (started on first use)."""
        if self.closed:
            raise RuntimeError("this run's session is closed")
        if self._engines is None:
            from stages.engines.service import RolloutEngines

            self._engines = RolloutEngines(resident=True, log_dir=self.log_dir, spawner=self.spawner)
        return self._engines

    def scorers(self, spec: dict, num_workers: int, timeout_s: float):
        """The run's resident reward scorer pool (stages.scoring.pool) for these settings; a pool
        made for other settings is closed and replaced."""
        from stages.scoring.pool import ScorerPool

        pool = self._memo.get("scorers")
        if pool is not None and pool.matches(spec, num_workers, timeout_s):
            pool.close()
            pool = None
        if pool is None:
            pool = self._memo["scorers"] = ScorerPool(spec, num_workers, timeout_s)
        return pool

    def tools(self, tool_config_path: str, num_workers: int | None, timeout_s: float):
        """The run's tool workers (stages.tools.toolset.ToolSet, verl's agent-loop instances: one per
        call) for multi-turn rollouts, started on first use and kept for the run; other settings or
        a changed tool config file close it and start another."""
        import hashlib

        from stages.tools.toolset import ToolSet

        with open(tool_config_path, "rb") as f:
            key = (tool_config_path, hashlib.sha256(f.read()).hexdigest(), num_workers, float(timeout_s))
        held = self._memo.get("tools")
        if held is not None and held.key != key:
            held.close()
            held = None
        if held is None:
            held = self._memo["tools"] = ToolSet.from_config(tool_config_path, num_workers=num_workers,
                                                             timeout_s=timeout_s, instance_per="call")
            held.key = key
        return held

    # ---- background set-up ---------------------------------------------------------------------
    def start_background(self, name: str, fn, at_compute: bool = False) -> None:
        """Run `fn()` in the background now (set-up that may overlap what the run does next, e.g.
        the first update's DeepSpeed set-up at one rank while the first rollout samples in its
        engine's own process; the step loop's prune of old weights), after the earlier work of
        the same name; join_background waits for it. Each name has one thread for the run, started
        with its first work: starting a thread waits for it to take Python's GIL (1.5 ms a step
        for the prune beside the update's commit). With at_compute the work waits for the next
        compute_starts() (or a join_background of it). A failure is only printed: the work it did
        ahead is then done where it is needed."""
        def work():
            threading.current_thread().name = f"background-{name}"
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - see the docstring
                print(f"background {name} failed ({type(exc).__name__}: {exc}); its work is done when "
                      f"needed", flush=True)

        def submit():
            entry = self._background.get(name)
            if entry is None:
                entry = self._background[name] = [ThreadPoolExecutor(max_workers=1), None]
            entry[1] = entry[0].submit(work)

        if at_compute:  # when the next compute starts (compute_starts), or when it is waited for
            self._hold(("background", name), submit)
        else:
            self._start_held(("background", name))
            submit()

    def join_background(self, name: str | None = None) -> None:
        """Wait for the background work `name` (None: all of it) given so far."""
        held = {key[1] for key, _ in list(self._held) if key[0] == "background"}
        for key in [name] if name is not None else held | set(self._background):
            self._start_held(("background", key))
            entry = self._background.get(key)
            if entry is not None and threading.current_thread().name != f"background-{key}":
                entry[1].result()  # its executor ran the earlier ones first

    # ---- background commits -------------------------------------------------------------------
    def defer(self, stage: str, step: int, fingerprint: str, commit, local_weights=None,
              at_compute: bool = False) -> None:
        """Run `commit()` (uploads, then the stage's manifest) in a thread; storage errors the
        retry policy accepts are retried (retries, doubling delays). `local_weights`: a local
        folder holding the weights of `step` until they are in the store. at_compute: the thread
        starts at the next compute_starts() (or when the commit is waited for), not now."""
        entry = {"fingerprint": fingerprint, "error": None, "local_weights": local_weights}

        def work():
            delay = self.retry_delay_s
            for attempt in range(self.retries + 1):
                try:
                    commit()
                    return
                except BaseException as exc:  # noqa: BLE001 - kept for wait_commits to raise
                    if attempt < self.retries and self.retryable(exc):
                        print(f"{stage} of step {step}: commit failed ({type(exc).__name__}: {exc}); "
                              f"retrying in {delay:g} s", flush=True)
                        time.sleep(delay)
                        delay *= 2
                        continue
                    entry["error"] = exc
                    return

        entry["thread"] = threading.Thread(target=work, name=f"commit-{stage}-{step}", daemon=True)
        self._pending[(stage, step)] = entry
        if at_compute:
            self._hold(("commit", stage, step), entry["thread"].start)
        else:
            entry["thread"].start()

    def pending_fingerprint(self, step: int, stage: str) -> str | None:
        """The fingerprint a stage is committing in the background (None: nothing pending)."""
        entry = self._pending.get((stage, step))
        return entry["fingerprint"] if entry and entry["error"] is None else None

    def local_weights(self, step: int):
        """A local folder with step's exported weights while their commit is pending, else None."""
        for (stage, k), entry in self._pending.items():
            if k == step and entry.get("local_weights") is not None and entry["error"] is None:
                return entry["local_weights"]
        return None

    def wait_commit(self, stage: str, step: int) -> None:
        """Wait for one background commit (a rollout for the update it sampled from, while a later
        update may be training: trainer.staleness); raise DeferredCommitError when it failed."""
        entry = self._pending.get((stage, step))
        if entry is None:
            return
        self._start_held(("commit", stage, step))
        entry["thread"].join()
        if entry["error"] is not None:
            self.wait_commits()  # raises, naming it (and leaves nothing pending)
        self._pending.pop((stage, step), None)  # committed: readers now find the version in the store

    def wait_commits(self) -> None:
        """Wait for every background commit; raise DeferredCommitError for a failed one."""
        failed = []
        for key, entry in list(self._pending.items()):
            self._start_held(("commit", *key))
            entry["thread"].join()
            self._pending.pop(key, None)
            if entry["error"] is not None:
                failed.append((key, entry["error"]))
        if failed:
            (stage, step), exc = failed[0]
            cause = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"  # one line
            raise DeferredCommitError(f"the {stage} stage of step {step} trained but could not be "
                                      f"committed to the store ({cause}); it stays "
                                      f"incomplete and a resume runs it again",
                                      stage=stage, step=step, cause=cause) from exc

    def commit_error(self) -> DeferredCommitError | None:
        """wait_commits()'s error instead of raising it (None: every commit is in the store). A
        run that fails asks this first: a commit that failed in the background is its root cause
        when the store then refused what the run wrote next (a full disk: the lock's refresh)."""
        try:
            self.wait_commits()
        except DeferredCommitError as exc:
            return exc
        return None

    def memo(self, key, make):
        """make() once per run for `key` (a key must name the inputs' content, not a path)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def close(self) -> None:
        """Stop every process the session started (idempotent)."""
        self.closed = True
        self.join_background()
        for executor, _ in self._background.values():
            executor.shutdown()
        self._background.clear()
        try:
            self.wait_commits()  # never leave a trained step uncommitted when avoidable
        except DeferredCommitError as exc:
            print(f"warning: {exc}", flush=True)
        if self._engines is not None:
            self._engines.close()
            self._engines = None
        for value in self._memo.values():
            if hasattr(value, "close"):
                value.close()
        self._memo.clear()
        for fn in self._on_close.values():
            fn()
        self._on_close.clear()
        if self.spawner is not None:
            self.spawner.close()
            self.spawner = None

    def __enter__(self) -> "RunSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
