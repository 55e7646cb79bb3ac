"""`stagerl fork SRC NEW --at STEP:STAGE [key=value ...] [--root URL]`: NEW starts from SRC's
finished work up to (not including) STAGE of STEP, referencing SRC's objects instead of copying
them, and trains from there with the overrides (flows/fork.py). It runs the rl-train flow with its
`fork` parameter, as a deployment run can; running the same command again (or `stagerl resume
NEW`) continues the fork. An override that would change a stage the fork reuses is refused with
exit code 2, naming the keys and the stage."""
from flows.cli.args import add_experiment, add_force_lock, add_overrides, add_root


def register(subparsers) -> None:
    p = subparsers.add_parser("fork", help="branch an experiment at a stage of a step and train "
                                           "the branch with overrides (reuses, not copies, SRC's work)")
    add_experiment(p, "source", label="SRC: ")
    p.add_argument("new", help="NEW: the fork's experiment name (in SRC's project)")
    p.add_argument("--at", required=True, metavar="STEP:STAGE",
                   help="the first stage NEW computes itself, e.g. 3:advantage (everything before "
                        "it is SRC's)")
    add_root(p)
    add_force_lock(p)
    add_overrides(p, note="NEW's ", trailing=True)
    p.set_defaults(func=run)


def start_fork(source: str, new: str, at: str, overrides: list, root: str | None,
               force_lock: bool = False) -> int:
    """Run the rl-train flow that makes NEW a fork of SOURCE at AT and trains it; exit code."""
    import argparse

    from flows.cli.train import _run_flow
    from flows.fork import ForkRefused, parse_at
    from flows.read.inspect_lib import find_experiment
    from storage.artifacts import read_run_json
    from storage.layout import RunLayout

    try:
        parse_at(at)
        store, root, project, experiment = find_experiment(argparse.Namespace(root=root, experiment=source))
    except (ForkRefused, LookupError) as exc:
        print(f"error: {exc}")
        return 2
    doc = read_run_json(store, RunLayout(project, experiment)) or {}
    config = (doc.get("source") or {}).get("config") or "tiny-cpu"
    from storage.secrets import scrub_override

    fork = {"source": f"{project}/{experiment}", "at": at,  # a flow parameter: no credentials
            "overrides": [scrub_override(o, store.secret_values) for o in overrides]}
    return _run_flow(config, list(overrides) + [f"storage.root={root}"], new, force_lock, fork=fork)


def run(args) -> int:
    return start_fork(args.source, args.new, args.at, args.overrides, args.root, args.force_lock)
