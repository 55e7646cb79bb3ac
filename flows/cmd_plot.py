"""`stagerl plot EXPERIMENT [--step K ...] [--all]`: PNGs in the run's plots/ folder in the store:
the run overview (reward, acc, KL, entropy and response length over steps) and, for the last step
(or each --step K, or every step with --all), the response-length histogram, the per-rank token
load and the tokens of each micro-batch against the token budget."""
from flows.inspect_lib import add_run_arguments, guarded


def register(subparsers) -> None:
    p = subparsers.add_parser("plot", help="write PNG plots of a run into its plots/ folder")
    add_run_arguments(p)
    p.add_argument("--step", type=int, action="append", default=None,
                   help="per-step plots for this step (repeatable; default: the last step)")
    p.add_argument("--all", action="store_true", help="per-step plots for every step")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(func=run)


@guarded
def run(args) -> int:
    import json

    from flows.inspect_lib import open_view
    from flows.plots import make_plots

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
    if args.json:
        print(json.dumps(written, indent=2))
        return 0
    for w in written:
        print(w["url"])
    return 0
