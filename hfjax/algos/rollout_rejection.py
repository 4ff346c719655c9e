"""verl's rejection sampling for rollout correction (`rollout_rs`): tokens or whole sequences whose divergence between
the training policy pi_old and the rollout policy mu leaves a bound drop out of the response mask.

Per token, with the log ratio r = clamp(log pi_old - log mu, +-20) (each token clamped before any sum): k1 = -r (the
log of mu / pi_old), k2 = r^2 / 2, k3 = e^r - 1 - r. An option `<level>_k<n>` takes k<n> per token (`token`), or its
sum (`seq_sum`), mean (`seq_mean`) or largest value (`seq_max`, k2 and k3 only) over a sequence's valid tokens, and
keeps what passes: k1 options keep log(lower) <= statistic <= log(upper), i.e. ratio bounds on mu / pi_old; k2 and
k3 options keep statistic <= upper. Several options, comma-separated, must all pass.

Thresholds (`rollout_rs_threshold`): one per option, comma-separated, or one for all. For k1, "lower_upper" (e.g.
"0.5_2.0") or a single upper bound u (lower 1 / u); for k2 and k3 a single positive upper bound.

Pure `jax.numpy` (the options are parsed in Python, so they are static under `jit`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from hfjax.algos.masked import masked_mean, masked_sum

LOG_RATIO_CLAMP = 20.0  # log(pi_old / mu) is clamped to [-20, 20] per token before any use (verl's safety bound)
REJECTION_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


@dataclasses.dataclass(frozen=True)
class RejectionRule:
    """One rejection option with its bounds: `lower` is the lower ratio bound of a k1 option (None for k2, k3)."""

    option: str
    upper: float
    lower: float | None = None

    @property
    def level(self) -> str:
        """How the per-token divergence is reduced: `token`, `seq_sum`, `seq_mean` or `seq_max`."""
        return self.option.rsplit("_", 1)[0]

    @property
    def divergence(self) -> str:
        return self.option.rsplit("_", 1)[1]


def _positive(text: str, field: str, which: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{field}: the {which} bound {text!r} is not a number") from None
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{field}: the {which} bound must be a positive number, got {text}")
    return value


def parse_bounds(spec: str | float, field: str) -> tuple[float | None, float]:
    """(lower or None, upper) of a threshold: a positive number (or numeric string), or "lower_upper" with
    0 < lower <= upper (verl's spelling); raises ValueError starting with `field`."""
    if isinstance(spec, bool) or not isinstance(spec, str | int | float):
        raise ValueError(f"{field}: expected a number or a 'lower_upper' string, got {spec!r}")
    text = str(spec).strip()
    if "_" not in text:
        return None, _positive(text, field, "upper")
    lower_text, upper_text = text.split("_", 1)
    lower, upper = _positive(lower_text, field, "lower"), _positive(upper_text, field, "upper")
    if lower > upper:
        raise ValueError(f"{field}: expected lower <= upper in 'lower_upper', got {spec!r}")
    return lower, upper


def _rule(option: str, spec: str) -> RejectionRule:
    field = f"rollout_rs_threshold (option {option})"
    if not option.endswith("k1"):
        if "_" in spec:
            raise ValueError(f"{field}: takes a single upper bound (k2 and k3 have no lower one), got {spec!r}")
        return RejectionRule(option, parse_bounds(spec, field)[1])
    lower, upper = parse_bounds(spec, field)
    if lower is None and upper < 1:
        raise ValueError(
            f"{field}: a single bound u means the ratio bounds [1/u, u], so u >= 1; got {spec!r} (YAML reads an "
            "unquoted 0.5_2 as the number 0.52: quote 'lower_upper' or write 0.5_2.0)"
        )
    return RejectionRule(option, upper, 1.0 / upper if lower is None else lower)


def parse_rejection(options: str, thresholds: str | float | None) -> tuple[RejectionRule, ...]:
    """The rules of `rollout_rs` (comma-separated options, duplicates dropped) with their `rollout_rs_threshold`
    bounds; raises ValueError naming the field at fault."""
    if not isinstance(options, str):
        raise ValueError(f"rollout_rs: expected comma-separated options of {list(REJECTION_OPTIONS)}, got {options!r}")
    names = list(dict.fromkeys(part.strip() for part in options.split(",") if part.strip()))
    if not names:
        raise ValueError(f"rollout_rs: expected at least one of {list(REJECTION_OPTIONS)}, got {options!r}")
    for name in names:
        if name not in REJECTION_OPTIONS:
            raise ValueError(f"rollout_rs: unknown option {name!r}; known: {', '.join(REJECTION_OPTIONS)}")
    if thresholds is None:
        raise ValueError(f"rollout_rs_threshold: required with rollout_rs={options!r}")
    if isinstance(thresholds, bool) or not isinstance(thresholds, str | int | float):
        raise ValueError(f"rollout_rs_threshold: expected a number or a string of them, got {thresholds!r}")
    specs = [part.strip() for part in str(thresholds).split(",") if part.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"rollout_rs_threshold: expected one threshold for all options or one per option ({len(names)}: "
            f"{', '.join(names)}), got {len(specs)} in {thresholds!r}"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    return tuple(_rule(name, spec) for name, spec in zip(names, specs, strict=True))


def _token_divergences(log_ratio: jax.Array) -> dict[str, jax.Array]:
    r = jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {"k1": -r, "k2": 0.5 * jnp.square(r), "k3": jnp.expm1(r) - r}


def _statistic(per_token: jax.Array, mask: jax.Array, valid: jax.Array, level: str) -> jax.Array:
    """The option's statistic per token ([bs, T]; a sequence's value repeated over its tokens)."""
    if level == "token":
        return per_token
    if level == "seq_sum":
        per_sequence = masked_sum(per_token, mask, axis=-1)
    elif level == "seq_mean":
        per_sequence = masked_mean(per_token, mask, axis=-1)
    else:  # seq_max; a sequence without valid tokens gets 0 (it is rejected by nothing)
        per_sequence = jnp.where(jnp.any(valid, -1), jnp.max(jnp.where(valid, per_token, -jnp.inf), -1), 0)
    return jnp.broadcast_to(per_sequence[:, None], per_token.shape)


def _keeps(statistic: jax.Array, rule: RejectionRule) -> jax.Array:
    if rule.lower is None:
        return statistic <= rule.upper
    return (statistic >= math.log(rule.lower)) & (statistic <= math.log(rule.upper))


def _rejected_shares(rejected: jax.Array, mask: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(share of valid tokens rejected, share of sequences with a valid token that lost at least one)."""
    has_token = jnp.any(valid, -1)
    hit = jnp.any(rejected & valid, -1)
    return masked_mean(rejected, mask), masked_mean(hit, has_token)


def rejection_mask(
    log_ratio: jax.Array, mask: jax.Array, rules: tuple[RejectionRule, ...]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(keep, metrics): `keep` [bs, T] is True where every rule passes (and the token is valid); `log_ratio` is
    log pi_old - log mu, finite on the valid tokens of the float `mask`. Metrics (verl's names, without the
    `rollout_corr/` prefix): `rollout_rs_masked_fraction` (valid tokens rejected), `rollout_rs_seq_masked_fraction`
    (sequences with a valid token that lost any), and both per option (`rollout_rs_<option>_...`)."""
    valid = mask != 0
    divergences = _token_divergences(log_ratio)
    keep = valid
    metrics = {}
    for rule in rules:
        passes = _keeps(_statistic(divergences[rule.divergence], mask, valid, rule.level), rule)
        token_share, seq_share = _rejected_shares(~passes, mask, valid)
        metrics[f"rollout_rs_{rule.option}_masked_fraction"] = token_share
        metrics[f"rollout_rs_{rule.option}_seq_masked_fraction"] = seq_share
        keep = keep & passes
    token_share, seq_share = _rejected_shares(~keep, mask, valid)
    metrics["rollout_rs_masked_fraction"] = token_share
    metrics["rollout_rs_seq_masked_fraction"] = seq_share
    return keep, metrics
