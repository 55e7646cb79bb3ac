"""Advantage estimators: the registry of `algorithm.adv_estimator` names and every estimator, in one
file (verl's `verl/trainer/ppo/core_algos.py`: `register_adv_est` / `ADV_ESTIMATOR_REGISTRY`).

Calling convention is verl's: padded (bs, T) tensors, `response_mask` 1 on valid response tokens,
`index` = the uid of each row (rows of one prompt share it). Every estimator returns
`(advantages, returns)`, both (bs, T) and zero on padding. Outcome estimators use
s_i = sum_t token_level_rewards[i, t]. An estimator declares what it needs beyond rewards, mask and
index (`register_adv_estimator(name, needs=..., min_group=...)`); the plan and the stages read the
declaration (estimator_needs), nothing tests an estimator's name.

Where verl differs between two estimators that look alike, these follow verl, not each other:
- rloo_vectorized gives a prompt answered once (a group of 1) the advantage 0; rloo gives it s_i.
- grpo_vectorized floors the group variance at epsilon (std = sqrt(max(var, eps))); grpo does not.
  Both give 0 to groups whose rewards are all equal, and s_i/(1 + eps) to groups of 1.

A leaf of stages/algos/: torch only (configs/ imports it to read the declarations).
"""
from __future__ import annotations

import inspect
from typing import Callable, Sequence

import torch




