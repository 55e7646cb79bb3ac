"""The two models an update trains, as objects: what each optimises, where its config lives.

A role knows its config paths (optimizer, offload, micro-batching), how its model is built, when
it trains (the actor waits for the critic's warm-up steps, as verl), whether its exported folder
carries the tokenizer, and its loss on one micro-batch. stages.training.worker runs the same loop
for every role (verl: dp_actor.py update_policy and dp_critic.py update_critic, critic first)
without asking which one it holds.
"""
from __future__ import annotations

import os

from stages.training import engine as update_engine
from stages.algos.kl import kl_penalty
from stages.algos.policy_losses import agg_loss, compute_value_loss, get_policy_loss

ACTOR = "actor_rollout_ref.actor"


class Role:
    name = ""          # plan key, metric prefix, train_state/<name>_state, weights folder
    prefix = ""        # config section of its PPO settings (optim, mini/micro batches, loss_agg_mode)
    model_key = ""     # config section of its model (path, use_remove_padding)
    offload_key = ""   # config section of its param/optimizer offload switches
    seed_offset = 0    # mini-batch shuffle generator: update seed + this
    exports_tokenizer = False
    is_policy = False  # the model the rollout samples: its update's micro-batches are those shown per rank

    def __init__(self, ctx):
        self.cfg = ctx.get(self.prefix)
        self.plan = ctx.plan[self.name]
        offload = ctx.get(self.offload_key) or {}
        self.ds_config = update_engine.deepspeed_config(
            ctx.get(f"{ACTOR}.deepspeed.zero_stage"), ctx.get(f"{ACTOR}.deepspeed.dtype"),
            self.cfg.get("grad_clip", 1.0), bool(offload.get("param_offload")),
            bool(offload.get("optimizer_offload")), self.offload_key)
        self.loss_agg_mode = self.cfg["loss_agg_mode"]
        self.engine = None

    def build(self, ctx, init_path: str, dtype: str, device: str) -> None:
        model = self.load_model(ctx, init_path, dtype, device)
        if ctx.get(f"{self.model_key}.enable_gradient_checkpointing"):  # as verl's fsdp_workers
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.engine, _ = update_engine.make_engine(model, self.cfg["optim"], self.ds_config)

    def load_model(self, ctx, init_path, dtype, device):
        raise NotImplementedError

    def trains_at(self, ctx) -> bool:
        return True

    def columns(self) -> dict:
        """Per-row inputs beyond prompt/response/advantages: {column: stage table}."""
        return {}

    def loss(self, ctx, job, part: list[dict], batch: dict, agg: dict):
        """(loss tensor, {stat: sum over this micro-batch}) — see stages.training.worker's docstring
        for the scaling that makes the per-micro-batch losses add up to the mini-batch's loss."""
        raise NotImplementedError


