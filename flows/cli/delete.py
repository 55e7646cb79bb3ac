"""`stagerl delete EXPERIMENT [--root URL] [--detach-forks]`: remove an experiment's folder from
the store. Refused while forks reference its objects (flows/fork.py), naming them: with
`--detach-forks` every object a fork references is first copied into that fork (storage.lineage
copy on demand), so the forks keep working. Deleting a fork removes its records at the runs it
references; their objects stay."""
from flows.cli.args import add_experiment, add_force_lock, add_root


def register(subparsers) -> None:
    p = subparsers.add_parser("delete", help="remove an experiment from the store (refused while "
                                             "forks reference it, unless --detach-forks)")
    add_experiment(p)
    add_root(p)
    p.add_argument("--detach-forks", action="store_true",
                   help="copy what forks reference into them first, then delete")
    add_force_lock(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from flows.fork import ForkRefused, lock_run
    from flows.read.inspect_lib import find_experiment_or_say
    from storage.artifacts import read_run_json
    from storage.layout import RunLayout
    from storage.lineage import fork_records, forget_fork, release

    found = find_experiment_or_say(args)
    if found is None:
        return 2
    store, root, project, experiment = found
    layout = RunLayout(project, experiment)
    forks = fork_records(store, layout)
    if forks and not args.detach_forks:
        names = ", ".join(f"{f['experiment']} ({len(f.get('objects') or {})} objects, fork at "
                          f"{(f.get('lineage') or {}).get('at')})" for f in forks)
        print(f"error: not deleting {layout.base}: forks reference its objects: {names}. "
              f"`stagerl delete {layout.base} --root {root} --detach-forks` copies those into the "
              f"forks first")
        return 1
    try:
        lock = lock_run(store, layout, args.force_lock)
    except ForkRefused as exc:
        print(f"error: {exc}")
        return 1
    try:
        copied = release(store, [layout.base])
        for line in copied:
            print(f"  copied {line}")
        lineage = (read_run_json(store, layout) or {}).get("lineage") or {}
        forget_fork(store, layout, lineage.get("owners") or [])
        store.delete(layout.base, recursive=True)
    finally:
        lock.release()
    print(f"deleted {store.url(layout.base)}" + (f" ({len(copied)} object(s) copied into "
                                                  f"{len(forks)} fork(s) first)" if forks else ""))
    return 0