# --------------------------------------------------------------------------- masked statistics
def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask) / (sum(mask) + 1e-8), over `dim` or everything (verl's masked_mean)."""
    if dim is None:
        return (values * mask).sum() / (mask.sum() + 1e-8)
    return (values * mask).sum(dim) / (mask.sum(dim) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """masked_mean((x - masked_mean(x))^2) * n/(n-1) with n = sum(mask) (Bessel; verl's masked_var)."""
    centered = values - masked_mean(values, mask)
    variance = masked_mean(centered**2, mask)
    if unbiased:
        n = mask.sum()
        if n == 0:
            raise ValueError("masked_var: the mask selects no element; at least one must be 1 "
                             "(a batch with no valid response token)")
        if n == 1:
            raise ValueError("masked_var: the mask selects exactly one element, so the unbiased "
                             "variance n/(n-1) divides by zero (whitening needs >= 2 valid tokens)")
        variance = variance * (n / (n - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - masked_mean(x)) / sqrt(masked_var(x) + 1e-8) over all valid entries (verl's masked_whiten)."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


# --------------------------------------------------------------------------- helpers
def float_mask(response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if response_mask.shape != like.shape:
        raise ValueError(f"response_mask shape {tuple(response_mask.shape)} != rewards shape "
                         f"{tuple(like.shape)}")
    return response_mask.to(like.dtype)


def group_rows(index: Sequence, bs: int) -> dict:
    """uid -> list of row numbers, in first-seen order."""
    if index is None:
        raise ValueError("this estimator needs `index` (the uid of each row) to form groups")
    if len(index) != bs:
        raise ValueError(f"index has {len(index)} entries but the batch has {bs} rows")
    groups: dict = {}
    for row, uid in enumerate(index):
        groups.setdefault(uid.item() if hasattr(uid, "item") else uid, []).append(row)
    return groups


def group_ids(index: Sequence, bs: int) -> torch.Tensor:
    """(bs,) long tensor of group numbers 0..G-1, in first-seen order (verl's as_torch_index
    factorises the uids too; the numbering does not change any estimator's result)."""
    ids = torch.empty(bs, dtype=torch.long)
    for number, rows in enumerate(group_rows(index, bs).values()):
        ids[rows] = number
    return ids


# --------------------------------------------------------------------------- the registry
ADV_ESTIMATORS: dict[str, Callable] = {}
# What an estimator may need beyond rewards, mask and index, and who provides it:
NEEDS = (
    "values",          # critic values (bs, T): the plan adds the critic, the logprob stage computes them
    "baseline",        # reward_baselines (bs,): the rollout stage adds one greedy answer per prompt
                       # (rollout/baseline.parquet), the reward stage scores it (reward/baseline.parquet)
    "old_log_probs",   # the policy's log-probs (bs, T) at advantage time: the plan keeps the logprob
                       # stage's separate actor pass
    "sum_pi_squared",  # sum over the vocabulary of pi^2 per response token (bs, T): the logprob
                       # stage's actor pass stores it beside old_log_probs
)


def register_adv_estimator(name: str, needs: tuple[str, ...] = (), min_group: int = 1) -> Callable:
    """Register `fn` as algorithm.adv_estimator=name, declaring what it `needs` (see NEEDS). The
    plan and the stages read the declaration (stages.algos.advantages.estimator_needs); nothing tests
    an estimator's name. The estimator receives the inputs it names in its signature:
    values, reward_baselines, old_log_probs, sum_pi_squared (and index, gamma, lam,
    norm_adv_by_std_in_grpo). `min_group`: the fewest answers per prompt it accepts (the plan
    refuses a smaller actor_rollout_ref.rollout.n, which verl only finds at the first step)."""
    unknown = set(needs) - set(NEEDS)
    if unknown:
        raise ValueError(f"estimator {name!r}: unknown needs {sorted(unknown)}; known: {', '.join(NEEDS)}")

    def register(fn: Callable) -> Callable:
        if ADV_ESTIMATORS.get(name, fn) is not fn:  # verl's register_adv_est refuses it too
            raise ValueError(f"adv_estimator {name!r} is already registered ({ADV_ESTIMATORS[name].__name__})")
        fn.needs = frozenset(needs)
        fn.min_group = int(min_group)
        ADV_ESTIMATORS[name] = fn
        return fn

    return register


# --------------------------------------------------------------------------- verl's first estimators
@register_adv_estimator("grpo")
def compute_grpo_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                           norm_adv_by_std_in_grpo: bool = True):
    """A_i = (s_i - mean_g)/(std_g + eps), std unbiased; group of 1: mean 0, std 1; Dr.GRPO: s_i - mean_g."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = torch.empty_like(scores)
        groups = list(group_rows(index, scores.shape[0]).values())
        if len({len(rows) for rows in groups}) == 1 and len(groups[0]) > 1:
            # every group of one size (rollout.n): all groups at once, a row of a (G, n) matrix
            # each; per-row mean/std reduce in the same order as one group's (equal bit for bit)
            rows = torch.tensor(groups)
            group = scores[rows]
            mean, std = group.mean(dim=1, keepdim=True), group.std(dim=1, keepdim=True)
            adv[rows] = (group - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else group - mean
        else:
            for rows in groups:
                group = scores[rows]
                if len(rows) == 1:
                    mean, std = torch.tensor(0.0), torch.tensor(1.0)
                else:
                    mean, std = group.mean(), group.std()  # torch.std is unbiased (n - 1)
                adv[rows] = (group - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else group - mean
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("rloo")
def compute_rloo_advantage(token_level_rewards, response_mask, index):
    """A_i = s_i*K/(K-1) - mean_g*K/(K-1) (= s_i - mean of the other K-1 rows); K = 1: A_i = s_i."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = scores.clone()
        for rows in group_rows(index, scores.shape[0]).values():
            k = len(rows)
            if k > 1:
                adv[rows] = scores[rows] * k / (k - 1) - scores[rows].mean() * k / (k - 1)
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(token_level_rewards, response_mask, gamma: float = 1.0):
    """G_t = r_t + gamma*G_{t+1} (running return reset by mask); A = masked_whiten(G) * mask; returns = G."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            running = token_level_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = running * mask[:, t]  # reset past EOS
        adv = masked_whiten(returns, mask) * mask
    return adv, returns * mask


@register_adv_estimator("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_advantage(token_level_rewards, response_mask, index):
    """A = masked_whiten((s_i - mean_g) broadcast * mask) * mask; group of 1: mean 0; returns = A."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        centered = scores.clone()
        for rows in group_rows(index, scores.shape[0]).values():
            if len(rows) > 1:
                centered[rows] = scores[rows] - scores[rows].mean()
        adv = centered.unsqueeze(-1).expand_as(mask) * mask
        adv = masked_whiten(adv, mask) * mask
    return adv, adv


@register_adv_estimator("gae", needs=("values",))
def compute_gae_advantage(token_level_rewards, response_mask, values, gamma: float = 1.0,
                          lam: float = 1.0):
    """delta_t = r_t + gamma*V_{t+1} - V_t, A_t = delta_t + gamma*lam*A_{t+1}; returns = A + V; A whitened."""
    mask = float_mask(response_mask, token_level_rewards)
    if values is None or values.shape != token_level_rewards.shape:
        raise ValueError("gae needs `values` (the critic's, shape (bs, T) like the rewards)")
    with torch.no_grad():
        next_value = torch.zeros_like(token_level_rewards[:, 0])
        last_gae = torch.zeros_like(next_value)
        reversed_adv = []
        for t in reversed(range(token_level_rewards.shape[1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            # padding positions carry the next valid value / advantage through unchanged
            next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
            last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
            reversed_adv.append(last_gae)
        adv = torch.stack(reversed_adv[::-1], dim=1)
        returns = adv + values
        adv = masked_whiten(adv, mask)
    return adv * mask, returns * mask


# --------------------------------------------------------------------------- verl's further estimators (volcengine/verl b178a3c)
def _group_sums(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-group sums (G,) of a (bs,) tensor (verl: index_add_ / bincount with weights)."""
    groups = int(ids.max()) + 1 if ids.numel() else 0
    return torch.zeros(groups, dtype=values.dtype).index_add_(0, ids, values)


@register_adv_estimator("grpo_vectorized")
def compute_grpo_vectorized_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                                      norm_adv_by_std_in_grpo: bool = True):
    """verl compute_grpo_vectorized_outcome_advantage (with verl.utils.groupwise.group_mean_std):
    per group, in float32, mean = S1/c and std = sqrt(max((S2 - S1^2/c)/max(c-1, 1), eps)), S1 = sum s,
    S2 = sum s^2; groups of 1: mean 0, std 1. A_i = (s_i - mean)/(std + eps), or s_i - mean when
    norm_adv_by_std_in_grpo is false; broadcast over the valid tokens."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1).to(torch.float32)
        ids = group_ids(index, scores.shape[0])
        count = _group_sums(torch.ones_like(scores), ids)
        s1, s2 = _group_sums(scores, ids), _group_sums(scores * scores, ids)
        mean = s1 / count.clamp_min(1.0)
        var = (s2 - s1 * s1 / count.clamp_min(1.0)) / (count - 1.0).clamp_min(1.0)
        std = torch.sqrt(torch.clamp(var, min=epsilon))
        single = count <= 1.0
        mean, std = torch.where(single, 0.0, mean), torch.where(single, 1.0, std)
        if norm_adv_by_std_in_grpo:
            scalars = (scores - mean[ids]) / (std[ids] + epsilon)
        else:
            scalars = scores - mean[ids]
        adv = scalars.to(token_level_rewards.dtype).unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("rloo_vectorized")
def compute_rloo_vectorized_advantage(token_level_rewards, response_mask, index):
    """verl compute_rloo_vectorized_outcome_advantage: with c the group's size and S its score sum,
    A_i = (c*s_i - S)/max(c-1, 1) * [c > 1] (= s_i minus the mean of the other c-1); a group of 1
    gets 0 (rloo gives it s_i)."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        ids = group_ids(index, scores.shape[0])
        c = _group_sums(torch.ones_like(scores), ids)[ids]
        adv = ((c * scores - _group_sums(scores, ids)[ids]) / (c - 1).clamp_min(1)) * (c > 1)
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("opo")
def compute_opo_advantage(token_level_rewards, response_mask, index):
    """verl compute_opo_outcome_advantage (OPO, arXiv 2505.23585): the group's length-weighted mean
    b = sum_j L_j s_j / sum_j L_j (L_j = valid tokens of row j) is the baseline, A_i = s_i - b;
    a group of 1: b = 0. A group of several rows with no valid token at all (verl: 0/0 = NaN) is
    refused."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        lengths = mask.sum(dim=-1)
        scores = token_level_rewards.sum(dim=-1)
        adv = scores.clone()
        for uid, rows in group_rows(index, scores.shape[0]).items():
            if len(rows) == 1:
                continue
            total = lengths[rows].sum()
            if total == 0:
                raise ValueError(f"opo: the {len(rows)} responses of group {uid!r} have no valid token; "
                                 "the length-weighted baseline is 0/0")
            adv[rows] = scores[rows] - (lengths[rows] * scores[rows]).sum() / total
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("grpo_passk", min_group=2)
def compute_grpo_passk_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                                 norm_adv_by_std_in_grpo: bool = True):
    """verl compute_grpo_passk_outcome_advantage (Pass@k training, arXiv 2503.19595): in each group
    only the best answer (torch.topk's first) gets a non-zero advantage, r_max - r_second_max,
    divided by (std of the group's scores (unbiased) + eps) when norm_adv_by_std_in_grpo; every
    other answer gets 0. A group needs at least 2 answers (actor_rollout_ref.rollout.n >= 2)."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = torch.zeros_like(scores)
        for uid, rows in group_rows(index, scores.shape[0]).items():
            group = scores[rows]
            if len(rows) < 2:
                raise ValueError(f"grpo_passk needs at least 2 samples per group (actor_rollout_ref.rollout.n "
                                 f">= 2); group {uid!r} has {len(rows)}")
            top, top_idx = torch.topk(group, 2)
            advantage = top[0] - top[1]
            if norm_adv_by_std_in_grpo:
                advantage = advantage / (torch.std(group) + epsilon)
            adv[rows[int(top_idx[0])]] = advantage
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("gpg")
def compute_gpg_advantage(token_level_rewards, response_mask, index, f_norm: float = 1.0):
    """verl compute_gpg_outcome_advantage (GPG, arXiv 2504.02546): alpha = bs / max(M, 1) with M the
    number of rows of the whole batch whose score is non-zero; A_i = alpha * (s_i - mean_g) / f_norm,
    mean_g the group's mean (a group of 1: 0). verl's trainer never passes f_norm (1.0) and
    overwrites its `alpha` argument, so neither is a config key."""
    mask = float_mask(response_mask, token_level_rewards)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
        adv = scores.clone()
        for rows in group_rows(index, scores.shape[0]).values():
            mean = scores[rows].mean() if len(rows) > 1 else 0.0
            adv[rows] = alpha * (scores[rows] - mean) / f_norm
        adv = adv.unsqueeze(-1) * mask
    return adv, adv


@register_adv_estimator("remax", needs=("baseline",))
def compute_remax_advantage(token_level_rewards, response_mask, reward_baselines):
    """verl compute_remax_outcome_advantage (ReMax, arXiv 2310.10505): returns G_t = sum_{t'>=t}
    r_t' * m_t' (reward-to-go of the masked rewards), A_t = G_t - b * m_t with b = reward_baselines,
    the score of a greedy answer to the same prompt (one per row: that row's prompt's). With an
    outcome reward (and no KL in reward) G_t = s_i on every valid token, so A = s_i - b."""
    mask = float_mask(response_mask, token_level_rewards)
    baselines = torch.as_tensor(reward_baselines, dtype=token_level_rewards.dtype)
    if baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(f"remax: reward_baselines has shape {tuple(baselines.shape)}, expected one per row "
                         f"({token_level_rewards.shape[0]},)")
    with torch.no_grad():
        returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - baselines.unsqueeze(-1) * mask
    return advantages, returns


@register_adv_estimator("optimal_token_baseline", needs=("old_log_probs", "sum_pi_squared"))
def compute_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs,
                                             sum_pi_squared, rollout_is_weights=None,
                                             handle_zero_tail: bool = False, epsilon: float = 1e-8):
    """verl compute_optimal_token_baseline_advantage (OTB, verl docs/algo/otb.md): G_t = reward-to-go
    of the masked rewards; per token w_t = 1 - 2*pi_t + sum_v pi_v^2 (pi_t = exp(old_log_prob_t)),
    times rho_t^2 with rollout IS weights; W_t = sum_{j<=t} w_j m_j. Per group and position t:
    B_t = sum_i G_t W_t m_t / (sum_i W_t m_t + eps); A_t = (G_t - B_t) m_t; returns G. A group of 1
    has no baseline (A = G). handle_zero_tail (verl's default False; its trainer never sets it):
    the part of a group's single longest answer past the second longest gets B = 0."""
    mask = float_mask(response_mask, token_level_rewards)
    for name, value in (("old_log_probs", old_log_probs), ("sum_pi_squared", sum_pi_squared)):
        if value is None or value.shape != token_level_rewards.shape:
            raise ValueError(f"optimal_token_baseline needs `{name}` of shape (bs, T) like the rewards")
    with torch.no_grad():
        returns = (token_level_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
        if rollout_is_weights is not None:
            w = w * rollout_is_weights ** 2
        w_cum = (w * mask).cumsum(dim=-1)
        baselines = torch.zeros_like(returns)
        for rows in group_rows(index, returns.shape[0]).values():
            if len(rows) == 1:
                continue
            g, wc, m = returns[rows], w_cum[rows], mask[rows]
            baselines[rows] = ((g * wc * m).sum(dim=0) / ((wc * m).sum(dim=0) + epsilon)).expand(len(rows), -1)
            if handle_zero_tail:
                lengths = m.sum(dim=-1)
                ordered = torch.sort(lengths).values
                longest, second = int(ordered[-1]), int(ordered[-2])
                at_max = (lengths == longest).nonzero(as_tuple=True)[0]
                if at_max.numel() == 1 and longest > second:
                    baselines[rows[int(at_max[0])], second:] = 0.0
        advantages = (returns - baselines) * mask
    return advantages, returns


# --------------------------------------------------------------------------- lookups
def estimator_needs(name: str) -> frozenset:
    """What estimator `name` declared it needs (a subset of NEEDS)."""
    return get_adv_estimator(name).needs


def get_adv_estimator(name: str) -> Callable:
    """The registered estimator function for `algorithm.adv_estimator` = name."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"Unknown adv_estimator {name!r}; registered estimators: "
                         f"{', '.join(sorted(ADV_ESTIMATORS))} (Dr.GRPO is 'grpo' with "
                         "norm_adv_by_std_in_grpo=false)")
    return ADV_ESTIMATORS[name]


def compute_advantage(name: str, token_level_rewards, response_mask, **kwargs):
    """Call estimator `name`, passing only the keyword arguments it declares (index, values, gamma, ...)."""
    fn = get_adv_estimator(name)
    params = inspect.signature(fn).parameters
    return fn(token_level_rewards, response_mask, **{k: v for k, v in kwargs.items() if k in params})
