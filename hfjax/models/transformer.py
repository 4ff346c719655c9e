"""The decoder backbone and its three heads: `CausalLM`, `SequenceClassifier` (reward/cost), `Critic` (values).

Inputs are batched and may be left-padded: `attention_mask` [batch, length] is 1 on real tokens; positions default
to `cumsum(mask) - 1`, as HF `generate` computes them. A row may also pack several sequences: `attention_mask` then
holds their segment ids (1, 2, ... along the row, 0 on padding), each attends only to itself and its positions
restart at 0. Outputs are float32.
The embedding and LM head have `padded_vocab_size` rows (zero beyond `vocab_size`); `CausalLM.logits` gives the
padding columns `MASKED_SCORE`, so no softmax, sample or loss ever sees them, and `CausalLM.__call__` drops them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hfjax.models import lm_head
from hfjax.models.attention import attention_mask
from hfjax.models.config import MASKED_SCORE, ModelConfig, RopeConfig
from hfjax.models.dense import dense
from hfjax.models.layers import RESIDUAL, DecoderLayer, norm, rope_inv_freq, rope_tables
from hfjax.models.lm_head import chunk_length, softcap_logits, token_logprobs
from hfjax.models.moe import checkpointed
from hfjax.models.primitives import logical_param, normal_init
from hfjax.models.program import constrain, lookup_rows


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Position ids for a batch `mask` [batch, length]: 1 on real tokens (left padding allowed: `cumsum(mask) - 1`),
    or the segment ids of sequences packed in a row, increasing along it (positions restart at 0 on each); 0 on
    leading padding."""
    segments = mask.astype(jnp.int32)
    count = jnp.cumsum(segments > 0, axis=-1, dtype=jnp.int32)
    before = jnp.pad(jax.lax.cummax(segments, axis=segments.ndim - 1), [(0, 0)] * (segments.ndim - 1) + [(1, 0)])
    starts = segments > before[..., :-1]  # the first token of each segment
    base = jax.lax.cummax(jnp.where(starts, count - 1, 0), axis=segments.ndim - 1)
    return jnp.maximum(count - 1 - base, 0)


def last_token_index(mask: jax.Array) -> jax.Array:
    """Index of the rightmost real token of each row (HF's pooling position for sequence scores)."""
    idx = jnp.arange(mask.shape[-1], dtype=jnp.int32)
    return jnp.argmax(idx[None, :] * mask.astype(jnp.int32), axis=-1)


