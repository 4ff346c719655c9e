"""verl's bypass mode loss (`bypass_mode`): the policy loss for a batch whose old log probs ARE the rollout
policy's (no recomputation by the trainer; two policies instead of three).

The off-policy correction is computed inside the loss between the current policy pi (`log_prob`, without
gradient) and the rollout policy mu (`old_log_prob`), by `hfjax.algos.rollout_correction`; then `loss_type`
"ppo_clip" runs dual-clip PPO on the ratio pi / mu over the tokens rejection keeps (no IS weights: the ratio already
is one), and "reinforce" runs the plain policy gradient -w A logp with the truncated IS weights w. The correction's
metrics are not returned (a policy loss returns four scalars).
"""

from __future__ import annotations

import jax

from hfjax.algos.losses import PolicyLossOutput, pg_policy_loss, ppo_policy_loss, register_policy_loss
from hfjax.algos.rollout_correction import rollout_correction

BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
Counts = jax.Array | float | None


@register_policy_loss("bypass_mode")
def bypass_mode_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    loss_type: str = "ppo_clip",
    rollout_is: str | None = "sequence",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: Counts = None,
    global_seqs: Counts = None,
    norm_length: int | None = None,
) -> PolicyLossOutput:
    """Bypass mode with `old_log_prob` = the rollout log probs. The `rollout_*` settings are `rollout_correction`'s
    (verl's names and defaults: sequence-level weights truncated at 2, no rejection), for pi against mu.
    "ppo_clip" (verl's default): `ppo` on the kept tokens, weights unused; "reinforce": `pg` on the kept tokens
    with the IS weights (none without `rollout_is`). Normalisers stay those of `global_tokens` / `global_seqs` when
    given."""
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"loss_type (bypass mode's loss) must be one of {list(BYPASS_LOSS_TYPES)}, got {loss_type!r}")
    weights, kept, _ = rollout_correction(
        jax.lax.stop_gradient(log_prob),
        old_log_prob,
        response_mask,
        rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold,
        rollout_is_batch_normalize=rollout_is_batch_normalize,
        rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
    )
    counts = dict(
        loss_agg_mode=loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, norm_length=norm_length
    )
    if loss_type == "reinforce":
        return pg_policy_loss(old_log_prob, log_prob, advantages, kept, token_weights=weights, **counts)
    return ppo_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        kept,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        **counts,
    )
