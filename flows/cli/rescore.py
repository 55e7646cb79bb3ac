"""`stagerl rescore EXP --steps A..B --reward FILE[:FN] [--as NEW [key=value ...]]`: score the
stored rollouts of steps A..B with another reward function, in the reward stage's scorer
processes with its per-sample timeout (reward.num_workers, reward.timeout_s, reward.strict of
EXP's config), and print how the new scores agree with the stored ones: per data source the rows,
both means and the rows whose score changed (raised, lowered), then examples of each kind.
Progress goes to stderr; a function that fails on more than --max-error-share of the rows (raising,
timing out after --timeout s, returning no number) or a rescore past --max-seconds stops with exit 1,
naming the error kinds and counts. Nothing is written. With `--as NEW` the new reward then trains: NEW is a fork of EXP at A:reward
with custom_reward_function set to FILE:FN (`stagerl fork`)."""
import sys

from flows.cli.args import add_experiment, add_json, add_overrides, add_root
from flows.read.inspect_lib import guarded

KINDS = ("raised", "lowered", "unchanged")
TOLERANCE = 1e-9  # a score that moved less than this counts as unchanged


def register(subparsers) -> None:
    p = subparsers.add_parser("rescore", help="score stored rollouts with another reward function "
                                              "and compare (--as NEW: train a fork with it)")
    add_experiment(p)
    p.add_argument("--steps", required=True, metavar="A..B", help="steps to rescore, e.g. 1..2 or 3")
    p.add_argument("--reward", required=True, metavar="FILE[:FN]",
                   help="Python file with the reward function (verl's custom_reward_function: "
                        "FN(data_source, solution_str, ground_truth, extra_info); FN defaults to "
                        "compute_score)")
    p.add_argument("--as", dest="as_new", default=None, metavar="NEW",
                   help="then train NEW: a fork of EXPERIMENT at A:reward with this reward")
    p.add_argument("--examples", type=int, default=2, help="examples shown of each kind (default 2)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds per row before it scores 0 as a timeout (default: the run's reward.timeout_s)")
    p.add_argument("--max-seconds", type=float, default=600.0, metavar="S",
                   help="stop (exit 1) when scoring takes longer than this in all (default 600)")
    p.add_argument("--max-error-share", type=float, default=0.5, metavar="F",
                   help="stop (exit 1) once more than this share of the rows scored so far errored "
                        "(raised, timed out, returned no number; default 0.5)")
    add_root(p)
    add_json(p, "the comparison")
    add_overrides(p, note="with --as, NEW's further ", trailing=True)
    p.set_defaults(func=run)


def parse_steps(text: str) -> list[int]:
    """'1..3' -> [1, 2, 3]; '2' -> [2]."""
    first, sep, last = str(text).partition("..")
    if not first.isdigit() or (sep and not last.isdigit()):
        raise ValueError(f"--steps {text!r}: give A..B or A (step numbers)")
    a, b = int(first), int(last) if sep else int(first)
    if a < 1 or b < a:
        raise ValueError(f"--steps {text!r}: need 1 <= A <= B")
    return list(range(a, b + 1))


def parse_reward(text: str) -> dict:
    """'path/to/file.py:fn' -> the reward stage's function spec (absolute path, name)."""
    import os

    path, sep, name = str(text).rpartition(":")
    if not sep or not name.isidentifier():  # no ':FN' (or a Windows-like path): the whole is the file
        path, name = text, "compute_score"
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ValueError(f"--reward {text!r}: no file {full}")
    return {"path": full, "name": name, "reward_kwargs": {}}


class RescoreFailed(RuntimeError):
    """The new reward function failed on too many rows, or scoring ran past --max-seconds."""


CHUNK = 64  # rows scored between two progress lines and checks


