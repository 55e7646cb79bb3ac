"""`stagerl inspect EXPERIMENT [--step K] [--stage S] [--json]`: a run's steps and stages (rows,
status, timings, reward, lengths, KL, entropy, losses, per-rank balance, best/worst samples).
`stagerl show EXPERIMENT --step K --uid U [--sample I]`: one sample across the five stages, token
by token (a multi-turn trajectory also turn by turn: assistant turns and tool calls). Both read a local store or S3; a missing run or an incomplete step exits with code 2."""
from flows.cli.args import add_json, add_run_arguments
from flows.read.inspect_lib import guarded

STAGE_CHOICES = ("rollout", "logprob", "reward", "advantage", "update")


def register(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="per step and stage: rows, status, timings, rewards, "
                                              "lengths, KL, entropy, losses, rank balance, samples")
    add_run_arguments(p)
    p.add_argument("--step", type=int, default=None, help="one step in detail")
    p.add_argument("--stage", choices=STAGE_CHOICES, default=None, help="only this stage")
    p.add_argument("--samples", type=int, default=2, help="best/worst samples shown (default 2)")
    add_json(p)
    p.set_defaults(func=run_inspect)

    s = subparsers.add_parser("show", help="one sample joined across all stages, per token")
    add_run_arguments(s)
    s.add_argument("--step", type=int, required=True)
    s.add_argument("--uid", required=True, help="prompt uid (rollout.parquet uid)")
    s.add_argument("--sample", type=int, default=0, help="sample_index within the uid (default 0)")
    s.add_argument("--ids", action="store_true", help="token ids only (do not load the tokenizer)")
    add_json(s)
    s.set_defaults(func=run_show)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _kv(d: dict) -> str:
    return "  ".join(f"{k}={_fmt(v)}" for k, v in d.items())


def _clip(text, width=70) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 3] + "..."


