"""`stagerl plot`: PNG figures of a run written to its plots/ folder in the store (matplotlib, Agg).

    metrics.png                          reward, acc, KL, entropy, response length over steps (and,
                                         with trainer.staleness, the staleness and mean IS weight)
    response_length_step{K:06d}.png      histogram of response lengths of step K
    rank_load_step{K:06d}.png            real and padded tokens per update rank
    microbatch_tokens_step{K:06d}.png    tokens of each micro-batch against the token budget
    microbatch_tokens_logprob_{role}_step{K:06d}.png   the same for the logprob stage's forwards
                                         (actor, ref, critic), from update/microbatches.parquet
    branches_{A}_{B}....png              `stagerl plot A B ...`: the overview's curves of several
                                         runs overlaid (a run and its forks), fork points marked
Every axis gets an x and a y label; `save` refuses a figure with an unlabelled axis."""
from __future__ import annotations

import io

from flows.read.inspect_lib import overview_row, rank_balance, update_pass

OVER_STEPS = (("score/mean", "reward (score mean)"), ("acc/mean", "acc (mean)"),
              ("kl", "KL(old || ref), k1 token mean"), ("entropy", "entropy (token mean)"),
              ("response_length/mean", "response length (tokens)"))


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def axis_labels(fig) -> list:
    return [{"title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
             "lines": [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]}
            for ax in fig.get_axes() if ax.get_visible()]


def save(view, fig, name: str) -> dict:
    """Write `fig` as plots/{name} in the run's store folder; returns its key, url and labels."""
    labels = axis_labels(fig)
    unlabelled = [i for i, a in enumerate(labels) if not a["xlabel"] or not a["ylabel"]]
    if unlabelled:
        raise ValueError(f"plot {name}: axes {unlabelled} have no x or y label")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    _pyplot().close(fig)
    key = view.layout.plot(name)
    view.store.write_bytes(key, buf.getvalue())
    return {"name": name, "key": key, "url": view.store.url(key), "axes": labels}


def overview_rows(view, steps) -> list:
    rows = [overview_row(view, s) for s in steps]
    for r, s in zip(rows, steps):  # KL: the update's ppo_kl when the run has no reference
        if r.get("kl") is None and view.manifest(s, "update"):
            r["kl"] = view.update_metrics(s).get("actor/ppo_kl")
    return rows


