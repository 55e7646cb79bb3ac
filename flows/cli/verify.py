"""`stagerl verify EXPERIMENT [--root URL] [--repair]`: read back every committed file of a run
(stage files, weights, critic and train-state folders) against its manifest (storage.verify).
Exit 0 when all match, 1 when something is damaged. `--repair` un-commits the damaged stages so
that `stagerl resume` computes them again. `stagerl resume` runs the check first."""
from flows.cli.args import add_experiment, add_root


def register(subparsers) -> None:
    p = subparsers.add_parser("verify", help="check a run's stored files against their manifests' "
                                             "checksums (--repair: un-commit the damaged ones)")
    add_experiment(p)
    add_root(p)
    p.add_argument("--repair", action="store_true",
                   help="un-commit each damaged stage (and folder) so `stagerl resume` recomputes it")
    p.set_defaults(func=run)


def check_run(store, project: str, experiment: str, root: str) -> bool:
    """Verify the run and print the result; True when nothing is damaged."""
    from storage.layout import RunLayout
    from storage.verify import verify_run

    report = verify_run(store, RunLayout(project, experiment))
    print(f"verify {project}/{experiment}: {report.summary()}")
    for d in report.damaged:
        owner = f"step {d.step} {d.stage}" if d.stage else f"step {d.step} folder {d.folder}"
        print(f"  damaged: {store.url(d.key)} ({owner}): {d.problem}")
    if not report.ok:
        print(f"to compute them again: `stagerl verify {project}/{experiment} --root {root} --repair` "
              f"(un-commits them), then `stagerl resume {project}/{experiment} --root {root}`; "
              f"or restore the files from a backup")
    return report.ok


def run(args) -> int:
    from flows.read.inspect_lib import find_experiment_or_say
    from storage.layout import RunLayout
    from storage.verify import repair, verify_run

    found = find_experiment_or_say(args)
    if found is None:
        return 2
    store, root, project, experiment = found
    if not args.repair:
        return 0 if check_run(store, project, experiment, root) else 1
    layout = RunLayout(project, experiment)
    report = verify_run(store, layout)
    print(f"verify {project}/{experiment}: {report.summary()}")
    undone = repair(store, layout, report)
    for item in undone:
        print(f"  un-committed: {item}")
    if undone:
        print(f"`stagerl resume {project}/{experiment} --root {root}` computes them again (a stage "
              f"needs the step before's weights and train state, which older steps may no longer keep)")
    return 0
