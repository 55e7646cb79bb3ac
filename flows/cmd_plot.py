"""`stagerl plot EXPERIMENT [--step K]`: PNGs in the run's plots/ folder in the store: reward,
acc, KL, entropy and response length over steps; per step the response-length histogram, the
per-rank token load and the tokens of each micro-batch against the token budget."""
from flows.inspect_lib import add_run_arguments, guarded


def register(subparsers) -> None:
    p = subparsers.add_parser("plot", help="write PNG plots of a run into its plots/ folder")
    add_run_arguments(p)
    p.add_argument("--step", type=int, action="append", default=None,
                   help="per-step plots only for this step (repeatable; default: every step)")
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
    written = make_plots(view, args.step)
    if args.json:
        print(json.dumps(written, indent=2))
        return 0
    for w in written:
        print(w["url"])
    return 0