def metrics_figure(view, steps):
    plt = _pyplot()
    rows = overview_rows(view, steps)
    panels = OVER_STEPS + ((("engine_kl", "KL(rollout engine || trainer)"),)  # when the rollout kept its log-probs
                           if any(r.get("engine_kl") is not None for r in rows) else ())
    if any(r.get("staleness") for r in rows):  # trainer.staleness: the lag and the IS weights it brings
        panels += (("staleness", "staleness (updates)"), ("is_weight/mean", "IS weight pi_old/pi_rollout (mean)"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(6, 2.2 * len(panels)), sharex=True)
    for ax, (key, label) in zip(axes, panels):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(label, fontsize=8)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    from matplotlib.ticker import MaxNLocator
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_title(f"{view.name}")
    return fig


def branches_figure(views):
    """The overview's curves of several runs on shared axes, one line per run; where a run is a
    fork of another one shown (run.json's lineage), a dotted line marks its fork step."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    fig, axes = plt.subplots(len(OVER_STEPS), 1, figsize=(6, 2.2 * len(OVER_STEPS)), sharex=True)
    names = {v.name for v in views}
    for i, view in enumerate(views):  # later runs dashed: where a fork equals its source both show
        rows = overview_rows(view, [s for s in view.steps() if view.manifest(s, "rollout")])
        for ax, (key, label) in zip(axes, OVER_STEPS):
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                    linestyle="-" if i == 0 else "--", label=view.layout.experiment)
            ax.set_ylabel(label, fontsize=8)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        lineage = view.lineage
        if lineage.get("source") in names:
            for ax in axes:
                ax.axvline(lineage["step"], color="grey", linestyle=":", linewidth=1,
                           label=f"_fork {view.layout.experiment}")
            axes[0].annotate(f"{view.layout.experiment}: fork at {lineage['at']}", (lineage["step"], 1),
                             xycoords=("data", "axes fraction"), fontsize=7, va="top")
    axes[0].legend(fontsize=7)
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_title(" vs ".join(v.layout.experiment for v in views))
    return fig


def length_histogram(view, step: int):
    plt = _pyplot()
    lengths = view.table(step, "rollout").column("response_length").to_pylist()
    limit = view.max_response_length or max(lengths or [1])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(lengths, bins=range(0, limit + 2), color="tab:blue", edgecolor="white")
    ax.axvline(limit, color="tab:red", linestyle="--", label=f"max_response_length={limit}")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("rows")
    ax.set_title(f"step {step}: response lengths ({len(lengths)} rows)")
    ax.legend(fontsize=8)
    return fig


def rank_load(view, step: int):
    plt = _pyplot()
    bal = rank_balance(view.table(step, "update"))
    ranks = [r["rank"] for r in bal["ranks"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.4
    ax.bar([r - width / 2 for r in ranks], [r["real_tokens"] for r in bal["ranks"]], width,
           label="real tokens")
    ax.bar([r + width / 2 for r in ranks], [r["padded_tokens"] for r in bal["ranks"]], width,
           label="padded tokens")
    ax.set_xticks(ranks)
    ax.set_xlabel("rank")
    ax.set_ylabel("tokens")
    ratio = bal["tokens_max_over_mean"]
    ax.set_title(f"step {step}: update load per rank (tokens max/mean "
                 f"{ratio:.3f})" if ratio else f"step {step}: update load per rank")
    ax.legend(fontsize=8)
    return fig


def token_budget(view, role: str):
    """(budget, label) of an update role's micro-batches: the plan's max_token_len_per_micro_batch
    of the role (ppo_max_token_len_per_gpu x sp, what stages.batches.binning bounds padded tokens
    by) when use_dynamic_bsz, else None (micro-batches are formed by row count)."""
    from storage.artifacts import read_run_json

    planned = ((read_run_json(view.store, view.layout) or {}).get("plan") or {}).get(role) or {}
    budget = planned.get("max_token_len_per_micro_batch") if planned.get("use_dynamic_bsz") else None
    return (int(budget), f"token budget {budget} (plan: ppo_max_token_len_per_gpu × sp)") if budget else (None, None)


def logprob_token_budget(view, step: int, role: str):
    """(budget, label) of a logprob role's micro-batches (the budget its manifest's loads record
    when they were token-budget micro-batches), else (None, None)."""
    from stages.logprob import BUDGET_KEYS

    name = role.split("/", 1)[1]
    loads = (view.stage_extra(step, "logprob").get("loads") or {}).get(name) or [{}]
    budget = loads[0].get("token_budget")
    return (int(budget), f"token budget {BUDGET_KEYS.get(name, 'of ' + name)}={budget}") if budget else (None, None)


def logprob_roles(table) -> list:
    """The logprob roles (logprob/actor, ...) whose micro-batches the update stage recorded."""
    roles = table.column("role").to_pylist() if "role" in table.schema.names else []
    return sorted({r for r in roles if r and r.startswith("logprob/")})


def microbatch_tokens(view, step: int, role: str | None = None):
    """Tokens of each micro-batch against the budget: an update role's first epoch (default: the
    policy's, the actor), or a logprob role's forward passes (role "logprob/actor", "logprob/ref",
    "logprob/critic")."""
    plt = _pyplot()
    from stages.training.roles import policy_role, role_named

    trained = policy_role() if role is None else role_named(role)  # None: a logprob pass
    role = trained.name if trained is not None else role
    table = view.table(step, "update")
    chosen = (update_pass(table, role) if trained is not None
              else [r for r in table.to_pylist() if r.get("role") == role])
    mbs = sorted(chosen, key=lambda r: (r["rank"], r.get("mini_batch") or 0, r["micro_batch"]))
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(mbs)), 3.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    xs = list(range(len(mbs)))
    ax.bar(xs, [m["padded_tokens"] for m in mbs], color="none", edgecolor="grey",
           label="padded tokens")
    ax.bar(xs, [m["real_tokens"] for m in mbs],
           color=[colors[m["rank"] % len(colors)] for m in mbs], label="real tokens (colour: rank)")
    budget, label = token_budget(view, role) if trained is not None else logprob_token_budget(view, step, role)
    if budget:
        ax.axhline(budget, color="tab:red", linestyle="--", label=label)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"r{m['rank']}.{m['micro_batch']}" for m in mbs], rotation=90, fontsize=7)
    ax.set_xlabel("micro-batch (rank.index)")
    ax.set_ylabel("tokens")
    ax.set_title(f"step {step}: {role} tokens per micro-batch" + (" (epoch 0)" if trained is not None else "")
                 + ("" if budget else " (static micro-batches: no token budget)"))
    ax.legend(fontsize=8)
    return fig


def make_plots(view, steps=None) -> list:
    """Every plot of the run (or of `steps`); returns what `save` returned for each."""
    all_steps = view.steps()
    chosen = all_steps if steps is None else steps
    if not any(view.manifest(s, "rollout") for s in chosen):
        raise LookupError(f"{view.name} has no step with a complete rollout yet: nothing to plot")
    out = [save(view, metrics_figure(view, [s for s in all_steps if view.manifest(s, "rollout")]),
                "metrics.png")]
    for step in chosen:
        if view.manifest(step, "rollout"):
            out.append(save(view, length_histogram(view, step),
                            f"response_length_step{step:06d}.png"))
        if view.manifest(step, "update"):
            out.append(save(view, rank_load(view, step), f"rank_load_step{step:06d}.png"))
            out.append(save(view, microbatch_tokens(view, step),
                            f"microbatch_tokens_step{step:06d}.png"))
            for role in logprob_roles(view.table(step, "update")):
                out.append(save(view, microbatch_tokens(view, step, role),
                                f"microbatch_tokens_{role.replace('/', '_')}_step{step:06d}.png"))
    return out