def vocab_param(cfg: ModelConfig, rngs: nnx.Rngs | None, std: float, param_dtype: jnp.dtype) -> nnx.Param:
    """A [padded_vocab_size, embed] parameter (embedding or LM head): normal(std) rows, zero padding rows."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return normal_init(std)(key, shape, dtype).at[cfg.vocab_size :].set(0)

    return logical_param(rngs, init, (cfg.padded_vocab_size, cfg.hidden_size), ("vocab", "embed"), param_dtype)


def mask_vocab_padding(logits: jax.Array, vocab_size: int) -> jax.Array:
    """`logits` [..., padded vocab] with the columns from `vocab_size` on set to `MASKED_SCORE` (finite, so softmax,
    log-softmax and entropy stay NaN-free and equal to those over the first `vocab_size` columns)."""
    if logits.shape[-1] == vocab_size:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, MASKED_SCORE)


REMAT_POLICIES = {  # what a layer's backward keeps from its forward; the rest it recomputes
    "full": jax.checkpoint_policies.nothing_saveable,  # only the layer's input: about one more forward per step
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # the matmul outputs; elementwise recomputed
}
REMAT = ("none", *REMAT_POLICIES)


def _layer_step(
    layer: DecoderLayer,
    x: jax.Array,
    tables: tuple[jax.Array, ...],
    remat: str,
    choices: jax.Array | None,
    sees_ahead: bool = False,
) -> jax.Array:
    """One decoder layer over `tables` (cos, sin, mask, segments) and replayed expert `choices`, under
    `jax.checkpoint` with the `remat` policy unless it is `none` (the layer's state is split off so that the
    checkpointed function is pure; `hfjax.models.moe.checkpointed` carries the router tapes out); `sees_ahead`:
    the mask has blocks that see ahead (`DecoderLayer`)."""
    if remat == "none":
        return layer(x, *tables, choices, sees_ahead=sees_ahead)
    graphdef, state = nnx.split(layer)

    def pure(state: nnx.State, x: jax.Array, tables: tuple[jax.Array, ...], choices: jax.Array | None) -> jax.Array:
        return nnx.merge(graphdef, state)(x, *tables, choices, sees_ahead=sees_ahead)

    return checkpointed(pure, REMAT_POLICIES[remat])(state, x, tables, choices)


def set_remat(model: nnx.Module, remat: str) -> nnx.Module:
    """Sets how the decoder layers of `model` (any head) rematerialise in the backward: `none` (keep every
    activation), `full` (keep each layer's input, recompute the rest) or `dots` (keep the matmul outputs). Returns
    `model`. Changes no value, only the memory and FLOPs of a gradient program."""
    if remat not in REMAT:
        raise ValueError(f"remat: expected one of {REMAT}, got {remat!r}")
    model.model.remat = remat
    return model


class Decoder(nnx.Module):
    """Token embedding, decoder layers and the final norm; returns hidden states [batch, length, embed]."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs | None, std: float):
        self.embed_tokens = vocab_param(cfg, rngs, std, param_dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, param_dtype, rngs, std) for i in range(cfg.num_layers)])
        self.norm = norm(cfg, cfg.hidden_size, "embed", param_dtype, rngs)
        self.remat = "none"  # `set_remat`: a static attribute, so it keys the compiled programs
        self.head_dim = cfg.head_dim
        self.embed_scale = float(cfg.hidden_size**0.5) if cfg.embed_scale else None
        self.dtype = dtype

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask_: jax.Array | None = None,
        positions: jax.Array | None = None,
        expert_choices: jax.Array | None = None,
        *,
        embeddings: jax.Array | None = None,
        blocks: jax.Array | None = None,
    ) -> jax.Array:
        """Hidden states for `input_ids` [batch, length]; `expert_choices` [batch, length, moe layers, k] replays a
        mixture of experts' routes (`hfjax.models.moe`). A vision-language model passes its input `embeddings`
        [batch, length, embed] (image soft tokens in place of their placeholders) and the image `blocks` [batch,
        length] whose positions attend to each other both ways (`attention_mask`)."""
        batch, length = input_ids.shape
        segments = (
            jnp.ones((batch, length), jnp.int32) if attention_mask_ is None else attention_mask_.astype(jnp.int32)
        )
        if positions is None:
            positions = positions_from_mask(segments)
        index = jnp.arange(length, dtype=jnp.int32)
        windows = dict.fromkeys(layer.window for layer in self.layers)  # first-seen order: one trace everywhere
        masks = {w: attention_mask(segments, index, index, w, blocks) for w in windows}
        tables = self.rotary(positions)
        x = constrain(self.embed(input_ids) if embeddings is None else embeddings, RESIDUAL)
        for layer in self.layers:
            step = (*tables[layer.rope], masks[layer.window], segments)
            x = _layer_step(layer, x, step, self.remat, expert_choices, sees_ahead=blocks is not None)
        return constrain(self.norm(x), RESIDUAL)

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """Token embeddings [..., embed] in the compute dtype (`lookup_rows`: looked up where the table's `embed`
        shards live, then one all-to-all to rows split over every batch axis), times sqrt(hidden) rounded to the
        compute dtype where the family scales them (Gemma, as transformers does)."""
        x = lookup_rows(self.embed_tokens[...], input_ids).astype(self.dtype)
        return x if self.embed_scale is None else x * jnp.asarray(self.embed_scale, self.dtype)

    def rotary(self, positions: jax.Array) -> dict[RopeConfig, tuple[jax.Array, jax.Array]]:
        """Rotary cos and sin tables [batch, length, head_dim] for integer positions [batch, length], per rotary
        embedding of the layers (a layer reads `tables[layer.rope]`)."""
        ropes = dict.fromkeys(layer.rope for layer in self.layers)
        return {rope: rope_tables(positions, rope_inv_freq(rope, self.head_dim), self.dtype) for rope in ropes}


class _Backbone(nnx.Module):
    """Shared constructor of the heads: config, dtypes and the `model` decoder (HF's attribute name)."""

    head_kind: str = ""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype | None = None,
        rngs: nnx.Rngs | None,
        init_std: float = 0.02,
    ):
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype or dtype)
        self.model = Decoder(cfg, self.dtype, self.param_dtype, rngs, init_std)

    def _head_param(self, rngs: nnx.Rngs | None, std: float, out: int, axis: str) -> nnx.Param:
        return logical_param(rngs, normal_init(std), (out, self.config.hidden_size), (axis, "embed"), self.param_dtype)

    def _to_float32(self, hidden: jax.Array, kernel: jax.Array) -> jax.Array:
        return dense(hidden, kernel.astype(self.dtype), jnp.float32)


