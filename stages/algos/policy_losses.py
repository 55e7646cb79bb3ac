"""PPO losses in one file (verl `verl/trainer/ppo/core_algos.py`): `agg_loss` (verl `agg_loss`), the
registry of policy losses by `actor.policy_loss.loss_mode` (verl `register_policy_loss` /
`POLICY_LOSS_REGISTRY`), the vanilla loss and every other verl mode, the value loss and entropy.

Normalisers. verl's legacy workers aggregate each micro-batch with its *local* token/row counts and
scale by rows_in_micro/rows_in_mini (docs/verl-semantics.md §4, "loss_agg_mode"), which for
token-mean is not the mini-batch's token mean. Here `agg_loss` also takes the mini-batch's global
counts: with `global_tokens` = valid tokens of the whole mini-batch over all ranks (or
`global_rows` = rows with >= 1 valid token, for the seq-mean modes) and `dp_size` = number of
ranks whose gradients are averaged, each micro-batch's loss is sum(L*m)/global_tokens*dp_size;
summing micro-batches and averaging ranks then gives exactly the single-call value over the
mini-batch, however it is split (verl's engine path, `global_batch_info`; docs/verl-semantics.md §4).

The policy-loss signature (verl's newer one, `PolicyLossFn`):
    fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
       config=None, rollout_is_weights=None, **agg) -> (pg_loss, metrics)
`config` is the actor's config section (actor_rollout_ref.actor as a dict: clip_ratio*, tau_*,
policy_loss.*; missing keys take verl's dataclass defaults), `agg` the normalisers above
(global_tokens, global_rows, dp_size, loss_scale_factor) and `metrics` a dict of floats named as
verl names them without the "actor/" prefix (pg_clipfrac, ppo_kl, pg_clipfrac_lower: each a
mean over the call's valid tokens).
"""
from __future__ import annotations

from typing import Callable

import torch

from stages.algos.advantages import masked_mean



AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

POLICY_LOSSES: dict[str, Callable] = {}


