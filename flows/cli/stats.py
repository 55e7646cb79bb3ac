"""`stagerl stats DATASET [--run EXPERIMENT] [--config NAME] [key=value ...]`: token-length
distribution (p50/p90/p95/p99/max) of the dataset's prompts after the chat template (tokenizer
from actor_rollout_ref.model.path) and of a run's responses, with recommended
data.max_prompt_length, data.max_response_length and token budgets, and the reasoning."""
from flows.cli.args import add_json, add_overrides, add_run_arguments
from flows.read.inspect_lib import guarded


def register(subparsers) -> None:
    p = subparsers.add_parser("stats", help="prompt/response token-length distribution and "
                                            "recommended max lengths and token budgets")
    p.add_argument("dataset", help="a verl-format parquet file (prompt = chat messages)")
    add_overrides(p)
    p.add_argument("--run", default=None, help="experiment whose responses to measure")
    add_run_arguments(p, experiment=False)  # --project, --root, --config: of --run
    add_json(p)
    p.set_defaults(func=run)


@guarded
def run(args) -> int:
    import json
    import os

    from flows.read.inspect_lib import load_cli_config, open_view
    from flows.read.length_stats import distribution, prompt_lengths, recommend, run_lengths
    from stages.model.models import load_tokenizer

    cfg = load_cli_config(args, args.overrides)
    model = os.path.expanduser(str(cfg.get_path("actor_rollout_ref.model.path")))
    tokenizer = load_tokenizer(model)
    report = {"dataset": args.dataset, "tokenizer": model,
              "prompt": distribution(prompt_lengths(args.dataset, cfg.get("data") or {}, tokenizer,
                                                    cfg.get_path("actor_rollout_ref.model.custom_chat_template")))}
    run_info = None
    if args.run:
        args.experiment = args.run
        view = open_view(args, cfg)
        run_info = run_lengths(view)
        report["run"] = {"experiment": view.name, "steps": run_info["steps"],
                         "response_limit": run_info["limit"], "clip_ratio": run_info["clip_ratio"]}
        report["response"] = distribution(run_info["responses"])
        report["run_prompt"] = distribution(run_info["prompts"])
    report["recommend"] = recommend(report["prompt"], report.get("response"), run_info, cfg)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"dataset {args.dataset} (tokenizer {model})")
    for name in ("prompt", "response", "run_prompt"):
        if name in report:
            d = report[name]
            label = {"prompt": "prompts (chat template)", "response": "responses (run)",
                     "run_prompt": "prompts (run)"}[name]
            print(f"  {label:24s} n={d['count']}  mean={d['mean']:.1f}  " +
                  "  ".join(f"{k}={d[k]}" for k in ("p50", "p90", "p95", "p99", "max")))
    if "run" in report:
        r = report["run"]
        clip = "-" if r["clip_ratio"] is None else f"{r['clip_ratio']:.1%}"
        print(f"  run {r['experiment']}: steps {r['steps']}, response limit "
              f"{r['response_limit']}, clipped {clip}")
    print("recommended:")
    for key, rec in report["recommend"].items():
        print(f"  {key}={rec['value']}\n      {rec['why']}")
    return 0
