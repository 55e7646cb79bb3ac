"""SQL over a run: every complete step's parquet as DuckDB tables, and verl's rollout dump rows.

Tables (each with `step` and `row`, the row's index in its step, so stages join on (step, row),
and `experiment`, the run's name: over several runs (branches of a fork) they join on
(experiment, step, row) and compare with GROUP BY experiment):
    rollout, logprob, reward, advantage   one row per rollout row
    microbatches                          update/microbatches.parquet, one row per (rank, micro-batch)
    metrics                               step, source ('update' | 'advantage'), name, value
    candidates                            DAPO's generated answers (rollout/candidates.parquet)
    baseline                              ReMax's greedy answers, one per prompt (rollout/baseline.parquet)
                                          with score and acc (reward/baseline.parquet; null until scored)
    turns                                 multi-turn rollouts (rollout/turns.parquet): one row per assistant
                                          turn and tool call; its `row` is the trajectory's rollout row, so
                                          it joins the others on (step, row); tool, arguments, response,
                                          latency_s (also as `latency`, the issue's and verl
                                          users' name; seconds), error, token_start/token_end, mask
Only stages with a manifest count (read through storage.artifacts, checksums verified). The
tables are registered as Arrow tables, so a local store and S3 behave the same, and the
connection is read-only over them: no file system, network or extension access (DuckDB's
enable_external_access off, the configuration locked) and only SELECT statements, so a query
can neither read nor write anything of the host (`COPY ... TO`, `read_text`, `glob`, `ATTACH`
and `CREATE` are refused naming the statement).

    con = connect(view);  con.sql("SELECT step, avg(score) FROM reward GROUP BY step")
    con = connect([a, b]);  con.sql("SELECT experiment, step, avg(score) FROM reward GROUP BY ALL")
"""
from __future__ import annotations

import pyarrow as pa

from storage.layout import TURNS_FILE
from storage.schemas import SCHEMAS

TABLES = ("rollout", "logprob", "reward", "advantage", "microbatches", "metrics", "candidates", "baseline", "turns")
# candidates: every answer DAPO's dynamic sampling generated (rollout/candidates.parquet), kept or not
_STAGE_OF = {"rollout": "rollout", "logprob": "logprob", "reward": "reward",
             "advantage": "advantage", "microbatches": "update"}
_METRICS_SCHEMA = pa.schema([("step", pa.int32()), ("source", pa.string()),
                             ("name", pa.string()), ("value", pa.float64()),
                             ("experiment", pa.string())])


def _with_keys(table: pa.Table, step: int, experiment: str) -> pa.Table:
    n = table.num_rows
    table = table.append_column("step", pa.array([step] * n, pa.int32()))
    table = table.append_column("row", pa.array(range(n), pa.int32()))
    return table.append_column("experiment", pa.array([experiment] * n, pa.string()))


def _empty(name: str) -> pa.Table:
    fields = list(SCHEMAS[name].required) + list(SCHEMAS[name].optional)
    return pa.schema(fields + [("step", pa.int32()), ("row", pa.int32()),
                               ("experiment", pa.string())]).empty_table()


def stage_table(view, name: str, steps=None) -> pa.Table:
    """One table over the complete steps (those with `name`'s manifest), with step and row."""
    if name == "metrics":
        return metrics_table(view, steps)
    if name == "candidates":
        return candidates_table(view, steps)
    if name == "baseline":
        return baseline_table(view, steps)
    if name == "turns":
        return turns_table(view, steps)
    if name not in _STAGE_OF:
        raise KeyError(f"no table {name!r}; tables are {', '.join(TABLES)}")
    stage = _STAGE_OF[name]
    chosen = view.complete_steps([stage]) if steps is None else steps
    parts = [_with_keys(view.table(step, stage), step, view.layout.experiment) for step in chosen
             if view.manifest(step, stage) is not None]
    if not parts:
        return _empty(name)
    return pa.concat_tables(parts, promote_options="permissive")


