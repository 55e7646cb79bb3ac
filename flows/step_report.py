"""What a step shows: verl-style metrics and console line, and the Prefect artifacts of a step
(a markdown summary, a samples table and a link per stage parquet, keyed per experiment so they
version over steps), published off the step's critical path by the session's publisher
(background_publisher(session): one per session, used by flows.step.rl_step), at most one step
every orchestration.step_report_interval_s besides the run's first and last."""
from __future__ import annotations

from storage.artifacts import read_file, read_manifest
from storage.layout import STAGES, TURNS_FILE, RunLayout


class _BackgroundPublisher:
    """Publishes a step's artifacts off the critical path. submit() only records the step (and
    a copy of the caller's context, the rl-step flow run, so the artifacts attach to it); the
    next rl_step starts the publishing thread once its rollout is done, so the thread runs beside
    that step's later stages, not beside the rollout's generate (the stage that the thread's Python
    work and the server's CPU slow the most). Measured: publishing while Prefect creates the next
    subflow run stalled that creation by 1-2.5 s (both write to the server's database). wait()
    publishes what is pending and joins; the training flow calls it before it ends. A failed publish is logged as a warning: artifacts are a view,
    the store holds the data.

    Reports are rate-limited (orchestration.step_report_interval_s): the thread publishes the
    pending step when it is the session's first or starts at least that many seconds after the
    last one published; a pending step not yet due is replaced by the next one submitted, and
    wait() publishes what is pending whatever the time (the run's last step). Each report costs
    two API calls, the server's inserts and ~5 ms of this process's CPU beside the next step's
    stages (measured at the peer bench's ~1 s steps: ~8 ms of its time outside generate and
    train); a step of minutes is published every time."""

    def __init__(self):
        self.thread = None
        self.pending = None
        self.last_published = None  # time.monotonic() when the last report's thread started

    def submit(self, ctx, summaries: dict) -> None:
        """Record the step for publishing (replacing a pending one not yet started). Never waits
        for a publish still running: a slow or unreachable Prefect API (its client retries a
        call for about a minute) holds the reports back, not the steps; the newest step waits
        its turn and the ones between are not published."""
        import contextvars

        self.pending = (contextvars.copy_context(), ctx, summaries)

    def start(self, force: bool = False) -> None:
        """Start publishing what submit() recorded, in a thread, if it is due (or force) and no
        publish is still running."""
        import threading
        import time

        if self.pending is None or self.running():
            return
        context, ctx, summaries = self.pending
        interval = float(ctx.get("orchestration.step_report_interval_s") or 0.0)
        now = time.monotonic()
        if not (force or self.last_published is None or now - self.last_published >= interval):
            return
        self.pending, self.last_published = None, now
        self.thread = threading.Thread(target=context.run, args=(self._publish, ctx, summaries),
                                       name=f"publish-step-{ctx.step}", daemon=True)
        self.thread.start()

    @staticmethod
    def _publish(ctx, summaries: dict) -> None:
        try:
            publish_step(ctx, summaries)
        except Exception as exc:  # noqa: BLE001 - see the class docstring
            import logging

            from prefect import get_run_logger

            try:
                log = get_run_logger()
            except Exception:  # noqa: BLE001 - outside a flow run
                log = logging.getLogger("stagerl")
            log.warning(f"step {ctx.step}: Prefect artifacts not published ({type(exc).__name__}: {exc})")

    def running(self) -> bool:
        if self.thread is not None and not self.thread.is_alive():
            self.thread = None
        return self.thread is not None

    def join(self, timeout_s: float = 120.0) -> None:
        """Wait for a publishing thread still running (at most timeout_s)."""
        if self.thread is not None:
            self.thread.join(timeout_s)
            self.running()

    def wait(self, timeout_s: float = 120.0) -> None:
        """Publish what is pending, due or not, and wait for it."""
        self.join(timeout_s)
        self.start(force=True)
        self.join(timeout_s)


