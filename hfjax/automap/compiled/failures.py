"""A program of `hfjax compile` that failed to trace, lower or compile for its target, as one row of the report: its
name, a short class of the error (`classify`), the first line of the message that says what went wrong, and the
config knob to turn (`knob`), keyed by the class and the program's kind."""

from __future__ import annotations

import dataclasses
import re

MESSAGE_CHARS = 160  # a failure's message is trimmed to this many characters
ATTENTION_XLA = "HFJAX_ATTENTION=xla (XLA attention instead of the Pallas kernel)"

# the config key of each program group's layout and micro-batch (the reward and cost models' groups: reward, cost)
LAYOUT_KEYS = {
    "actor": "actor.train_layout",
    "critic": "critic.layout",
    "rollout": "rollout.gen_layout",
    "reward": "reward.reward_model.layout",
    "cost": "reward.cost_model.layout",
}
MICRO_BATCH_KEYS = {
    "actor": "actor.micro_batch_size",
    "critic": "critic.micro_batch_size",
    "rollout": "rollout.slots",
    "reward": "reward.reward_model.micro_batch_size",
    "cost": "reward.cost_model.micro_batch_size",
}
PROGRAM_KINDS = ("loss+grad", "optimizer step", "log probs", "ref log probs", "values", "scores", "prefill", "decode")

_SCOPED_VMEM = re.compile(r"scoped ?vmem|scoped allocation", re.IGNORECASE)
_VMEM = re.compile(r"\bvmem\b", re.IGNORECASE)
_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|out of memory|exceeds? (the )?available hbm", re.IGNORECASE)
# per class: the part of a long message worth its line, where the first line leaves it out
_KEY_PART = {
    "scoped VMEM": re.compile(r"scoped allocation with size \S+ and limit \S+[^\n]*", re.IGNORECASE),
    "VMEM": re.compile(r"(ran out of memory in memory space vmem|used \S+ of \S+ vmem)[^\n]*", re.IGNORECASE),
    "out of memory": re.compile(r"(ran out of memory|out of memory|used \S+ of \S+ hbm)[^\n]*", re.IGNORECASE),
}
_NOISE = re.compile(r"^(-+|=+|Traceback \(most recent call last\):|For simplicity, JAX has removed.*)$")


@dataclasses.dataclass(frozen=True)
class ProgramFailure:
    """A program that did not compile: its group and name, the error's class, its message's first line, the knob."""

    group: str
    program: str
    error_class: str
    message: str
    knob: str

    @classmethod
    def of(cls, group: str, program: str, error: BaseException, remat: str | None = None) -> ProgramFailure:
        """`error` of `group`'s `program` as its row; `remat`: the group's rematerialisation setting, where it has
        one (the knob of an update that runs out of memory starts with it)."""
        error_class, message = classify(error)
        return cls(group, program, error_class, message, knob(error_class, group, program, remat))

    def line(self) -> str:
        """One line: the program, the error class and the knob to turn."""
        return f"failed to compile ({self.error_class}): {self.group} {self.program}: try {self.knob}"


def classify(error: BaseException) -> tuple[str, str]:
    """(a short class of `error`, the first meaningful line of its message trimmed to `MESSAGE_CHARS`). Classes:
    "scoped VMEM" (a Pallas TPU kernel's scoped vector memory: CompileTimeScopedVmemOom), "VMEM" (vector memory
    otherwise), "out of memory" (RESOURCE_EXHAUSTED, device memory), "shape" (a ValueError or TypeError: while
    tracing, shapes or shardings that do not fit together), else the exception's type name."""
    text = str(error)
    if _SCOPED_VMEM.search(text):
        error_class = "scoped VMEM"
    elif _VMEM.search(text):
        error_class = "VMEM"
    elif _OUT_OF_MEMORY.search(text) or isinstance(error, MemoryError):
        error_class = "out of memory"
    elif isinstance(error, (ValueError, TypeError)):
        error_class = "shape"
    else:
        error_class = type(error).__name__
    return error_class, _message(text, _KEY_PART.get(error_class)) or type(error).__name__


def _trim(line: str) -> str:
    line = " ".join(line.split())
    return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 3].rstrip() + "..."


def _message(text: str, key: re.Pattern[str] | None) -> str:
    """The first line of `text` that says something (not blank, not a separator), trimmed; where that line, trimmed,
    leaves out the part `key` finds in `text`, that part instead."""
    lines = [line.strip() for line in text.splitlines()]
    first = next((line for line in lines if line and not _NOISE.match(line)), "")
    trimmed = _trim(first)
    found = key.search(text) if key is not None else None
    if found is not None and found.group(0).strip() not in trimmed:
        return _trim(found.group(0))
    return trimmed


def program_kind(program: str) -> str:
    """The kind of a program of the report ("decode" for "decode 64 slots"); "" for none known."""
    return next((kind for kind in PROGRAM_KINDS if program.startswith(kind)), "")


def knob(error_class: str, group: str, program: str, remat: str | None = None) -> str:
    """What to change in the config (or the environment) so that the program compiles or fits, by the class of its
    error ("out of memory" also for a program that compiles over the limit) and its kind. `remat`: the group's
    `remat` setting where known; an update that runs out of memory without `full` is told to turn it first (it keeps
    only each layer's input for the backward: the cheapest cut in memory, about a third more FLOPs)."""
    kind = program_kind(program)
    layout = LAYOUT_KEYS.get(group, f"{group}'s layout")
    batch = MICRO_BATCH_KEYS.get(group, f"{group}'s micro_batch_size")
    if error_class in ("scoped VMEM", "VMEM"):
        if kind == "decode":
            return f"{ATTENTION_XLA}, or fewer rollout.slots / a shorter rollout.response_length"
        if kind == "prefill":
            return f"{ATTENTION_XLA}, or a shorter data.max_prompt_length"
        return f"{ATTENTION_XLA}, or shorter rows (data.max_prompt_length, rollout.response_length)"
    if error_class == "out of memory":
        if kind == "loss+grad":
            split = f"more fsdp (or a sequence axis for long rows) in {layout}"
            if remat in ("none", "dots"):
                return f"{group}.remat: full (it is {remat!r}) first, then {batch} or {split}"
            return f"{batch}, {split}" + ("" if remat == "full" else f", or {group}.remat: full")
        return {
            "optimizer step": f"more fsdp in {layout}, or rollout.offload_optimizer",
            "prefill": "fewer rollout.slots (the largest prefill call) or a shorter data.max_prompt_length",
            "decode": "fewer rollout.slots, a shorter rollout.response_length, rollout.prompt_cache_tokens, or more "
            "tensor in rollout.gen_layout",
        }.get(kind, f"{batch}, or more fsdp in {layout}")
    if error_class == "shape":
        return f"{layout} (each mesh axis must divide the dimension it splits) or {batch}"
    return "what the message says (`hfjax --debug compile ...` logs the traceback)"