def candidates_table(view, steps=None) -> pa.Table:
    """The steps whose rollout kept its dynamic-sampling candidates, with step and row."""
    from storage.artifacts import read_file

    name = "rollout/candidates.parquet"
    parts = []
    for step in (view.complete_steps(["rollout"]) if steps is None else steps):
        manifest = view.manifest(step, "rollout")
        if manifest is not None and name in manifest.get("files", {}):
            parts.append(_with_keys(read_file(view.store, view.layout, step, "rollout", name), step, view.layout.experiment))
    return pa.concat_tables(parts) if parts else _empty("rollout_candidates")


def baseline_table(view, steps=None) -> pa.Table:
    """The steps whose rollout generated greedy baseline answers (estimators that need a baseline:
    remax), with step and row, and each answer's score and acc once the reward stage scored them."""
    from storage.artifacts import read_file

    answers, scores = "rollout/baseline.parquet", "reward/baseline.parquet"
    parts = []
    for step in (view.complete_steps(["rollout"]) if steps is None else steps):
        manifest = view.manifest(step, "rollout")
        if manifest is None or answers not in manifest.get("files", {}):
            continue
        table = _with_keys(read_file(view.store, view.layout, step, "rollout", answers), step, view.layout.experiment)
        scored = view.manifest(step, "reward")
        by_uid = {}
        if scored is not None and scores in scored.get("files", {}):
            s = read_file(view.store, view.layout, step, "reward", scores)
            by_uid = dict(zip(s.column("uid").to_pylist(), zip(s.column("score").to_pylist(), s.column("acc").to_pylist())))
        uids = table.column("uid").to_pylist()
        for i, name in enumerate(("score", "acc")):
            table = table.append_column(name, pa.array([by_uid[u][i] if u in by_uid else None for u in uids],
                                                       pa.float32()))
        parts.append(table)
    if not parts:
        return pa.schema(list(_empty("rollout").schema) + [("score", pa.float32()), ("acc", pa.float32())]).empty_table()
    return pa.concat_tables(parts, promote_options="permissive")


def step_turns(store, layout, step: int, manifest: dict | None = None) -> pa.Table | None:
    """The turns of one multi-turn step (layout.TURNS_FILE: one row per assistant turn and tool
    call, in order), or None for a single-turn or uncommitted rollout. `manifest`: the rollout's,
    when the caller has it."""
    from storage.artifacts import read_file, read_manifest

    manifest = manifest if manifest is not None else read_manifest(store, layout, step, "rollout")
    if not manifest or TURNS_FILE not in (manifest.get("files") or {}):
        return None
    return read_file(store, layout, step, "rollout", TURNS_FILE)


def turns_table(view, steps=None) -> pa.Table:
    """The multi-turn steps' turns (step and the rollout row stored), with experiment."""
    parts = []
    for step in (view.complete_steps(["rollout"]) if steps is None else steps):
        manifest = view.manifest(step, "rollout")
        table = step_turns(view.store, view.layout, step, manifest) if manifest is not None else None
        if table is not None:
            parts.append(table.append_column("experiment", pa.array([view.layout.experiment] * table.num_rows, pa.string())))
    if not parts:
        fields = list(SCHEMAS["rollout_turns"].required)
        table = pa.schema(fields + [("experiment", pa.string())]).empty_table()
    else:
        table = pa.concat_tables(parts, promote_options="permissive")
    return table.append_column("latency", table.column("latency_s"))  # the same seconds, by its short name


def metrics_table(view, steps=None) -> pa.Table:
    rows = {"step": [], "source": [], "name": [], "value": [], "experiment": []}
    for step in (view.steps() if steps is None else steps):
        for source, metrics in (("update", view.update_metrics(step)),
                                ("advantage", view.data_metrics(step))):
            for key, value in sorted(metrics.items()):
                rows["step"].append(step)
                rows["source"].append(source)
                rows["name"].append(key)
                rows["value"].append(value)
                rows["experiment"].append(view.layout.experiment)
    return pa.table(rows, schema=_METRICS_SCHEMA)