def register_policy_loss(name: str) -> Callable[[Callable], Callable]:
    """Decorator: the policy loss for actor.policy_loss.loss_mode = name (verl register_policy_loss)."""
    def decorator(fn: Callable) -> Callable:
        POLICY_LOSSES[name] = fn
        return fn
    return decorator


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, *,
             global_tokens: float | None = None, global_rows: float | None = None,
             dp_size: int = 1, loss_scale_factor: float | None = None) -> torch.Tensor:
    """Aggregate a (bs, T) loss matrix: token-mean, seq-mean-token-{sum,mean}, seq-mean-token-sum-norm (docs/verl-semantics.md §4).

    token-mean:              sum(L*m) / (global_tokens or sum(m)) * dp_size
    seq-mean-token-sum:      sum_i sum_t L*m / (global_rows or #rows with tokens) * dp_size
    seq-mean-token-mean:     sum_i [sum_t L*m / (n_i + 1e-8)] / (global_rows or #rows) * dp_size
    seq-mean-token-sum-norm: sum_i sum_t L*m / (loss_scale_factor or T) * dp_size
    Deviation: verl 0.7 ignores dp_size in the -norm mode; with the default dp_size=1 they agree,
    with dp_size>1 ours keeps the rank-averaged value equal to the single-call value.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        tokens = mask.sum() if global_tokens is None else global_tokens
        return (loss_mat * mask).sum() / tokens * dp_size
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        tokens_per_row = mask.sum(dim=-1)
        seq_losses = (loss_mat * mask).sum(dim=-1)
        if mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (tokens_per_row + 1e-8)
        row_has_tokens = (tokens_per_row > 0).to(loss_mat.dtype)
        rows = row_has_tokens.sum() if global_rows is None else global_rows
        return (seq_losses * row_has_tokens).sum() / rows * dp_size
    if mode == "seq-mean-token-sum-norm":
        norm = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return (loss_mat * mask).sum(dim=-1).sum() / norm * dp_size
    raise ValueError(f"Invalid loss_agg_mode: {mode}. Known modes: {', '.join(AGG_MODES)}")


def clip_range(config: dict | None) -> tuple[float, float]:
    """(ε_low, ε_high): clip_ratio_low / clip_ratio_high, each falling back to clip_ratio when null
    (verl: `config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio`)."""
    config = config or {}
    clip = config.get("clip_ratio", 0.2)
    low, high = config.get("clip_ratio_low"), config.get("clip_ratio_high")
    return (clip if low is None else low), (clip if high is None else high)


def policy_loss_key(config: dict | None, key: str, default: float, if_null: float | None = None) -> float:
    """actor.policy_loss.<key>: `default` when absent (verl's PolicyLossConfig default), `if_null`
    (verl's `x if x is not None else ...` in the loss function) when null."""
    section = (config or {}).get("policy_loss") or {}
    value = section.get(key, default)
    return (default if if_null is None else if_null) if value is None else value


# --------------------------------------------------------------------------- vanilla, value loss, entropy
@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, *,
                                loss_agg_mode: str = "token-mean", config: dict | None = None,
                                rollout_is_weights=None, **agg):
    """PPO clip: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), for A<0 capped at -A c (dual clip).

    verl `compute_policy_loss_vanilla`. r = exp(clamp(logp - old_logp, -20, 20)); eps_low/eps_high
    from config clip_ratio_low/high (clip_ratio where null), c = config clip_ratio_c (default 3,
    must be > 1). The per-token losses (times rollout_is_weights) are aggregated by agg_loss with
    loss_agg_mode and the normalisers in `agg`. Metrics: pg_clipfrac (clipped tokens),
    pg_clipfrac_lower (dual-clipped tokens), ppo_kl = mean(-log r), over valid tokens.
    """
    config = config or {}
    clip_ratio_low, clip_ratio_high = clip_range(config)
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    if not clip_ratio_c > 1.0:
        raise AssertionError("The lower bound of the clip_ratio_c for dual-clip PPO should be "
                             f"greater than 1.0, but get the value: {clip_ratio_c}.")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_clip = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).to(mask.dtype), mask)

    loss_dual = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((torch.gt(loss_clip, loss_dual) & negative).to(mask.dtype), mask)
    pg_losses = torch.where(negative, torch.minimum(loss_clip, loss_dual), loss_clip)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, **agg)
    return pg_loss, {"pg_clipfrac": pg_clipfrac.item(), "ppo_kl": ppo_kl.item(),
                     "pg_clipfrac_lower": pg_clipfrac_lower.item()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) * z over the last dim (verl's entropy_from_logits)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def compute_value_loss(vpreds, returns, values, mask, cliprange_value: float = 0.5,
                       loss_agg_mode: str = "token-mean", **agg_kwargs):
    """0.5 * agg(max((v - R)^2, (clamp(v, v_old - c, v_old + c) - R)^2)); returns (vf_loss, vf_clipfrac)."""
    mask = mask.to(vpreds.dtype)
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), mask, loss_agg_mode,
                             **agg_kwargs)
    vf_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).to(vpreds.dtype), mask)
    return vf_loss, vf_clipfrac


# registered in verl but not provided here: refused by name rather than silently replaced
# (bypass_mode needs verl's rollout-correction helper: rollout log-probs as the old ones, IS and
# rejection masks inside the loss)
_VERL_ONLY_POLICY_LOSSES = ("bypass_mode",)


def get_policy_loss(name: str) -> Callable:
    """The policy loss for actor.policy_loss.loss_mode = name."""
    if name in POLICY_LOSSES:
        return POLICY_LOSSES[name]
    if name in _VERL_ONLY_POLICY_LOSSES:
        raise NotImplementedError(f"policy loss_mode {name!r} exists in verl but is not implemented "
                                  f"in stagerl; available: {', '.join(POLICY_LOSSES)}")
    raise ValueError(f"Unknown policy loss_mode {name!r}; available: {', '.join(POLICY_LOSSES)}")


