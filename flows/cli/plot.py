"""`stagerl plot EXPERIMENT [--step K ...] [--all]`: PNGs in the run's plots/ folder in the store:
the run overview (reward, acc, KL, entropy and response length over steps) and, for the last step
(or each --step K, or every step with --all), the response-length histogram, the per-rank token
load and the tokens of each micro-batch against the token budget.
`stagerl plot A B [C ...]`: the overview's curves of several runs (a run and its forks) overlaid
in one figure, branches_A_B.png in the first run's plots/ folder, fork points marked."""
from flows.cli.args import RUN_HELP, add_json, add_run_arguments
from flows.read.inspect_lib import guarded


def register(subparsers) -> None:
    p = subparsers.add_parser("plot", help="write PNG plots of a run into its plots/ folder")
    p.add_argument("experiment", nargs="+",
                   help=f"{RUN_HELP}; several: their curves overlaid")
    add_run_arguments(p, experiment=False)
    p.add_argument("--step", type=int, action="append", default=None,
                   help="per-step plots for this step (repeatable; default: the last step)")
    p.add_argument("--all", action="store_true", help="per-step plots for every step")
    add_json(p, "what was written")
    p.set_defaults(func=run)


@guarded
def run(args) -> int:
    from flows.read.inspect_lib import open_view
    from flows.read.plots import make_plots

    names = list(dict.fromkeys(args.experiment))
    if len(names) > 1:
        return overlay(args, names)
    args.experiment = names[0]
    view = open_view(args)
    for step in args.step or []:
        view.require(step, ["rollout"])
    if args.all:
        steps = None
    elif args.step:
        steps = args.step
    else:  # the overview, and the newest step that has something to show
        done = [s for s in view.steps() if view.manifest(s, "rollout")]
        steps = done[-1:]
    written = make_plots(view, steps)
    return print_written(written, args.json)


def overlay(args, names: list) -> int:
    """branches_{names}.png in the first run's plots/ folder."""
    import argparse

    from flows.read.inspect_lib import load_cli_config, open_view
    from flows.read.plots import branches_figure, save

    cfg = load_cli_config(args)
    views = [open_view(argparse.Namespace(**{**vars(args), "experiment": n}), cfg) for n in names]
    for view in views:
        if not any(view.manifest(s, "rollout") for s in view.steps()):
            raise LookupError(f"{view.name} has no step with a complete rollout yet: nothing to plot")
    written = [save(views[0], branches_figure(views), "branches_" + "_".join(
        v.layout.experiment for v in views) + ".png")]
    return print_written(written, args.json)


def print_written(written: list, as_json: bool) -> int:
    """The plots written: their URLs, one per line, or the records as JSON."""
    import json

    if as_json:
        print(json.dumps(written, indent=2))
    else:
        for w in written:
            print(w["url"])
    return 0