def connect(views, tables=TABLES):
    """An in-memory DuckDB connection with the tables of a run (a view) or of several runs (a
    list of views: each table holds all their rows, told apart by `experiment`)."""
    import duckdb

    views = views if isinstance(views, (list, tuple)) else [views]
    con = duckdb.connect(":memory:", config={"enable_external_access": False, "autoinstall_known_extensions": False,
                                             "autoload_known_extensions": False, "lock_configuration": True})
    for name in tables:
        parts = [stage_table(view, name) for view in views]
        con.register(name, parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="permissive"))
    return con


def tables_in(sql: str) -> list:
    """The known table names a query mentions (so only those are loaded)."""
    import re

    words = set(re.findall(r"[A-Za-z_]+", sql.lower()))
    return [t for t in TABLES if t in words]


class ReadOnlyQuery(ValueError):
    """A statement other than SELECT in `stagerl query`."""


def run_query(views, sql: str):
    """(column names, rows as tuples) of `sql` over the run (or the list of runs); SELECT only."""
    import duckdb

    con = connect(views, tables_in(sql) or TABLES)
    try:
        statements = con.extract_statements(sql)
        for statement in statements:
            if statement.type != duckdb.StatementType.SELECT:
                raise ReadOnlyQuery(f"only SELECT statements read a run: {statement.type.name} refused "
                                    f"({statement.query.strip()[:80]!r})")
        if len(statements) != 1:
            raise ReadOnlyQuery(f"one SELECT statement per query ({len(statements)} given)")
        result = con.execute(sql)
        columns = [d[0] for d in result.description or []]
        return columns, result.fetchall()
    finally:
        con.close()


# ---- verl's rollout dump (trainer.rollout_data_dir: one {step}.jsonl per step) -----------------
TURN_FIELDS = ("turn", "role", "call", "tool", "arguments", "response", "error", "latency_s", "token_start", "token_end")


def dump_rows(view, step: int) -> list:
    """verl's `_dump_generations` entries for one step: input, output, gts, score, step, then the
    reward's scalar extra columns (acc, ...), one dict per rollout row in order. A multi-turn
    step adds verl's num_turns and `turns`: the trajectory's rows of rollout/turns.parquet (each
    assistant turn and tool call: role, tool, arguments, response, error, latency_s, token span)."""
    view.require(step, ["rollout", "reward"])
    rollout, reward = view.table(step, "rollout"), view.table(step, "reward")
    n = rollout.num_rows
    data = {"input": rollout.column("prompt").to_pylist(),
            "output": rollout.column("response").to_pylist(),
            "gts": rollout.column("ground_truth").to_pylist(),
            "score": reward.column("score").to_pylist(),
            "step": [step] * n}
    for field in reward.schema:
        if field.name in data or field.name == "extras":
            continue
        if pa.types.is_integer(field.type) or pa.types.is_floating(field.type) \
                or pa.types.is_string(field.type) or pa.types.is_boolean(field.type):
            data[field.name] = reward.column(field.name).to_pylist()
    turns = _turns_by_row(view, step, n)
    if turns is not None:
        data["num_turns"] = rollout.column("num_turns").to_pylist()
        data["turns"] = turns
    return [{k: v[i] for k, v in data.items()} for i in range(n)]


def _turns_by_row(view, step: int, n: int) -> list | None:
    """Each trajectory's turns (in order), or None for a single-turn step."""
    table = step_turns(view.store, view.layout, step, view.manifest(step, "rollout") or {})
    if table is None:
        return None
    columns = {f: table.column(f).to_pylist() for f in TURN_FIELDS + ("row",)}
    out: list = [[] for _ in range(n)]
    for i, row in enumerate(columns["row"]):
        out[row].append({f: columns[f][i] for f in TURN_FIELDS})
    return out