def background_publisher(session) -> _BackgroundPublisher:
    """The run's publisher (one per session); the session's close waits for what it holds."""
    publisher = session.memo("flows.step_report: publisher", _BackgroundPublisher)
    session.on_close("flows.step_report: publisher", publisher.wait)
    return publisher


# ---- what a step shows in Prefect ------------------------------------------------------------
def artifact_slug(layout: RunLayout) -> str:
    """Prefect artifact keys: lowercase letters, digits and dashes only."""
    import re

    slug = re.sub(r"[^a-z0-9]+", "-", f"{layout.project}-{layout.experiment}".lower())
    return slug.strip("-") or "run"


def step_metrics(ctx, summaries: dict | None = None) -> dict:
    """verl-style metrics of a finished step: each stage's manifest metrics, update/metrics.json
    scalars, and timing_s/{stage} for stages that ran now."""
    metrics: dict = {}
    committed = set()  # stages whose manifest was read: one committing in the background may land meanwhile
    for stage in STAGES:
        summary = (summaries or {}).get(stage)
        if summary and summary.get("committed"):  # its manifest's metrics, as its task returned them
            committed.add(stage)
            metrics.update(_scalars(summary.get("metrics") or {}))
            continue
        manifest = read_manifest(ctx.store, ctx.layout, ctx.step, stage) or {}
        if manifest:
            committed.add(stage)
        metrics.update(_scalars((manifest.get("extra") or {}).get("metrics") or {}))
    try:
        update = read_file(ctx.store, ctx.layout, ctx.step, "update", "update/metrics.json")
        metrics.update({k: v for k, v in update.items() if isinstance(v, (int, float))
                        and not isinstance(v, bool)})
    except Exception:
        pass
    for stage, summary in (summaries or {}).items():
        if stage not in STAGES:
            continue
        if summary and stage not in committed:  # committing in the background: what was stored wins
            for key, value in _scalars(summary.get("metrics") or {}).items():
                metrics.setdefault(key, value)
        if summary and summary.get("seconds") is not None:
            metrics[f"timing_s/{stage}"] = summary["seconds"]
    return metrics


def time_split(metrics: dict) -> dict:
    """Where a step's seconds went, from its metrics: the engine's generation, the update's train
    loop (reading its rows, forward, backward, optimizer), and everything else by part: the rest of
    the rollout and update stages, logprob, reward, advantage, and the orchestration (Prefect task
    runs, checks, metrics: the step minus its stages; negative when stages overlapped).
    `outside_generate_and_train` is the step minus the two, the number peers keep near zero.
    Without timing_s/step (a step read back from the store) the parts known are given."""
    get = lambda key: float(metrics[key]) if isinstance(metrics.get(key), (int, float)) else None
    stage = {s: get(f"timing_s/{s}") for s in STAGES}
    generate, train = get("timing/generate_s"), get("timing/update_compute_s")
    out = {"generate": generate, "update_train": train,
           "rollout_other": stage["rollout"] - generate if None not in (stage["rollout"], generate) else None,
           "logprob": stage["logprob"], "reward": stage["reward"], "advantage": stage["advantage"],
           "update_other": stage["update"] - train if None not in (stage["update"], train) else None}
    step = get("timing_s/step")
    if step is not None:
        out["orchestration"] = step - sum(v for v in stage.values() if v is not None)
        out["outside_generate_and_train"] = step - (generate or 0.0) - (train or 0.0)
        out["step"] = step
    return {k: (round(v, 4) if v is not None else None) for k, v in out.items()}


