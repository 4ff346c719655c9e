"""Token ids of prompts and observations, from a Hugging Face tokenizer's chat template. A multi-turn trajectory is
one token sequence (prompt, model turn, observation, model turn, ...) that grows by appending: the model's turns are
its own sampled tokens, and `observation_tokens` gives what the chat template writes after a model turn, without
re-rendering (or re-tokenizing) the turns before it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hfjax.envs.base import EnvError, Observation, check_observation

# The conversation that new messages are rendered after. Its assistant content locates the end of the model's turn
# in the template's rendering (the last occurrence of it there).
_BASE_USER = {"role": "user", "content": "Hi."}
_BASE_ASSISTANT = {"role": "assistant", "content": "Hello."}


def _template(tokenizer: Any, messages: list[dict[str, Any]], tokenize: bool, **kwargs: Any) -> Any:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=tokenize, **kwargs)
    except Exception as exc:  # jinja templates raise their own errors (e.g. "roles must alternate")
        roles = [m.get("role") for m in messages]
        raise EnvError(f"the chat template cannot render roles {roles}: {type(exc).__name__}: {exc}") from exc


def _template_ids(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """`apply_chat_template(..., tokenize=True)` as a list of ints: transformers 5 returns a BatchEncoding (a
    mapping with "input_ids") where older versions return the list itself."""
    ids = _template(tokenizer, messages, tokenize=True, **kwargs)
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def prompt_tokens(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The chat template's rendering of `messages` with the generation prompt (and the `tools` schemas if given)."""
    kwargs = {"tools": tools} if tools else {}
    return _template_ids(tokenizer, messages, add_generation_prompt=True, **kwargs)


def _model_turn_end(tokenizer: Any, base_ids: list[int], eos_token_ids: Sequence[int]) -> int:
    """How many tokens of the base rendering the model's turn covers: through the first stop token after the
    assistant's content when the template writes one, else through the content."""
    text = _template(tokenizer, [_BASE_USER, _BASE_ASSISTANT], tokenize=False)
    content_at = text.rfind(_BASE_ASSISTANT["content"])
    if content_at < 0:
        raise EnvError("the chat template does not write the assistant's content; cannot place observations after it")
    through_content = tokenizer.encode(text[: content_at + len(_BASE_ASSISTANT["content"])], add_special_tokens=False)
    end = len(through_content)
    if base_ids[:end] != list(through_content):
        raise EnvError("the chat template's token ids do not split where the assistant's content ends")
    stops = set(eos_token_ids)
    return next((i + 1 for i in range(end, len(base_ids)) if base_ids[i] in stops), end)


def observation_tokens(tokenizer: Any, observation: Observation, eos_token_ids: Sequence[int]) -> list[int]:
    """The token ids to append after a model turn that ended with one of `eos_token_ids` (its stop token), so that
    the next model turn follows them. Token ids are returned as they are; text is encoded without special tokens.

    Messages: what the chat template writes after the model's turn, up to and including the generation prompt of
    the next assistant turn. A fixed conversation (user, assistant) is rendered alone and followed by the messages;
    the observation is the longer rendering's tokens after the model's turn, which ends
      - at the first stop token after the assistant's content, when the template closes the turn with one (ChatML's
        `<|im_end|>`, Llama 3's `<|eot_id|>`): the model sampled that token itself, so the sequence equals the
        template's rendering of the whole conversation exactly;
      - right after the assistant's content, when the template writes no stop token there (e.g. a plain
        "role: content\\n" template): the model's stop token stays in the sequence where its content ends, so the
        sequence equals the template's rendering with that one token added.
    Raises EnvError if the template renders the turns before the messages differently once messages follow them
    (e.g. a template that drops reasoning from all but the last assistant turn), since the observation would then
    not continue the model's actual tokens."""
    observation = check_observation(observation, "observation_tokens")
    if not observation:
        return []
    if isinstance(observation, str):
        return list(tokenizer.encode(observation, add_special_tokens=False))
    if isinstance(observation[0], int):
        return list(observation)
    base = _template_ids(tokenizer, [_BASE_USER, _BASE_ASSISTANT])
    longer = _template_ids(tokenizer, [_BASE_USER, _BASE_ASSISTANT, *observation], add_generation_prompt=True)
    end = _model_turn_end(tokenizer, base, eos_token_ids)
    if longer[:end] != base[:end]:
        raise EnvError(
            "the chat template renders the assistant turn differently when messages follow it (it re-renders earlier "
            "turns), so an observation cannot be appended to the model's own tokens; use a template that renders "
            "each turn independently of later ones, or return token ids from the environment"
        )
    return longer[end:]
