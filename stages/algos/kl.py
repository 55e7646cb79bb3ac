"""KL estimators, KL-in-reward and KL coefficient controllers (verl: kl_penalty, FixedKLController and AdaptiveKLController
in verl/trainer/ppo/core_algos.py; apply_kl_penalty in verl/trainer/ppo/ray_trainer.py).

`kl_penalty(logp, ref_logp, kind)` is used both for KL in reward (`algorithm.kl_penalty`, with the
old log-probs) and for the actor's KL loss (`actor.kl_loss_type`, with the current log-probs).
"""
from __future__ import annotations

import numpy as np
import torch

from stages.algos.advantages import masked_mean

__all__ = ["KL_KINDS", "kl_penalty", "kl_penalty_forward", "apply_kl_penalty",
           "FixedKLController", "AdaptiveKLController", "make_kl_controller"]

KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty_forward(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """d = logp - ref_logp: kl/k1 d; abs |d|; mse/k2 d^2/2; low_var_kl/k3 clamp(e^x - x - 1, ±10), x = clamp(-d, ±20)."""
    if kind in ("kl", "k1"):
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref_logp).square()
    if kind in ("low_var_kl", "k3"):
        x = torch.clamp(ref_logp - logp, min=-20, max=20)
        return torch.clamp(torch.exp(x) - x - 1, min=-10, max=10)
    if kind == "full":
        raise NotImplementedError("kl_penalty 'full' (KL over the whole vocabulary) needs full "
                                  "logits and is not implemented (nor in verl)")
    raise ValueError(f"Unknown kl_penalty kind {kind!r}; known: {', '.join(KL_KINDS)}, "
                     "each optionally with a '+' suffix (straight-through k2 gradient)")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate; 'X+' = forward value of X with the gradient of k2 (straight-through).

    verl 0.7.0 passes the '+' name unstripped to the forward function and raises
    NotImplementedError (fixed in PyPI 0.8.0); here the suffix works as intended.
    """
    base = kind[:-1] if kind.endswith("+") else kind
    forward = kl_penalty_forward(logp, ref_logp, base)
    if not kind.endswith("+") or base in ("mse", "k2"):
        return forward
    k2 = 0.5 * (logp - ref_logp).square()
    return k2 - k2.detach() + forward.detach()


class FixedKLController:
    """Constant KL coefficient: value = kl_coef."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op."""

    def state_dict(self) -> dict:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_type(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019: coef *= 1 + clip(kl/target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"horizon must be larger than 0. Got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """value *= 1 + clip(current_kl/target - 1, -0.2, 0.2) * n_steps/horizon."""
        error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"type": "adaptive", "value": self.value, "target": self.target,
                "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        _check_type(state, "adaptive")
        self.value, self.target = float(state["value"]), float(state["target"])
        self.horizon = state["horizon"]


def _check_type(state: dict, expected: str) -> None:
    if state.get("type") != expected:
        raise ValueError(f"KL controller state of type {state.get('type')!r} cannot be loaded "
                         f"into a {expected!r} controller")


def make_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000):
    """algorithm.kl_ctrl.type fixed | adaptive -> controller (verl defaults: target 0.1, horizon 10000)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"Unknown kl_ctrl.type {kind!r}; known: fixed, adaptive")


def apply_kl_penalty(token_level_scores, old_logp, ref_logp, response_mask, kl_ctrl,
                     kind: str = "kl"):
    """rewards = scores - beta * kl_penalty(old, ref) * mask; current_kl = mean_i masked_mean_t(kl).

    As verl's `apply_kl_penalty`: beta is the coefficient *before* this step's update, and the
    controller is then updated in place with n_steps = number of rows.
    Returns (token_level_rewards, kl, current_kl, metrics).
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_logp, ref_logp, kind) * mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = torch.mean(masked_mean(kld, mask, dim=-1), dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, kld, current_kl, metrics