@guarded
def run_inspect(args) -> int:
    import json

    from flows.read.inspect_lib import open_view, overview_row, step_summary

    view = open_view(args)
    if args.step is None:
        warm = 0 in view.steps()  # step 0 holds the warm start only (warmstart.enable), not an RL step
        rows = [overview_row(view, s) for s in view.steps() if s > 0]
        if args.json:
            print(json.dumps({"run": view.name, "url": view.url, "steps": rows}, indent=2))
            return 0
        print(f"run {view.name} at {view.url}: {len(rows)} step(s), "
              f"{sum(r['status'] == 'complete' for r in rows)} complete"
              + (" (after a warm start: step 0)" if warm else ""))
        cols = ("step", "status", "rows", "score/mean", "acc/mean", "response_length/mean",
                "entropy", "kl", "pg_loss")
        if any(r.get("engine_kl") is not None for r in rows):  # rollout engine vs trainer log-probs
            cols += ("engine_kl",)
        if any(r.get("staleness") for r in rows):  # trainer.staleness: the weights each rollout sampled
            cols += ("version", "staleness", "engine_kl_k1", "is_weight/mean")
        if any(r.get("turns/mean") is not None for r in rows):  # multi-turn: turns, tool calls, errors
            cols += ("turns/mean", "tool_calls/sample", "tool_error_rate", "correct_tool_use")
        table = [cols] + [tuple(_fmt(r.get(c)) for c in cols) for r in rows]
        widths = [max(len(t[i]) for t in table) for i in range(len(cols))]
        for t in table:
            print("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip())
        for r in rows:
            if r["missing"]:
                print(f"step {r['step']}: no manifest yet for {', '.join(r['missing'])}")
        return 0
    view.require(args.step, [args.stage] if args.stage else STAGE_CHOICES)
    summary = step_summary(view, args.step, args.stage, args.samples)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
        return 0
    print(f"run {view.name} step {args.step}: {summary['status']}")
    for name, sec in summary["stages"].items():
        print_stage(name, sec)
        if name == "rollout" and summary.get("policy"):
            p = summary["policy"]
            print(f"    policy:          sampled the weights after update {p['policy_version']} "
                  f"(staleness {p['staleness']})")
            if "engine_vs_trainer" in p:
                print(f"    engine vs trainer: {_kv(p['engine_vs_trainer'])}")
                print(f"    IS weights:      {_kv(p['is_weights'])}")
    if summary.get("time_s"):  # where the step's seconds went (flows.step_report.time_split)
        print(f"  time (s)  {_kv({k: v for k, v in summary['time_s'].items() if v is not None})}")
    for kind in ("best", "worst"):
        for s in summary.get("samples", {}).get(kind, []):
            print(f"  {kind:5s} uid={s['uid']} sample={s['sample_index']} score={_fmt(s['score'])} "
                  f"advantage={_fmt(s['advantage'])}\n        prompt:   {_clip(s['prompt'])}\n"
                  f"        response: {_clip(s['response'])}")
    return 0


def print_stage(name: str, sec: dict) -> None:
    head = f"  {name:9s} {sec['status']}"
    if sec["status"] != "complete":
        print(head)
        return
    print(f"{head}  rows={sec['rows']}  {_kv(sec.get('timings', {}))}")
    if name == "rollout":
        print(f"    response_length: {_kv(sec['response_length'])}")
        print(f"    prompt_length:   {_kv(sec['prompt_length'])}  prompts={sec['prompts']}")
        print(f"    finish_reason:   {_kv(sec['finish_reason'])}")
        if "multi_turn" in sec:  # rollout/turns.parquet: `stagerl query ... FROM turns`
            m = sec["multi_turn"]
            print(f"    turns/sample:    {_kv(m['num_turns'])}  assistant turns: {_kv(m['assistant_turns'])}")
            print(f"    tool calls:      {m['tool_calls']} ({_fmt(m['tool_calls_per_sample'])}/sample)  "
                  f"by tool: {_kv(m['calls_by_tool']) or '-'}  tool-response tokens: {_fmt(m['tool_token_share'])}")
            print(f"    correct tool use: {_fmt(m['correct_tool_use'])} (samples with a call that answered the ground truth)")
            print(f"    tool errors:     {_kv(m['errors']) or 'none'}"
                  + (f"  rate: {_kv(m['error_rate'])}" if m['errors'] else ""))
            print(f"    tool latency s:  {_kv(m['tool_latency_s'])}")
        if "filter_groups" in sec:  # the rows are in `stagerl query ... FROM candidates`
            print(f"    filter_groups:   {_kv(sec['filter_groups'])}")
        if "baseline" in sec:  # greedy baseline answers, one per prompt (remax): not training rows
            b = sec["baseline"]
            print(f"    baseline:        {b['prompts']} greedy answers (rollout/baseline.parquet)  "
                  f"response_length: {_kv(b['response_length'])}  finish_reason: {_kv(b['finish_reason'])}")
    elif name == "logprob":
        print(f"    {_kv(sec['metrics'])}")
        for role, per_rank in (sec["loads"].get("loads") or {}).items():
            for rank, load in enumerate(per_rank):
                print(f"    load {role} rank {rank}: {_kv(load) if isinstance(load, dict) else load}")
        for rank, timings in enumerate(sec["loads"].get("rank_timings") or []):
            print(f"    rank {rank} timings: {_kv(timings) if isinstance(timings, dict) else timings}")
    elif name == "reward":
        print(f"    score: {_kv(sec['score'])}  acc={_fmt(sec['acc_mean'])}"
              + (f"  errors={sec['errors']}" if "errors" in sec else ""))
        if "baseline_score" in sec:
            print(f"    baseline score: {_kv(sec['baseline_score'])}  (reward/baseline.parquet)")
    elif name == "advantage":
        print(f"    advantage/token_mean={_fmt(sec['advantage/token_mean'])}  "
              f"kl_in_reward/token_mean={_fmt(sec['kl_in_reward/token_mean'])}")
        for k, v in sec["data_metrics"].items():
            print(f"    {k}: {_fmt(v)}")
    elif name == "update":
        for k, v in sec["metrics"].items():
            print(f"    {k}: {_fmt(v)}")
        for k, v in sec["loads"].items():
            print(f"    load {k}: {_kv(v) if isinstance(v, dict) else v}")
        bal = sec["balance"]
        for r in bal["ranks"]:
            print(f"    rank {r['rank']}: {r['rows']} rows, {r['micro_batches']} micro-batches, "
                  f"{r['real_tokens']} tokens ({r['padded_tokens']} padded)")
        print(f"    balance: rows max/mean={_fmt(bal['rows_max_over_mean'])}  "
              f"tokens max/mean={_fmt(bal['tokens_max_over_mean'])}")


def print_turns(turns: list) -> None:
    """A multi-turn trajectory turn by turn: each assistant turn (its tokens, under the mask) and
    each tool call of a tool turn (tool, arguments, the response appended, masked out)."""
    print(f"turns ({len({t['turn'] for t in turns})}):")
    for t in turns:
        span = f"tokens {t['token_start']}-{t['token_end']}, mask {t['mask']}"
        if t["role"] == "assistant":
            print(f"  [{t['turn']}] assistant ({span}, {t['finish_reason']}): {t['response']}")
            continue
        status = f"error {t['error']}" if t["error"] else "ok"
        cut = "; cut off by the response length, not appended" if t["token_start"] == t["token_end"] else ""
        print(f"  [{t['turn']}] tool call {t['call']}: {t['tool'] or '?'}({t['arguments']}) {status}, "
              f"{_fmt(t['latency_s'])} s ({span}{cut}) -> {t['response']}")


@guarded
def run_show(args) -> int:
    import json

    from flows.read.inspect_lib import load_tokenizer_for, open_view, sample_view

    view = open_view(args)
    view.require(args.step, ["rollout"])
    tokenizer = None if args.ids else load_tokenizer_for(view, args.step)
    out = sample_view(view, args.step, args.uid, args.sample, tokenizer)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    ro = out["rollout"]
    print(f"run {view.name} step {args.step} row {out['row']}: uid={args.uid} "
          f"sample={args.sample}  stages: {_kv(out['status'])}")
    print(f"prompt ({len(ro['prompt_ids'])} tokens): {ro['prompt']}")
    print(f"response ({ro['response_length']} tokens, {ro['finish_reason']}): {ro['response']}")
    print(f"ground_truth: {ro['ground_truth']}  data_source: {ro['data_source']}")
    if "turns" in out:  # multi-turn: the trajectory turn by turn
        print_turns(out["turns"])
    if "reward" in out:
        print(f"reward: {_kv({k: v for k, v in out['reward'].items() if v is not None})}")
    if "baseline" in out:
        b = out["baseline"]
        print(f"baseline (greedy, {b['response_length']} tokens, {b['finish_reason']}"
              + (f", score {_fmt(b['score'])}" if "score" in b else "") + f"): {b['response']}")
    for mb in out.get("update", []):
        print(f"update: {_kv(mb)}")
    if tokenizer is None and not args.ids:
        print("(tokenizer not found: run's model path and weights unreadable here; showing ids)")
    if out["tokens"]:
        cols = list(out["tokens"][0])
        table = [["#"] + cols] + [[str(i)] + [repr(t[c]) if c == "token" else _fmt(t[c])
                                              for c in cols] for i, t in enumerate(out["tokens"])]
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        for r in table:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    return 0