class CausalLM(_Backbone):
    """Decoder + LM head (tied to the embedding when the config says so). Call -> logits [b, t, vocab_size] float32
    (HF's shape); `logits` keeps the masked padding columns, for the samplers and losses."""

    head_kind = "causal_lm"

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype | None = None,
        rngs: nnx.Rngs | None,
        init_std: float = 0.02,
    ):
        super().__init__(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs, init_std=init_std)
        self.lm_head = None if cfg.tie_word_embeddings else vocab_param(cfg, rngs, init_std, self.param_dtype)

    def __call__(
        self, input_ids: jax.Array, attention_mask: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        return self.logits(self.model(input_ids, attention_mask, positions))[..., : self.config.vocab_size]

    @property
    def head_kernel(self) -> nnx.Param:
        """The LM head [padded_vocab_size, embed]: the embedding when tied."""
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def token_logprobs(
        self,
        hidden: jax.Array,
        labels: jax.Array,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        chunk_tokens: int | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """(log softmax(logits / temperature)[labels], entropy or None) [rows, length] float32 for hidden states
        [rows, length, embed], computed a chunk of about `chunk_tokens` tokens per device at a time (default
        `hfjax.models.lm_head.LOGITS_CHUNK_TOKENS`): never the [rows, length, vocab] logits, unless (with the default
        chunk) a device's whole logits fit `hfjax.models.lm_head.LOGITS_BUDGET_BYTES`: then they are made once and
        kept for the backward, which does not recompute them."""
        chunk = chunk_length(chunk_tokens or lm_head.LOGITS_CHUNK_TOKENS, hidden.shape[0])
        return token_logprobs(
            hidden,
            self.head_kernel[...],
            labels,
            vocab_size=self.config.vocab_size,
            temperature=temperature,
            softcap=self.config.final_softcap,
            chunk=chunk,
            with_entropy=with_entropy,
            logits_budget_bytes=None if chunk_tokens else lm_head.LOGITS_BUDGET_BYTES,
        )

    def logits(self, hidden: jax.Array) -> jax.Array:
        """LM-head logits [..., padded_vocab_size] float32 for hidden states [..., embed]; the padding columns hold
        `MASKED_SCORE`; soft-capped where the config says (Gemma 2). Materialises every logit: for the log probs of
        given tokens use `token_logprobs`."""
        kernel = self.head_kernel
        logits = softcap_logits(self._to_float32(hidden, kernel[...]), self.config.final_softcap)
        positions = ("length",) if hidden.ndim == 3 else (None,) * (hidden.ndim - 2)
        logits = constrain(logits, ("batch", *positions, "vocab"))
        return mask_vocab_padding(logits, self.config.vocab_size)


class SequenceClassifier(_Backbone):
    """Reward/cost model: a bias-free score head read at each row's last real token. Call -> [b, num_labels]."""

    head_kind = "seq_cls"

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype | None = None,
        rngs: nnx.Rngs | None,
        init_std: float = 0.02,
    ):
        super().__init__(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs, init_std=init_std)
        self.score = self._head_param(rngs, init_std, cfg.num_labels, "labels")

    def token_scores(
        self, input_ids: jax.Array, attention_mask: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        """Scores at every position [b, t, num_labels]."""
        return self._to_float32(self.model(input_ids, attention_mask, positions), self.score[...])

    def __call__(
        self, input_ids: jax.Array, attention_mask: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        scores = self.token_scores(input_ids, attention_mask, positions)
        mask = jnp.ones(input_ids.shape, jnp.int32) if attention_mask is None else attention_mask
        return jnp.take_along_axis(scores, last_token_index(mask)[:, None, None], axis=1)[:, 0, :]


class Critic(_Backbone):
    """Value model: the causal backbone with a scalar head (with bias) per token. Call -> values [b, t] float32.

    Stored in HF as `*ForTokenClassification` with one label; built from a causal-LM checkpoint, the head starts
    from `init_std` normal weights and a zero bias.
    """

    head_kind = "token_cls"

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype | None = None,
        rngs: nnx.Rngs | None,
        init_std: float = 0.02,
    ):
        super().__init__(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs, init_std=init_std)
        if cfg.num_labels != 1:
            raise ValueError(f"Critic needs num_labels=1, got {cfg.num_labels}")
        self.score = self._head_param(rngs, init_std, 1, "labels")
        self.score_bias = logical_param(rngs, jax.nn.initializers.zeros, (1,), ("labels",), self.param_dtype)

    def __call__(
        self, input_ids: jax.Array, attention_mask: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        hidden = self.model(input_ids, attention_mask, positions)
        values = self._to_float32(hidden, self.score[...]) + self.score_bias[...].astype(jnp.float32)
        return values[..., 0]


HEAD_CLASSES: dict[str, type[_Backbone]] = {cls.head_kind: cls for cls in (CausalLM, SequenceClassifier, Critic)}
