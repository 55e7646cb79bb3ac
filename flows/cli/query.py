"""`stagerl query "SQL" --experiment E`: DuckDB over every complete step's parquet (tables rollout,
logprob, reward, advantage, microbatches, metrics, candidates (DAPO's generated answers), baseline
(ReMax's greedy answers with their scores), turns (multi-turn rollouts: every assistant turn and tool
call, `row` its trajectory's); each with `step`, `row` and `experiment`). With
several --experiment (a run and its forks) each table holds the rows of all of them, so branches
compare in one statement (GROUP BY experiment; joins USING (experiment, step, row)).
`stagerl export EXPERIMENT --format jsonl [--out DIR]`: verl's rollout dump, one {step}.jsonl per
step (input, output, gts, score, step, reward extras), as trainer.rollout_data_dir writes it."""
from flows.cli.args import RUN_HELP, add_json, add_run_arguments
from flows.read.inspect_lib import guarded


def register(subparsers) -> None:
    q = subparsers.add_parser("query", help="SQL (DuckDB) over a run's parquet: tables rollout, "
                                            "logprob, reward, advantage, microbatches, metrics, candidates, baseline, turns")
    q.add_argument("sql", help='e.g. "SELECT step, avg(score) FROM reward GROUP BY step"')
    q.add_argument("--experiment", required=True, action="append",
                   help=f"{RUN_HELP}; repeat it to query several runs at once (the tables' "
                        "`experiment` column tells them apart)")
    add_run_arguments(q, experiment=False)
    add_json(q, "the rows")
    q.set_defaults(func=run_query)

    e = subparsers.add_parser("export", help="verl's per-step rollout dump ({step}.jsonl)")
    add_run_arguments(e)
    e.add_argument("--format", choices=("jsonl",), default="jsonl")
    e.add_argument("--out", default=None,
                   help="folder for {step}.jsonl files (default ./rollout_data/EXPERIMENT); "
                        "'-' prints to stdout")
    e.add_argument("--step", type=int, default=None, help="only this step")
    e.set_defaults(func=run_export)


@guarded
def run_query(args) -> int:
    import argparse
    import json

    from flows.read.inspect_lib import load_cli_config, open_view
    from storage.query import run_query as execute

    cfg = load_cli_config(args)
    names = list(dict.fromkeys(args.experiment))
    views = [open_view(argparse.Namespace(**{**vars(args), "experiment": name}), cfg) for name in names]
    try:
        columns, rows = execute(views[0] if len(views) == 1 else views, args.sql)
    except Exception as exc:  # duckdb's errors (parser, binder, catalog) name the problem
        if type(exc).__module__.startswith("duckdb") or "duckdb" in type(exc).__module__:
            raise ValueError(f"query failed: {exc}") from None
        raise
    if args.json:
        print(json.dumps([dict(zip(columns, r)) for r in rows], indent=2, default=str))
        return 0
    cells = [columns] + [[_cell(v) for v in r] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
    print(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return 0


def _cell(v) -> str:
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return v.replace("\n", "\\n")
    return "NULL" if v is None else str(v)


@guarded
def run_export(args) -> int:
    import json
    import sys
    from pathlib import Path

    from flows.read.inspect_lib import open_view
    from storage.query import dump_rows

    view = open_view(args)
    if args.step is not None:
        view.require(args.step, ["rollout", "reward"])
        steps = [args.step]
    else:
        steps = view.complete_steps(["rollout", "reward"])
        if not steps:
            raise LookupError(f"{view.name} has no step with a complete rollout and reward yet")
    out = None if args.out == "-" else Path(args.out or Path("rollout_data") / args.experiment)
    for step in steps:
        lines = [json.dumps(entry, ensure_ascii=False) for entry in dump_rows(view, step)]
        if out is None:
            sys.stdout.write("".join(line + "\n" for line in lines))
            continue
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{step}.jsonl").write_text("".join(line + "\n" for line in lines))
        print(f"step {step}: {len(lines)} rows -> {out / f'{step}.jsonl'}", file=sys.stderr)
    skipped = [s for s in view.steps() if s not in steps and args.step is None]
    if skipped:
        print(f"skipped incomplete steps: {', '.join(map(str, skipped))}", file=sys.stderr)
    return 0