# --------------------------------------------------------------------------- verl's other loss modes
def _weighted(pg_losses, rollout_is_weights):
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, *,
                             loss_agg_mode: str = "seq-mean-token-mean", config: dict | None = None,
                             rollout_is_weights=None, **agg):
    """GSPO (verl `compute_policy_loss_gspo`, arXiv 2507.18071): a sequence-level ratio.

    s_i = exp(mean over row i's valid tokens of (logp - old_logp)); each token's ratio is
    s_i,t = exp(min(sg[log s_i] + logp - sg[logp], 10)): the value s_i, the gradient of a token
    term. Loss per token max(-A s, -A clip(s, 1-eps_low, 1+eps_high)) (no dual clip, no ±20 clamp),
    eps from clip_ratio_low/high (clip_ratio where null). Aggregation: always seq-mean-token-mean,
    whatever loss_agg_mode says (verl hard-codes it); global_rows and dp_size apply, global_tokens
    and loss_scale_factor are unused. Metrics: pg_clipfrac, ppo_kl = mean(-log r) per token,
    pg_clipfrac_lower = 0.
    """
    clip_ratio_low, clip_ratio_high = clip_range(config)
    mask = response_mask.to(log_prob.dtype)
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = mask.sum(dim=-1).clamp(min=1)
    negative_approx_kl_seq = (negative_approx_kl * mask).sum(dim=-1) / seq_lengths
    log_seq_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))
    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = _weighted(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, mask, "seq-mean-token-mean", **agg)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(mask.dtype), mask)
    ppo_kl = masked_mean(-negative_approx_kl, mask)
    return pg_loss, {"pg_clipfrac": pg_clipfrac.item(), "ppo_kl": ppo_kl.item(), "pg_clipfrac_lower": 0.0}


