"""`stagerl runs [--root URL]`: the experiments in a store, their steps done, the last
complete stage, and for a fork its source and fork point (run.json's lineage, flows/fork.py)."""
from flows.cli.args import add_json, add_root


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "runs", help="list experiments in a store with steps done and the last complete stage")
    add_root(p)
    add_json(p, "the experiments")
    p.add_argument("--verify", action="store_true",
                   help="also read every stored file back against its manifest's checksum "
                        "(column DAMAGED; `stagerl verify EXPERIMENT` lists them)")
    p.set_defaults(func=run)


def collect(store, verify: bool = False) -> list:
    """One summary dict per experiment found under the store root (with `verify`: "damaged",
    the number of stored files that do not match their manifests)."""
    from storage.artifacts import read_run_json, run_status
    from storage.layout import STAGES, RunLayout
    from storage.lineage import fork_records
    from storage.weights import list_weights

    rows = []
    for project in store.list(""):
        for experiment in store.list(project):
            try:
                layout = RunLayout(project, experiment)
            except ValueError:
                continue
            if not (store.exists(layout.run_json) or store.exists(layout.steps_dir)):
                continue
            status = run_status(store, layout)
            done = [s for s, st in status.items() if st[STAGES[-1]]]
            last = None
            for step in sorted(status, reverse=True):
                complete = [s for s in STAGES if status[step][s]]
                if complete:
                    last = f"step {step} {complete[-1]}"
                    break
            weights = list_weights(store, layout)
            lock = store.exists(layout.lock)
            doc = read_run_json(store, layout)
            lineage = (doc or {}).get("lineage") or {}
            rows.append({"project": project, "experiment": experiment,
                         "steps_done": len(done), "last_step_done": max(done) if done else None,
                         "last_complete": last, "weights": weights[-1] if weights else None,
                         "locked": lock, "has_run_json": doc is not None,
                         "forked_from": ({k: lineage.get(k) for k in ("source", "at", "overrides")}
                                         if lineage else None),
                         "forks": len(fork_records(store, layout))})
            if verify:
                from storage.verify import verify_run

                rows[-1]["damaged"] = len(verify_run(store, layout).damaged)
    return rows


def run(args) -> int:
    import json
    import os

    from storage.store import Store

    root = args.root or os.environ.get("STAGERL_ROOT") or "./runs"
    store = Store.from_config({"root": root})
    rows = collect(store, verify=args.verify)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"store: {store.url('')}")
    if not rows:
        print("no experiments")
        return 0
    header = ("PROJECT", "EXPERIMENT", "STEPS DONE", "LAST COMPLETE", "WEIGHTS", "LOCKED",
              "FORKED FROM", "FORKS") + (("DAMAGED",) if args.verify else ())
    table = [header] + [(r["project"], r["experiment"], str(r["steps_done"]),
                         r["last_complete"] or "-",
                         "-" if r["weights"] is None else f"step_{r['weights']:06d}",
                         "yes" if r["locked"] else "no", _lineage(r), str(r["forks"]))
                        + ((str(r["damaged"]),) if args.verify else ()) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def _lineage(row: dict) -> str:
    """'tour @ 3:advantage (algorithm.adv_estimator=rloo)' for a fork, '-' otherwise."""
    lineage = row.get("forked_from")
    if not lineage:
        return "-"
    source = str(lineage.get("source") or "?")
    if source.split("/")[0] == row["project"]:
        source = source.split("/", 1)[-1]
    shown = [o for o in lineage.get("overrides") or [] if not o.startswith("storage.")]
    text = f"{source} @ {lineage.get('at')}" + (f" ({' '.join(shown)})" if shown else "")
    return text if len(text) <= 96 else text[:93] + "..."  # `stagerl runs --json` has all of it