def error_kinds(errors: list) -> dict:
    """{kind: count} of scorer errors: timeout, raised, bad return value, worker died."""
    kinds: dict = {}
    for e in errors:
        kind = ("timeout" if e.startswith("timeout") else "bad return value" if e.startswith("reward function returned")
                else "worker died" if "died" in e else "raised")
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def rescore(view, steps: list, spec: dict, timeout: float | None = None, max_seconds: float | None = None,
            max_error_share: float = 1.0, progress=None) -> list[dict]:
    """One record per stored row of `steps`: step, row, uid, sample_index, data_source, response,
    old and new score, the new function's error (if any) and the kind of change. Rows are scored
    in chunks, `progress(text)` told after each; RescoreFailed (naming the error kinds and counts)
    once more than `max_error_share` of the rows scored so far errored, or past `max_seconds`."""
    import time

    from stages.reward import scoring_rows
    from stages.scoring.pool import ScorerPool

    get = view.config_value
    key = get("data.reward_fn_key", "data_source") or "data_source"
    workers = max(1, int(get("reward.num_workers", 2)))  # a rescore always isolates the function
    timeout = float(timeout if timeout is not None else get("reward.timeout_s", 10.0))
    records, errors, t0 = [], [], time.monotonic()
    total = 0
    with ScorerPool(spec, workers, timeout) as pool:  # the reward stage's processes and timeout
        for step in steps:
            view.require(step, ["rollout", "reward"])
            rollout, reward = view.table(step, "rollout"), view.table(step, "reward")
            rows = scoring_rows(rollout, key)
            results = []
            for start in range(0, len(rows), CHUNK):
                part, _ = pool.score(rows[start:start + CHUNK], strict=bool(get("reward.strict", False)))
                results += part
                total += len(part)
                errors += [r["error"] for r in part if r.get("error")]
                elapsed = time.monotonic() - t0
                if progress is not None:
                    progress(f"rescore: step {step}, {len(results)}/{len(rows)} rows, {len(errors)} errors, "
                             f"{elapsed:.1f}s")
                kinds = ", ".join(f"{k} {n}" for k, n in error_kinds(errors).items())
                if len(errors) > max_error_share * total:
                    raise RescoreFailed(f"{len(errors)} of the {total} rows scored so far errored ({kinds}); "
                                        f"first: {errors[0]}")
                if max_seconds is not None and elapsed > max_seconds and start + CHUNK < len(rows):
                    raise RescoreFailed(f"scoring ran past --max-seconds {max_seconds:g} ({total} rows "
                                        f"scored, {len(errors)} errored{': ' + kinds if kinds else ''})")
            old = reward.column("score").to_pylist()
            rm = (reward.column("rm_score").to_pylist() if "rm_score" in reward.schema.names
                  else [None] * len(old))  # a reward model's part stays, as in the reward stage
            for i, (src, uid, idx, response, result) in enumerate(zip(
                    rollout.column(key).to_pylist(), rollout.column("uid").to_pylist(),
                    rollout.column("sample_index").to_pylist(), rollout.column("response").to_pylist(),
                    results)):
                new = float(result["score"]) + (rm[i] or 0.0)
                kind = ("raised" if new > old[i] + TOLERANCE else
                        "lowered" if new < old[i] - TOLERANCE else "unchanged")
                records.append({"step": step, "row": i, "uid": uid, "sample_index": idx,
                                "data_source": src, "response": response, "old": old[i], "new": new,
                                "error": result.get("error"), "kind": kind})
    return records


def agreement(records: list, examples: int = 2) -> dict:
    """Per data source and overall: rows, old and new mean, changed (raised + lowered); and up to
    `examples` rows of each kind."""
    def summary(rows):
        n = len(rows)
        out = {"rows": n, "old_mean": sum(r["old"] for r in rows) / n if n else None,
               "new_mean": sum(r["new"] for r in rows) / n if n else None,
               "errors": sum(1 for r in rows if r["error"])}
        for kind in KINDS:
            out[kind] = sum(1 for r in rows if r["kind"] == kind)
        out["changed"] = out["raised"] + out["lowered"]
        out["agreement"] = out["unchanged"] / n if n else None
        return out

    sources = sorted({str(r["data_source"]) for r in records})
    return {"by_source": {s: summary([r for r in records if str(r["data_source"]) == s]) for s in sources},
            "all": summary(records),
            "examples": {k: [r for r in records if r["kind"] == k][:examples] for k in KINDS}}


def print_agreement(name: str, steps: list, spec: dict, result: dict) -> None:
    print(f"rescore {name}, steps {steps[0]}..{steps[-1]}: stored score vs {spec['path']}:{spec['name']}")
    header = ("DATA SOURCE", "ROWS", "OLD MEAN", "NEW MEAN", "CHANGED", "RAISED", "LOWERED", "AGREE", "ERRORS")
    rows = [header] + [(s, str(v["rows"]), f"{v['old_mean']:.4f}", f"{v['new_mean']:.4f}", str(v["changed"]),
                        str(v["raised"]), str(v["lowered"]), f"{v['agreement']:.1%}", str(v["errors"]))
                       for s, v in [*result["by_source"].items(), ("(all)", result["all"])] if v["rows"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for kind in KINDS:
        for r in result["examples"][kind]:
            text = str(r["response"]).replace("\n", "\\n")
            print(f"  {kind:<9} step {r['step']} uid {r['uid']} sample {r['sample_index']}: "
                  f"{r['old']:g} -> {r['new']:g}  {text[:70]!r}" + (f"  error: {r['error']}" if r["error"] else ""))


@guarded
def run(args) -> int:
    import json

    from flows.read.inspect_lib import find_experiment
    from storage.run_view import RunView

    steps, spec = parse_steps(args.steps), parse_reward(args.reward)
    store, root, project, experiment = find_experiment(args)
    view = RunView.open(store, project, experiment)
    say = lambda text: print(text, file=sys.stderr, flush=True)
    try:
        records = rescore(view, steps, spec, timeout=args.timeout, max_seconds=args.max_seconds,
                          max_error_share=args.max_error_share, progress=say)
    except RescoreFailed as exc:
        print(f"error: rescore of {view.name} stopped: {exc}", file=sys.stderr)
        return 1
    result = agreement(records, args.examples)
    if args.json:
        print(json.dumps({"experiment": view.name, "steps": steps, "reward": spec, **result},
                         indent=2, default=str))
    else:
        print_agreement(view.name, steps, spec, result)
    if not args.as_new:
        return 0
    from flows.cli.fork import start_fork

    overrides = [f"custom_reward_function.path={spec['path']}",
                 f"custom_reward_function.name={spec['name']}", *args.overrides]
    return start_fork(f"{project}/{experiment}", args.as_new, f"{steps[0]}:reward", overrides, root)