@register_policy_loss("sapo")
def compute_policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask, *,
                             loss_agg_mode: str = "seq-mean-token-mean", config: dict | None = None,
                             rollout_is_weights=None, **agg):
    """SAPO (verl `compute_policy_loss_sapo`, arXiv 2511.20347): a smooth gate instead of a clip.

    r = exp(clamp(logp - old_logp, ±20)); f(r) = sigmoid(tau (r - 1)) * 4 / tau with tau = config
    tau_pos (default 1.0) where A > 0, tau_neg (default 1.05) where A <= 0; loss per token -f(r) A.
    Aggregation: always seq-mean-token-mean, whatever loss_agg_mode says (verl hard-codes it);
    global_rows and dp_size apply. Metrics: ppo_kl = mean(-log r); pg_clipfrac and
    pg_clipfrac_lower are 0 (verl reports zeros: nothing is clipped).
    """
    config = config or {}
    tau_pos = torch.as_tensor(config.get("tau_pos", 1.0), dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(config.get("tau_neg", 1.05), dtype=advantages.dtype, device=advantages.device)
    mask = response_mask.to(log_prob.dtype)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = _weighted(-gates * advantages, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, mask, "seq-mean-token-mean", **agg)
    ppo_kl = masked_mean(-negative_approx_kl, mask)
    return pg_loss, {"pg_clipfrac": 0.0, "ppo_kl": ppo_kl.item(), "pg_clipfrac_lower": 0.0}


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, *,
                            loss_agg_mode: str = "token-mean", config: dict | None = None,
                            rollout_is_weights=None, **agg):
    """GPG (verl `compute_policy_loss_gpg`): plain policy gradient, loss per token -logp A (no ratio:
    old_log_prob is unused), aggregated with loss_agg_mode and every normaliser. No metrics (verl
    returns none)."""
    pg_losses = _weighted(-log_prob * advantages, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **agg), {}


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask, *,
                                 loss_agg_mode: str = "token-mean", config: dict | None = None,
                                 rollout_is_weights=None, **agg):
    """Clip-Cov (verl `compute_policy_loss_clip_cov`, arXiv 2505.22617): PPO clip without dual clip
    or ±20 clamp, plus the gradient of a few high-covariance tokens removed.

    cov = (A - mean A) (logp - mean logp) over the call's valid tokens. Candidates: valid tokens
    the PPO clip did not clip with clip_cov_lb < cov < clip_cov_ub (policy_loss.clip_cov_lb/ub,
    defaults 1 and 5); max(1, int(clip_cov_ratio * valid tokens)) of them (policy_loss.
    clip_cov_ratio, default 0.0002, must be > 0), drawn at random (torch.randperm, the global
    RNG) when there are more, get loss 0. Aggregation: loss_agg_mode with every normaliser; but
    the means and the number of tokens drawn are those of this call (a micro-batch, as in verl),
    so the loss depends on how the mini-batch is split. Metrics: pg_clipfrac = fraction of valid
    tokens zeroed, ppo_kl = mean(-log r).
    """
    clip_cov_ratio = policy_loss_key(config, "clip_cov_ratio", 0.0002)
    clip_cov_lb = policy_loss_key(config, "clip_cov_lb", 1.0)
    clip_cov_ub = policy_loss_key(config, "clip_cov_ub", 5.0)
    if not clip_cov_ratio > 0:
        raise AssertionError("clip_ratio should be larger than 0.")
    cliprange_low, cliprange_high = clip_range(config)
    mask = response_mask.to(log_prob.dtype)
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_by_origin = (pg_losses2 > pg_losses1) & (mask > 0)

    logp = log_prob.detach()
    cov_all = (advantages - masked_mean(advantages, mask)) * (logp - masked_mean(logp, mask))
    cov_all[mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < clip_cov_ub) & (cov_all > clip_cov_lb) & (mask > 0))
    if len(top_k_idx) > 0:
        perm = torch.randperm(len(top_k_idx))
        top_k_idx = top_k_idx[perm[: min(clip_num, len(top_k_idx))]]
    corr = torch.ones_like(advantages)
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    pg_clipfrac = masked_mean((corr == 0).to(mask.dtype), mask)

    pg_losses = _weighted(torch.maximum(pg_losses1, pg_losses2) * corr, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, **agg)
    return pg_loss, {"pg_clipfrac": pg_clipfrac.item(), "ppo_kl": ppo_kl.item()}


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask, *,
                               loss_agg_mode: str = "token-mean", config: dict | None = None,
                               rollout_is_weights=None, **agg):
    """KL-Cov (verl `compute_policy_loss_kl_cov`, arXiv 2505.22617): unclipped -A r, plus a KL
    penalty on the highest-covariance tokens.

    r = exp(logp - old_logp) (no clamp). cov = (A - mean A)(logp - mean logp) over the call's valid
    tokens; the max(1, int(kl_cov_ratio * valid tokens)) largest (torch.topk; policy_loss.
    kl_cov_ratio, default 0.0002, must be > 0) get loss -A r + ppo_kl_coef |log r|
    (policy_loss.ppo_kl_coef, default 0.1). Aggregation: loss_agg_mode with every normaliser; the
    selection is per call (a micro-batch, as in verl), so the loss depends on the split.
    Metrics: ppo_kl = mean |log r| (verl reports the absolute value under that name).
    """
    kl_cov_ratio = policy_loss_key(config, "kl_cov_ratio", 0.0002)
    ppo_kl_coef = policy_loss_key(config, "ppo_kl_coef", 0.1, if_null=1.0)
    if not kl_cov_ratio > 0:
        raise AssertionError("kl_cov_ratio should be larger than 0.")
    mask = response_mask.to(log_prob.dtype)
    negative_approx_kl = log_prob - old_log_prob
    abs_kl = negative_approx_kl.abs()
    ratio = torch.exp(negative_approx_kl)
    ppo_kl_abs = masked_mean(abs_kl, mask)
    pg_losses1 = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * abs_kl

    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    selected = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    if len(valid_idx) > 0:
        adv = advantages[valid].detach().reshape(-1).cpu()
        logp = log_prob[valid].detach().reshape(-1).cpu()
        cov = (adv - adv.mean()) * (logp - logp.mean())
        k = max(1, int(len(cov) * kl_cov_ratio))
        selected[valid_idx[torch.topk(cov, k, largest=True).indices.to(valid_idx.device)]] = True
    pg_losses = torch.where(selected.reshape(valid.shape), pg_losses_kl, pg_losses1)
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), mask, loss_agg_mode, **agg)
    return pg_loss, {"ppo_kl": ppo_kl_abs.item()}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask, *,
                                 loss_agg_mode: str = "token-mean", config: dict | None = None,
                                 rollout_is_weights=None, global_rows: float | None = None,
                                 dp_size: int = 1, **_unused):
    """GMPO (verl `compute_policy_loss_geo_mean`, arXiv 2507.20673): the geometric mean of the
    token ratios of a row.

    Per token, log r = logp - old_logp (no clamp) is clipped on the advantage's side only:
    sgn(A) * min(sgn(A) log r, sgn(A) clamp(log r, -eps_low, eps_high)) (eps from clip_ratio_low/
    high). Row i: ratio_i = exp(mean of those over its valid tokens), A_i = mean of its A over
    valid tokens, loss_i = -A_i ratio_i (times the geometric mean of rollout_is_weights over the
    row). Aggregation: loss_agg_mode is not used (verl); verl takes torch.mean over the call's rows,
    i.e. sum_i loss_i / rows, counting a row with no valid token (loss 0) in `rows`. With
    global_rows given, rows = global_rows (the mini-batch's rows with >= 1 valid token) and the
    sum is multiplied by dp_size, so micro-batches and ranks add up to the mini-batch's row mean;
    global_tokens and loss_scale_factor are unused. Metrics: pg_clipfrac / pg_clipfrac_lower =
    fraction of valid tokens whose log r lies outside the clamp range with A > 0 / A < 0,
    ppo_kl = mean(-log r).
    """
    cliprange_low, cliprange_high = clip_range(config)
    mask = response_mask.to(log_prob.dtype)
    negative_approx_kl = log_prob - old_log_prob
    ppo_kl = masked_mean(-negative_approx_kl, mask)
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    negative_approx_kl_min = sgn_advantage * torch.min(sgn_advantage * negative_approx_kl,
                                                       sgn_advantage * negative_approx_kl_clamp)
    mask_sum = mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * mask).sum(dim=-1) / (mask_sum + 1e-8))
    advantage = (advantages * mask).sum(dim=-1) / (mask_sum + 1e-8)
    pg_losses = -advantage * ratio
    if rollout_is_weights is not None:
        pg_losses = pg_losses * torch.exp((torch.log(rollout_is_weights + 1e-10) * mask).sum(dim=-1)
                                          / (mask_sum + 1e-8))
    rows = pg_losses.shape[0] if global_rows is None else global_rows
    pg_loss = pg_losses.sum() / rows * dp_size

    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    pg_clipfrac = masked_mean((clipped & (advantages > 0)).to(mask.dtype), mask)
    pg_clipfrac_lower = masked_mean((clipped & (advantages < 0)).to(mask.dtype), mask)
    return pg_loss, {"pg_clipfrac": pg_clipfrac.item(), "ppo_kl": ppo_kl.item(),
                     "pg_clipfrac_lower": pg_clipfrac_lower.item()}


@register_policy_loss("cispo")
def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, *,
                              loss_agg_mode: str = "token-mean", config: dict | None = None,
                              rollout_is_weights=None, **agg):
    """CISPO (verl `compute_policy_loss_cispo`, arXiv 2506.13585): a clipped, stop-gradient
    importance weight on a REINFORCE term.

    r = exp(clamp(logp - old_logp, ±20)); loss per token -sg[clip(r, 1-eps_low, 1+eps_high)] A logp
    (eps from clip_ratio_low/high): every token keeps its gradient -w A. Aggregation:
    loss_agg_mode with every normaliser. Metrics: pg_clipfrac = fraction of valid tokens with
    r != clip(r), ppo_kl = mean(-log r), pg_clipfrac_lower = 0.
    """
    clip_ratio_low, clip_ratio_high = clip_range(config)
    mask = response_mask.to(log_prob.dtype)
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, mask)
    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = _weighted(-clipped_ratio.detach() * advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, **agg)
    pg_clipfrac = masked_mean((ratio != clipped_ratio).to(mask.dtype), mask)
    return pg_loss, {"pg_clipfrac": pg_clipfrac.item(), "ppo_kl": ppo_kl.item(), "pg_clipfrac_lower": 0.0}