class ActorRole(Role):
    name, prefix, model_key, offload_key = "actor", ACTOR, "actor_rollout_ref.model", f"{ACTOR}.fsdp_config"
    exports_tokenizer = True
    is_policy = True

    def __init__(self, ctx):
        super().__init__(ctx)
        self.correction = ctx.get("algorithm.rollout_correction") or {}  # engine–trainer TIS

    def load_model(self, ctx, init_path, dtype, device):
        from stages.model.lora import add_adapters, lora_rank
        from stages.model.models import load_policy

        model = load_policy(init_path, dtype, device)
        model_cfg = ctx.get(self.model_key) or {}
        return add_adapters(model, model_cfg) if lora_rank(model_cfg) else model

    def trains_at(self, ctx) -> bool:
        return ctx.step >= (ctx.get("trainer.critic_warmup") or 0)

    def columns(self) -> dict:
        cols = {}
        if not self.plan["on_policy"]:  # on-policy: the update's own forward, detached
            cols["old_log_probs"] = "logprob"
        if self.cfg.get("use_kl_loss"):  # no KL loss: no reference model (as verl)
            cols["ref_log_probs"] = "logprob"
        if self.correction.get("rollout_is"):
            cols["rollout_log_probs"] = "rollout"
        return cols

    def loss(self, ctx, job, part, batch, agg):
        from stages.model.models import response_log_probs

        cfg, R = self.cfg, batch["response_width"]
        mask = batch["response_mask"].float()
        tokens = float(mask.sum())
        log_prob, entropy = response_log_probs(self.engine.module, batch,
                                               ctx.get("actor_rollout_ref.rollout.temperature"), with_entropy=True,
                                               entropy_grad=bool(cfg.get("entropy_coeff", 0.0)))
        old = log_prob.detach() if self.plan["on_policy"] else job.per_token(part, "old_log_probs", R)
        job.keep_forward(part, old, entropy)
        adv = job.per_token(part, "advantages", R)
        policy_loss = get_policy_loss(cfg.get("policy_loss", {}).get("loss_mode", "vanilla"))
        mode = self.loss_agg_mode
        # the loss reads its own keys from the actor section (clip ranges, tau_*, policy_loss.*);
        # its metrics (pg_clipfrac, ppo_kl, pg_clipfrac_lower where the mode has them) are token
        # means over this micro-batch: summed here weighted by its tokens
        weights = None
        if self.correction.get("rollout_is"):  # stages.algos.rollout_correction: π_old / π_rollout, truncated
            from stages.algos.rollout_correction import rollout_is_weights

            weights = rollout_is_weights(old, job.per_token(part, "rollout_log_probs", R), mask,
                                         self.correction["rollout_is"], self.correction["rollout_is_threshold"])
        pg_loss, pg_metrics = policy_loss(old, log_prob, adv, mask, loss_agg_mode=mode, config=cfg,
                                          rollout_is_weights=weights, **agg)
        loss = pg_loss
        stats = {"pg_loss": pg_loss.item() / agg["dp_size"],
                 **{name: float(value) * tokens for name, value in pg_metrics.items()},
                 "entropy": float((entropy.detach() * mask).sum())}
        if weights is not None:  # the weights' token mean (1 when engine and trainer agree)
            stats["rollout_is_weight"] = float((weights * mask).sum())
        if cfg.get("entropy_coeff", 0.0):
            loss = loss - cfg["entropy_coeff"] * agg_loss(entropy, mask, mode, **agg)
        if cfg.get("use_kl_loss"):
            ref = job.per_token(part, "ref_log_probs", R)
            kl = agg_loss(kl_penalty(log_prob, ref, cfg["kl_loss_type"]), mask, mode, **agg)
            loss = loss + cfg["kl_loss_coef"] * kl
            stats["kl_loss"] = kl.item() / agg["dp_size"]
        return loss, stats


class CriticRole(Role):
    name, prefix, model_key, offload_key = "critic", "critic", "critic.model", "critic.model.fsdp_config"
    seed_offset = 1

    def load_model(self, ctx, init_path, dtype, device):
        from stages.model.lora import add_adapters, lora_rank
        from stages.model.models import load_critic

        model = load_critic(os.path.expanduser(ctx.get("critic.model.path")), dtype, device,
                            seed=ctx.get("trainer.seed"))
        model_cfg = ctx.get(self.model_key) or {}
        return add_adapters(model, model_cfg) if lora_rank(model_cfg) else model

    def columns(self) -> dict:
        return {"values": "logprob"}

    def loss(self, ctx, job, part, batch, agg):
        from stages.model.models import response_values

        R = batch["response_width"]
        mask = batch["response_mask"].float()
        vpreds = response_values(self.engine.module, batch)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds, job.per_token(part, "returns", R), job.per_token(part, "values", R), mask,
            cliprange_value=self.cfg.get("cliprange_value", 0.5), loss_agg_mode=self.loss_agg_mode, **agg)
        tokens = float(mask.sum())
        return vf_loss, {"vf_loss": vf_loss.item() / agg["dp_size"], "vf_clipfrac": vf_clipfrac.item() * tokens,
                         "vpred_mean": float((vpreds.detach() * mask).sum())}


ROLES = (CriticRole, ActorRole)  # verl's order: critic first


def planned_roles(ctx) -> list[Role]:
    """The roles this config trains, in verl's order (critic first)."""
    return [cls(ctx) for cls in ROLES if ctx.plan.get(cls.name)]


def role_named(name: str) -> type[Role] | None:
    """The role whose update micro-batches are recorded under `name` (the update table's `role`
    column); None for other names, such as a logprob pass's 'logprob/actor'."""
    return next((cls for cls in ROLES if cls.name == name), None)


def policy_role() -> type[Role]:
    return next(cls for cls in ROLES if cls.is_policy)
