"""What a training run keeps alive between its steps, passed to every stage as `ctx.session`.

A stage never needs a session: without one (a one-off stage run, a stage deployment on another
machine, most tests) it starts what it needs and stops it again. With one, the expensive things
start once per run:

- `engines()`: the rollout replicas' engines (stages.engines.service.RolloutEngines, resident);
- `scorers(spec, num_workers, timeout_s)`: the reward scorer processes (stages.scorer_pool);
- `memo(key, make)`: small things derived from immutable inputs (a tokenizer by its files'
  checksum, ...), made once per run.

The training flow (flows/train.py) makes one session per run and closes it when the run ends,
also when it fails. A session holds processes, so it is never written to the store or sent to a
rank: StageContext.to_json leaves it out."""
from __future__ import annotations


class RunSession:
    def __init__(self, log_dir=None):
        self.log_dir = log_dir
        self._engines = None
        self._memo: dict = {}
        self.closed = False

    def engines(self):
        """The run's resident rollout engines (started on first use)."""
        if self.closed:
            raise RuntimeError("this run's session is closed")
        if self._engines is None:
            from stages.engines.service import RolloutEngines

            self._engines = RolloutEngines(resident=True, log_dir=self.log_dir)
        return self._engines

    def scorers(self, spec: dict, num_workers: int, timeout_s: float):
        """The run's resident reward scorer pool (stages.scorer_pool) for these settings; a pool
        made for other settings is closed and replaced."""
        from stages.scorer_pool import ScorerPool

        pool = self._memo.get("scorers")
        if pool is not None and pool.matches(spec, num_workers, timeout_s):
            pool.close()
            pool = None
        if pool is None:
            pool = self._memo["scorers"] = ScorerPool(spec, num_workers, timeout_s)
        return pool

    def memo(self, key, make):
        """make() once per run for `key` (a key must name the inputs' content, not a path)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def close(self) -> None:
        """Stop every process the session started (idempotent)."""
        self.closed = True
        if self._engines is not None:
            self._engines.close()
            self._engines = None
        for value in self._memo.values():
            if hasattr(value, "close"):
                value.close()
        self._memo.clear()

    def __enter__(self) -> "RunSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