def _scalars(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in (tree or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_scalars(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out


def sample_rows(ctx, n: int = 3) -> list[dict]:
    rollout = read_file(ctx.store, ctx.layout, ctx.step, "rollout").slice(0, n).to_pylist()
    try:
        reward = read_file(ctx.store, ctx.layout, ctx.step, "reward").slice(0, n).to_pylist()
    except Exception:
        reward = [{}] * len(rollout)
    return [{"uid": r.get("uid"), "prompt": (r.get("prompt") or "")[-200:],
             "response": (r.get("response") or "")[:200], "score": w.get("score")}
            for r, w in zip(rollout, reward)]


def publish_step(ctx, summaries: dict) -> dict:
    """A markdown artifact (stages, metrics, samples, a link to each stage's parquet) and a table
    of samples, keyed per experiment so Prefect versions them over steps."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    step = ctx.step
    slug = artifact_slug(ctx.layout)
    metrics = step_metrics(ctx, summaries)
    samples = sample_rows(ctx)
    lines = [f"# {ctx.layout.base}: step {step}", "", "| stage | status | rows | seconds |",
             "|---|---|---|---|"]
    for stage in STAGES:
        s = summaries.get(stage) or {}
        status = "cached" if s.get("skipped") else "ran"
        lines.append(f"| {stage} | {status} | {s.get('rows')} | {s.get('seconds') or '-'} |")
    overlap = summaries.get("overlap")  # trainer.staleness: what the pipelined schedule achieved
    if overlap:
        ours = overlap.get("chain") or ["rollout", "reward"]
        theirs = [st for st in STAGES if st not in ours]
        lines += ["", f"overlap: this step's {', '.join(ours)} ran {overlap['seconds']:.3f} s beside step "
                      f"{step - 1}'s {', '.join(theirs)} ({overlap['share']:.0%} of them); the rollout "
                      f"sampled the weights after update {overlap['policy_version']} (staleness {overlap['staleness']})"]
    lines += tool_turn_lines(ctx)
    lines += ["", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in sorted(metrics.items())]
    lines += ["", "## samples", ""]
    for row in samples:
        lines += [f"- **{row['uid']}** score {row['score']}: `{_md(row['prompt'])}` → "
                  f"`{_md(row['response'])}`"]
    lines += ["", "## parquet", ""]  # one report, not a link artifact per file: each is an API
    for stage in STAGES:                # call and server work beside the next step's stages
        for name, path in ((summaries.get(stage) or {}).get("paths") or {}).items():
            if name.endswith(".parquet"):
                lines.append(f"- {stage} {name}: {ctx.store.url(path)}")
    create_markdown_artifact(key=f"{slug}-step", markdown="\n".join(lines),
                             description=f"{ctx.layout.base} step {step}")
    create_table_artifact(key=f"{slug}-samples", table=samples,
                          description=f"first rows of step {step}")
    return metrics


def tool_turn_lines(ctx) -> list[str]:
    """A multi-turn step's tool use, from its turns table: assistant turns per trajectory,
    and per tool its calls, errors and mean latency (none for a single-turn step)."""
    from storage.query import step_turns

    manifest = read_manifest(ctx.store, ctx.layout, ctx.step, "rollout") or {}
    table = step_turns(ctx.store, ctx.layout, ctx.step, manifest)
    if table is None:
        return []
    t = table.to_pydict()
    rows = int(manifest.get("row_count") or len(set(t["row"])) or 1)
    assistant = sum(1 for role in t["role"] if role == "assistant")
    tools: dict = {}
    for role, tool, error, latency in zip(t["role"], t["tool"], t["error"], t["latency_s"]):
        if role == "tool":
            entry = tools.setdefault(tool or "?", [0, 0, 0.0])
            entry[0] += 1
            entry[1] += bool(error)
            entry[2] += float(latency or 0.0)
    lines = ["", f"tool turns: {assistant / rows:.2f} assistant turns and "
                 f"{sum(e[0] for e in tools.values()) / rows:.2f} tool calls per trajectory ({TURNS_FILE})", "",
             "| tool | calls | errors | mean latency s |", "|---|---|---|---|"]
    lines += [f"| {tool} | {n} | {errors} | {latency / n:.4f} |" for tool, (n, errors, latency) in sorted(tools.items())]
    return lines


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _md(text: str) -> str:
    return str(text).replace("`", "'").replace("\n", " ")
