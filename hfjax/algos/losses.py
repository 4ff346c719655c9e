"""Token-loss aggregation, policy losses (dual-clip PPO, GSPO, plain policy gradient) with their registry, the clipped
value loss, and token log-probs / entropy from logits. verl's other policy losses, registered in the same table, are
in `ratio_losses`, `covariance_losses` and `bypass_loss`.

Pure `jax.numpy`, differentiable, for jitted training steps. Aggregation takes optional GLOBAL normalisers (token
count, sequence count of the whole mini-batch): a worker that splits a mini-batch into micro-batches passes the
mini-batch's counts to every micro-batch, and the sum of the micro-batch losses (and of their gradients) then equals
the mini-batch loss (and gradient). The token-mean metrics (clip fractions, ppo_kl) follow the same rule: with
`global_tokens` each is this batch's share of the mini-batch's token mean, so the micro-batch values sum to the
mini-batch's (whatever the micro-batch size). Policy losses take optional per-token `token_weights` (e.g.
rollout-correction importance weights) that scale the token losses before aggregation. A policy loss is a registered
name or user code `path/to/file.py:function`; the actor calls it with `ACTOR_ARGUMENTS` and the `ACTOR_OPTIONS` it
takes (`check_actor_policy_loss`, `actor_options`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp

from hfjax.algos.masked import masked_mean, masked_sum
from hfjax.algos.registry import Registry

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SEQ_MEAN_EPS = 1e-8  # added to a sequence's token count in seq-mean-token-mean
LOG_RATIO_CLAMP = 20.0  # PPO clamps log(pi / pi_old) to [-20, 20] before exp
GSPO_LOG_RATIO_MAX = 10.0  # GSPO clamps its token-level log ratio from above

PolicyLossOutput = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # pg_loss, pg_clipfrac, ppo_kl, clipfrac_lower
PolicyLoss = Callable[..., PolicyLossOutput]
LOSS_INPUTS = ("old_log_prob", "log_prob", "advantages", "response_mask")  # a policy loss's positional arguments
# what the actor update passes every policy loss (as keywords), and what it passes only to a loss that takes it
ACTOR_ARGUMENTS = ("loss_agg_mode", "global_tokens", "global_seqs", "norm_length")
ACTOR_OPTIONS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")


def check_policy_loss(label: str, fn: PolicyLoss) -> None:
    """Raises ValueError unless `fn` can be called with the four arrays `LOSS_INPUTS` as positional arguments (and
    its keyword-only parameters)."""
    try:
        signature = inspect.signature(fn)
        keywords = {p.name: None for p in signature.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        signature.bind(*LOSS_INPUTS, **keywords)
    except TypeError as exc:
        raise ValueError(
            f"policy loss {label!r} cannot be called as {getattr(fn, '__name__', fn)}({', '.join(LOSS_INPUTS)}) ({exc})"
        ) from None
    except ValueError:  # no signature to inspect: nothing to check
        return


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", check_policy_loss)


def safe_divide(numerator: jax.Array, denominator: jax.Array | float) -> jax.Array:
    """numerator / denominator, and 0 where the denominator is 0 (gradients stay finite)."""
    denominator = jnp.asarray(denominator, numerator.dtype)
    return jnp.where(denominator != 0, numerator / jnp.where(denominator != 0, denominator, 1), 0)


def token_share(values: jax.Array, mask: jax.Array, global_tokens: jax.Array | float | None = None) -> jax.Array:
    """Masked token mean of `values` over this batch, or with `global_tokens` (the mini-batch's valid tokens) this
    batch's share of the mini-batch's token mean: masked sum / global_tokens (0 when it is 0)."""
    if global_tokens is None:
        return masked_mean(values, mask)
    return safe_divide(masked_sum(values, mask), global_tokens)


def mask_counts(loss_mask: jax.Array, rows_in_loss: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(valid tokens, rows): the normalisers `agg_loss` uses for this batch. Every row counts, with or without a
    valid token, as verl counts the rows of a mini-batch (`global_batch_size`); `rows_in_loss` (rows,), when given,
    leaves out the rows marked False (rows that are not the mini-batch's: padding added to split it evenly, rows a
    program kept out of the update)."""
    mask = jnp.asarray(loss_mask)
    mask = mask if jnp.issubdtype(mask.dtype, jnp.floating) else mask.astype(jnp.float32)
    if rows_in_loss is None:
        return jnp.sum(mask), jnp.asarray(mask.shape[0], mask.dtype)
    return jnp.sum(mask), jnp.sum(jnp.asarray(rows_in_loss).astype(bool)).astype(mask.dtype)


def agg_loss(
    loss_mat: jax.Array,
    loss_mask: jax.Array,
    mode: str = "token-mean",
    *,
    global_tokens: jax.Array | float | None = None,
    global_seqs: jax.Array | float | None = None,
    norm_length: int | None = None,
) -> jax.Array:
    """Aggregates a (bs, T) token-loss matrix to a scalar.

    token-mean: sum of valid token losses / tokens. token-sum: sum of valid token losses (no normaliser).
    seq-mean-token-sum: sum over sequences of their token sums / sequences. seq-mean-token-mean: sum over sequences
    of their token means / sequences. seq-mean-token-sum-norm (Dr.GRPO): seq-mean-token-sum / `norm_length`
    (default T; verl's loss_scale_factor; pass a constant when micro-batches are padded to different lengths).
    "tokens" and "sequences" are `global_tokens` / `global_seqs` when given (the whole mini-batch's
    `mask_counts`), else this batch's: its valid tokens and its rows, all of them (verl's mini-batch rows; a row
    without a valid token adds 0 to the sum but counts). A zero count gives loss 0 (verl: NaN).
    """
    loss_mat = jnp.asarray(loss_mat)
    mask = jnp.asarray(loss_mask).astype(loss_mat.dtype)
    tokens, seqs = mask_counts(mask)
    if mode == "token-mean":
        return safe_divide(masked_sum(loss_mat, mask), tokens if global_tokens is None else global_tokens)
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    seqs = seqs if global_seqs is None else global_seqs
    seq_sums = masked_sum(loss_mat, mask, axis=-1)
    if mode == "seq-mean-token-sum":
        return safe_divide(jnp.sum(seq_sums), seqs)
    if mode == "seq-mean-token-mean":
        return safe_divide(jnp.sum(seq_sums / (jnp.sum(mask, axis=-1) + SEQ_MEAN_EPS)), seqs)
    if mode == "seq-mean-token-sum-norm":
        return safe_divide(jnp.sum(seq_sums), seqs) / (mask.shape[-1] if norm_length is None else norm_length)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {list(AGG_MODES)}")


def aggregate_token_losses(
    token_losses: jax.Array,
    response_mask: jax.Array,
    token_weights: jax.Array | None,
    loss_agg_mode: str,
    global_tokens: jax.Array | float | None,
    global_seqs: jax.Array | float | None,
    norm_length: int | None,
) -> jax.Array:
    """`agg_loss` of token_losses * token_weights (None: the losses untouched, bit for bit), for policy losses."""
    weighted = token_losses if token_weights is None else token_losses * token_weights
    return agg_loss(
        weighted,
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_length=norm_length,
    )


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering `fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, global_tokens,
    global_seqs, norm_length, **own_params) -> (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)` under `name`.

    A loss that supports per-token weights takes a keyword-only `token_weights: jax.Array | None = None` multiplying
    its token losses before aggregation; losses without it still work, only not with weights."""
    return POLICY_LOSSES.register(name)


def policy_losses() -> list[str]:
    """Names of the registered policy losses."""
    return POLICY_LOSSES.names()


def policy_loss(
    name: str,
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    token_weights: jax.Array | None = None,
    **params,
) -> PolicyLossOutput:
    """Calls the policy loss registered as `name`; `params` (e.g. loss_agg_mode, clip_ratio_low, global_tokens) must be
    keyword parameters of that loss, and those not given keep the loss's defaults. `token_weights` (bs, T) multiply
    the token losses before aggregation (normalisers stay those of `response_mask`); it is passed only when not None,
    and only to a loss that takes it."""
    fn = POLICY_LOSSES.get(name)
    accepted = _keyword_only(fn)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"policy loss {name!r} does not take {unknown}; it takes {accepted}")
    if token_weights is not None:
        if "token_weights" not in accepted:
            raise ValueError(
                f"policy loss {name!r} does not take token_weights (per-token weights, e.g. rollout-correction "
                "importance weights); give it a keyword-only `token_weights: jax.Array | None = None` parameter"
            )
        params["token_weights"] = token_weights
    return fn(old_log_prob, log_prob, advantages, response_mask, **params)


def _keyword_only(fn: PolicyLoss) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]


def check_actor_policy_loss(name: str) -> None:
    """Raises ValueError unless the actor update can call the policy loss `name` (registered or `path.py:function`):
    it takes `ACTOR_ARGUMENTS` as keyword-only parameters, and its other keyword-only parameters have defaults or
    are `ACTOR_OPTIONS` (which the actor fills from its config; `token_weights` comes only with rollout correction,
    so it needs the default None)."""
    fn = POLICY_LOSSES.get(name)
    params = inspect.signature(fn).parameters.values()
    accepted = _keyword_only(fn)
    missing = [p for p in ACTOR_ARGUMENTS if p not in accepted]
    unfilled = [
        p.name
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY
        and p.default is inspect.Parameter.empty
        and p.name not in (*ACTOR_ARGUMENTS, *ACTOR_OPTIONS)
    ]
    if missing or unfilled:
        problem = f"lacks keyword-only {missing}" if missing else f"needs {unfilled}, which the actor does not pass"
        raise ValueError(
            f"policy loss {name!r} {problem}; expected def loss({', '.join(LOSS_INPUTS)}, *, "
            f"{', '.join(ACTOR_ARGUMENTS)}, [any of {', '.join(ACTOR_OPTIONS)}], [token_weights=None])"
        )


def actor_options(name: str, **options: object) -> dict[str, object]:
    """The `options` (from `ACTOR_OPTIONS`) that the policy loss `name` takes: the actor offers its clip settings to
    every loss, and each takes those it names."""
    accepted = _keyword_only(POLICY_LOSSES.get(name))
    return {key: value for key, value in options.items() if key in accepted}


@register_policy_loss("ppo")
@register_policy_loss("vanilla")  # verl's name
def ppo_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: jax.Array | float | None = None,
    global_seqs: jax.Array | float | None = None,
    norm_length: int | None = None,
    token_weights: jax.Array | None = None,
) -> PolicyLossOutput:
    """Dual-clip PPO (arXiv 1912.09729; verl's "vanilla" loss), ratio r = exp(clamp(logp - old_logp, -20, 20)).

    Token loss max(-A r, -A clip(r, 1 - low, 1 + high)), and for A < 0 also at most -A * clip_ratio_c.
    pg_clipfrac: share of valid tokens where the clipped term wins; pg_clipfrac_lower: share where the dual clip
    bounds the loss; ppo_kl: token mean of old_logp - logp (each a `token_share`).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip PPO's lower bound on the ratio) must be > 1.0, got {clip_ratio_c}")
    log_ratio = jnp.clip(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_loss = jnp.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    token_losses = jnp.where(negative, jnp.minimum(dual_bound, clip_loss), clip_loss)
    pg_loss = aggregate_token_losses(
        token_losses, response_mask, token_weights, loss_agg_mode, global_tokens, global_seqs, norm_length
    )
    pg_clipfrac = token_share((clipped > unclipped).astype(ratio.dtype), response_mask, global_tokens)
    lower = ((clip_loss > dual_bound) & negative).astype(ratio.dtype)
    pg_clipfrac_lower = token_share(lower, response_mask, global_tokens)
    return pg_loss, pg_clipfrac, token_share(-log_ratio, response_mask, global_tokens), pg_clipfrac_lower


@register_policy_loss("gspo")
def gspo_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_tokens: jax.Array | float | None = None,
    global_seqs: jax.Array | float | None = None,
    norm_length: int | None = None,
    token_weights: jax.Array | None = None,
) -> PolicyLossOutput:
    """GSPO (arXiv 2507.18071): PPO clipping on the sequence-level ratio s = exp(mean over valid tokens of log r).

    The token ratio is sg[s] * pi / sg[pi] (value s, gradient of log pi), its log clamped at 10. The token losses
    are aggregated by `loss_agg_mode`, as in verl, whose actor passes its own `loss_agg_mode` (default token-mean);
    the paper's sequence-level seq-mean-token-mean is only the function's default. pg_clipfrac (token level) and
    ppo_kl are `token_share`s; pg_clipfrac_lower is 0.
    """
    mask = jnp.asarray(response_mask).astype(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_sum(log_ratio, mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1)
    token_log_ratio = log_prob - jax.lax.stop_gradient(log_prob) + jax.lax.stop_gradient(seq_log_ratio)[:, None]
    ratio = jnp.exp(jnp.minimum(token_log_ratio, GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_loss = aggregate_token_losses(
        jnp.maximum(unclipped, clipped), mask, token_weights, loss_agg_mode, global_tokens, global_seqs, norm_length
    )
    pg_clipfrac = token_share((clipped > unclipped).astype(ratio.dtype), mask, global_tokens)
    return pg_loss, pg_clipfrac, token_share(-log_ratio, mask, global_tokens), jnp.zeros((), ratio.dtype)


@register_policy_loss("pg")
@register_policy_loss("gpg")  # verl's name (GPG's loss)
def pg_policy_loss(
    old_log_prob: jax.Array,
    log_prob: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    loss_agg_mode: str = "token-mean",
    global_tokens: jax.Array | float | None = None,
    global_seqs: jax.Array | float | None = None,
    norm_length: int | None = None,
    token_weights: jax.Array | None = None,
) -> PolicyLossOutput:
    """Plain policy gradient, token loss -A * logp (no ratio, no clipping; clip fractions are 0): verl's `gpg` loss
    and its REINFORCE loss (`bypass_mode` with `loss_type: reinforce`, there with the rollout IS weights).

    ppo_kl is still reported (`token_share` of old_logp - logp) to watch how far the policy moved.
    """
    pg_loss = aggregate_token_losses(
        -advantages * log_prob, response_mask, token_weights, loss_agg_mode, global_tokens, global_seqs, norm_length
    )
    zero = jnp.zeros((), pg_loss.dtype)
    return pg_loss, zero, token_share(old_log_prob - log_prob, response_mask, global_tokens), zero


def value_loss(
    vpreds: jax.Array,
    returns: jax.Array,
    values: jax.Array,
    response_mask: jax.Array,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_tokens: jax.Array | float | None = None,
    global_seqs: jax.Array | float | None = None,
    norm_length: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Clipped value loss 0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)) -> (vf_loss, vf_clipfrac).

    vf_clipfrac: share of valid tokens where the clipped term is larger (a `token_share`).
    """
    vpreds_clipped = jnp.clip(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = jnp.square(vpreds - returns)
    clipped = jnp.square(vpreds_clipped - returns)
    vf_loss = 0.5 * agg_loss(
        jnp.maximum(unclipped, clipped),
        response_mask,
        loss_agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_length=norm_length,
    )
    clipfrac = token_share((clipped > unclipped).astype(vf_loss.dtype), response_mask, global_tokens)
    return vf_loss, clipfrac


def _at_least_f32(logits: jax.Array) -> jax.Array:
    logits = jnp.asarray(logits)
    return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))


@jax.jit
def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) over the last axis, logsumexp(z) - sum(softmax(z) * z), in at least float32.
    Masked columns must be finite (the vocabulary padding's -1e30): their softmax is 0, so they add 0, not NaN."""
    logits = _at_least_f32(logits)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)


@jax.jit
def logprobs_from_logits(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """log softmax(logits)[label] over the last axis, in at least float32; labels has logits' shape minus the last."""
    logits = _at_least_f32(logits)
    picked = jnp.take_along_axis(logits, jnp.asarray(labels)[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)
