"""The configuration reference (docs/configuration.md), generated from the typed config dataclasses so it cannot
drift: every key with its type, its default and its description — the comment beside or above the field in the
source, else a note of `NOTES` below — one table per section, each headed by its dataclass's docstring.

`python -m hfjax.cli.config_reference > docs/configuration.md` regenerates the page; `tests/test_docs.py` fails when the
page differs from `render()`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from hfjax.typed_config import yaml_key

# Descriptions of fields that have no comment in the source (a source comment, when one is added, takes over:
# tests/test_docs.py fails while a note shadows one). Keys are `Class.field`.
NOTES: dict[str, str] = {
    "RLConfig.model_path": "default checkpoint of every role that names none (a Hugging Face directory)",
    "RLConfig.tokenizer_path": "tokenizer directory; empty: the actor's checkpoint",
    "DataConfig.train_files": "RL prompt files in verl's schema (parquet or JSONL)",
    "DataConfig.val_files": "held-out prompt files, scored at `trainer.test_freq` and at the end",
    "DataConfig.max_prompt_length": "prompt tokens after the chat template; longer prompts follow `truncation`",
    "DataConfig.truncation": "over-long prompts: stop with an error, drop them, or cut from the left or right",
    "DataConfig.train_batch_size": "prompts per RL step (each sampled `rollout.n` times)",
    "DataConfig.val_batch_size": "prompts per validation batch",
    "DataConfig.shuffle": "shuffle the training prompts every epoch",
    "DataConfig.seed": "seed of the shuffle",
    "ActorConfig.model_path": "the policy's checkpoint; empty: the top-level `model_path`",
    "ActorConfig.train_layout": "training layout (`{mesh: {...}, rules: ...}`); null: fsdp over the group's devices",
    "ActorConfig.optim": "AdamW settings of the policy",
    "ActorConfig.ppo_epochs": "passes over the rollout batch per step",
    "ActorConfig.ppo_mini_batch_size": "rows (samples) per optimizer step, over the whole group",
    "ActorConfig.micro_batch_size": "rows per forward/backward (gradient accumulation), over the whole group",
    "ActorConfig.policy_loss": "`ppo` (clipped), `gspo` (sequence ratio), `pg` (plain), or `path/to/file.py:function`",
    "ActorConfig.clip_ratio_low": "PPO clip: the ratio's lower bound is 1 - clip_ratio_low",
    "ActorConfig.clip_ratio_high": "PPO clip: the ratio's upper bound is 1 + clip_ratio_high (clip-higher when larger)",
    "ActorConfig.clip_ratio_c": "dual-clip bound on the loss of tokens with negative advantages",
    "ActorConfig.loss_agg_mode": "how token losses aggregate into the batch loss",
    "ActorConfig.entropy_coeff": "weight of the entropy bonus",
    "ActorConfig.use_kl_loss": "add a KL to the reference policy to the loss (GRPO-style; needs the reference)",
    "ActorConfig.kl_loss_coef": "weight of that KL loss",
    "ActorConfig.kl_loss_type": "KL estimator of the loss: `k1` (`kl`), `abs`, `k2` (`mse`), `k3` (`low_var_kl`)",
    "ActorConfig.rollout_correction": "off-policy correction against the rollout's own log probs",
    "RolloutConfig.n": "samples per prompt",
    "RolloutConfig.temperature": "sampling temperature",
    "RolloutConfig.top_k": "top-k sampling (0: off)",
    "RolloutConfig.top_p": "nucleus sampling (1: off)",
    "RolloutConfig.response_length": "most response tokens per sample",
    "RolloutConfig.slots": "concurrent sequences of continuous batching (KV cache rows) per host",
    "RolloutConfig.seed": "seed of the sampling keys",
    "RolloutConfig.gen_layout": "generation layout; null: data parallel over the group's devices",
    "RolloutConfig.hybrid_engine": "train <-> gen transitions: zero-redundancy, or keep both copies (`naive`)",
    "CriticConfig.model_path": "the value model's checkpoint; empty: the top-level `model_path`",
    "CriticConfig.layout": "training layout of the critic; null: fsdp over the group's devices",
    "CriticConfig.optim": "AdamW settings of the critic",
    "CriticConfig.ppo_epochs": "passes over the rollout batch per step",
    "CriticConfig.ppo_mini_batch_size": "rows per optimizer step, over the whole group",
    "CriticConfig.micro_batch_size": "rows per forward/backward, over the whole group",
    "CriticConfig.cliprange_value": "clip of the new values around the old ones in the value loss",
    "CriticConfig.loss_agg_mode": "how token losses aggregate into the batch loss",
    "RewardConfig.function": "rule reward `path/to/file.py:function`; null: dispatch by each row's `data_source`",
    "RewardConfig.use_rule": "score with the rule reward (added to the reward model's score when both are on)",
    "RewardConfig.reward_model": "a reward model (sequence score); off while its `model_path` is empty",
    "RewardConfig.cost_model": "the cost model of Safe-RLHF; off while its `model_path` is empty",
    "RewardModelConfig.model_path": "the score model's checkpoint; empty: not used",
    "RewardModelConfig.dtype": "compute and storage dtype (the model is frozen)",
    "RewardModelConfig.layout": "layout of the score model; null: fsdp over the group's devices",
    "RewardModelConfig.micro_batch_size": "rows per forward pass, over the whole group",
    "AlgorithmConfig.name": "the dataflow program (`hfjax/trainer/programs.py`)",
    "AlgorithmConfig.gamma": "discount of GAE and REINFORCE++ returns",
    "AlgorithmConfig.lam": "GAE lambda",
    "AlgorithmConfig.norm_adv_by_std": "GRPO: divide by the group's standard deviation (false: Dr. GRPO)",
    "AlgorithmConfig.use_kl_in_reward": "subtract a KL penalty to the reference from the token rewards",
    "AlgorithmConfig.kl_penalty": "KL estimator of that penalty",
    "AlgorithmConfig.kl_ctrl": "fixed or adaptive coefficient of the in-reward KL",
    "AlgorithmConfig.kl_coef": "(initial) coefficient of the in-reward KL",
    "AlgorithmConfig.target_kl": "adaptive KL controller: the KL it steers towards",
    "AlgorithmConfig.horizon": "adaptive KL controller: its horizon in samples",
    "AlgorithmConfig.cost_limit": "Safe-RLHF: the mean cost the Lagrange multiplier enforces",
    "AlgorithmConfig.lambda_init": "Safe-RLHF: the multiplier's initial value",
    "AlgorithmConfig.lambda_lr": "Safe-RLHF: the multiplier's step size",
    "TrainerConfig.run_dir": "checkpoints, metrics, timeline and the resolved config",
    "TrainerConfig.total_steps": "RL steps of the run",
    "TrainerConfig.critic_warmup": "steps that update only the critic",
    "TrainerConfig.backend": "`ray` worker processes, or `local` (in this process; colocate only)",
    "TrainerConfig.hosts": "hosts of the cluster (one JAX process per host per worker group)",
    "TrainerConfig.devices_per_host": "devices of each host",
    "TrainerConfig.ray_address": "Ray cluster to join (else `RAY_ADDRESS`, else a local Ray is started)",
    "TrainerConfig.save_freq": "checkpoint every this many steps (0: at the end only)",
    "TrainerConfig.test_freq": "validate every this many steps (0: at the end only)",
    "TrainerConfig.val_before_train": "validate once before the first step",
    "TrainerConfig.resume": "`auto`: continue from the newest complete checkpoint in `run_dir`; `never`: refuse one",
    "TrainerConfig.max_to_keep": "checkpoints kept per role",
    "TrainerConfig.project_name": "W&B project of the run (`logger` with `wandb`)",
    "TrainerConfig.progress": "show a progress bar",
    "AsyncConfig.max_staleness": "policy versions a rollout batch may lag the trainer (0: synchronous)",
    "AsyncConfig.check_every": "partial rollouts: decode steps between checks for newer weights",
    "HealthConfig.max_skipped_steps": "stop after this many consecutive steps skipped for non-finite gradients",
    "HealthConfig.max_flat_reward_steps": "stop after this many consecutive steps in which every response scored alike",
    "HealthConfig.on_stall": "`stop` the run, or only `warn`",
    "LivenessConfig.heartbeat_s": "seconds between pings of the ranks a call waits for",
    "LivenessConfig.silent_after_s": "a rank silent this long is reported hung",
    "LivenessConfig.deadline_s": "deadline in seconds per method (`default` for the others)",
    "OptimConfig.lr": "peak learning rate",
    "OptimConfig.weight_decay": "decoupled weight decay",
    "OptimConfig.b1": "Adam beta 1",
    "OptimConfig.b2": "Adam beta 2",
    "OptimConfig.eps": "Adam epsilon",
    "OptimConfig.grad_clip": "global-norm gradient clipping (0: off)",
    "OptimConfig.warmup_steps": "linear warm-up updates",
    "OptimConfig.schedule": "after the warm-up: constant, or cosine down to `min_lr_ratio * lr`",
    "OptimConfig.min_lr_ratio": "cosine schedule: the final learning rate as a fraction of `lr`",
    "ModelSection.path": "the starting checkpoint (a Hugging Face directory)",
    "ModelSection.tokenizer_path": "tokenizer directory; null: `path`",
    "ModelSection.layout": "training layout; null: fsdp over every device",
    "DataSection.train_files": "training files (parquet or JSONL)",
    "DataSection.val_files": "held-out files, evaluated at `trainer.val_freq` and at the end",
    "DataSection.max_length": "every sequence is padded (or truncated) to this length",
    "DataSection.truncation": "over-long rows: stop with an error, drop them, or cut from the left or right",
    "DataSection.batch_size": "rows per optimizer step",
    "DataSection.micro_batch_size": "rows per forward/backward (gradient accumulation)",
    "DataSection.shuffle": "shuffle the rows every epoch",
    "TrainerSection.run_dir": "checkpoints, metrics, the resolved config and the export (`hf/`)",
    "TrainerSection.epochs": "passes over the training files",
    "TrainerSection.total_steps": "optimizer steps at most (caps `epochs`); null: no cap",
    "TrainerSection.save_freq": "checkpoint every this many steps (0: at the end only)",
    "TrainerSection.val_freq": "evaluate every this many steps (0: at the end only)",
    "TrainerSection.max_to_keep": "checkpoints kept",
    "TrainerSection.resume": "`auto`: continue from the newest readable checkpoint; `never`: refuse one",
    "TrainerSection.log_freq": "print metrics every this many steps",
    "TrainerSection.seed": "seed of the shuffle and of fresh heads",
    "TrainerSection.export_hf": "write the trained model as a Hugging Face checkpoint at the end",
    "TrainerSection.progress": "show a progress bar",
    "QuickstartConfig.run_dir": "where the task, tokenizer, base model and both stages' runs go",
    "QuickstartConfig.task": "the task's settings (`AdditionTask`, `MultiplicationTask` or `ShapesTask` fields, below)",
    "QuickstartConfig.model": "the random base model",
    "QuickstartConfig.sft": "the SFT stage: an `hfjax sft` config; model, data and run directory are filled in",
    "QuickstartConfig.rl": "the RL stage: an `hfjax train` config; model, prompts and run directory are filled in",
    "BaseModelSection.hidden_size": "model width",
    "BaseModelSection.intermediate_size": "MLP width",
    "BaseModelSection.num_layers": "decoder layers",
    "BaseModelSection.num_heads": "attention heads",
    "BaseModelSection.num_kv_heads": "key/value heads (GQA)",
    "BaseModelSection.seed": "seed of the random weights",
    "VisionTowerSection.hidden_size": "tower width",
    "VisionTowerSection.intermediate_size": "tower MLP width",
    "VisionTowerSection.num_layers": "tower layers",
    "VisionTowerSection.num_heads": "tower attention heads",
    "VisionTowerSection.patch_size": "pixels a side of a patch",
    "AdditionTask.min_digits": "fewest digits of an operand",
    "AdditionTask.max_digits": "most digits of an operand",
    "AdditionTask.num_train": "RL training prompts",
    "AdditionTask.num_test": "held-out prompts (greedy accuracy before and after RL)",
    "AdditionTask.num_sft": "supervised examples",
    "AdditionTask.seed": "seed of the problems and splits",
    "AdditionTask.sft_carry_slip": "fraction of carry problems whose SFT answer forgets the units carry",
}


@dataclasses.dataclass(frozen=True)
class Page:
    """One config file format: its title, the command that reads it, its root dataclass and extra sections (a
    dict-typed field that is validated as another dataclass, as `QuickstartConfig.task`)."""

    title: str
    command: str
    root: type
    extra: tuple[tuple[str, type], ...] = ()


def pages() -> list[Page]:
    """The documented config formats, in page order."""
    from hfjax.cli.quickstart import QuickstartConfig
    from hfjax.config.rl import RLConfig
    from hfjax.config.supervised import RMConfig, SFTConfig
    from hfjax.data.shapes_task import ShapesTask
    from hfjax.data.synthetic import AdditionTask
    from hfjax.data.tool_task import MultiplicationTask

    return [
        Page("RL run", "hfjax train CONFIG [key=value ...]", RLConfig),
        Page("Supervised fine-tuning", "hfjax sft CONFIG [key=value ...]", SFTConfig),
        Page("Reward-model training", "hfjax rm CONFIG [key=value ...]", RMConfig),
        Page("Quickstart", "hfjax quickstart [CONFIG] [key=value ...]", QuickstartConfig, (("task", AdditionTask),)),
        Page(
            "Agent quickstart task (`task_type: calculator`)",
            "hfjax quickstart agent_quickstart.yaml [key=value ...]",
            MultiplicationTask,
        ),
        Page(
            "Vision quickstart task (`task_type: shapes`)",
            "hfjax quickstart vision_quickstart.yaml [key=value ...]",
            ShapesTask,
        ),
    ]


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    description: str


@dataclasses.dataclass(frozen=True)
class Section:
    path: str
    cls: type
    rows: tuple[Row, ...]


def type_text(tp: Any) -> str:
    """A field's type as it reads in YAML terms: `int`, `"a" | "b"`, `float | null`, `list[str]`, `section`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "section"
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def default_text(value: Any) -> str:
    """A default as YAML (flow style); `required` for a field without one."""
    if value is dataclasses.MISSING:
        return "required"
    if dataclasses.is_dataclass(value):
        return ""
    if isinstance(value, Path):
        value = str(value)
    return yaml.safe_dump(value, default_flow_style=True, width=1_000_000).strip().removesuffix("\n...").strip()


@functools.cache
def source_comments(cls: type) -> dict[str, str]:
    """Comments of the fields `cls` itself declares: the comment lines right above a field and the comment at the
    end of its line, joined."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whole line)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            whole = not token.line[: token.start[1]].strip()
            comments[token.start[0]] = (token.string.lstrip("#").strip(), whole)
    body = ast.parse(source).body[0]
    found = {}
    for node in getattr(body, "body", []):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line in comments and comments[line][1]:
            above.insert(0, comments[line][0])
            line -= 1
        inline = [text for n, (text, whole) in comments.items() if node.lineno <= n <= node.end_lineno and not whole]
        text = " ".join(above + inline).strip()
        if text:
            found[node.target.id] = text
    return found


def declaring_class(cls: type, name: str) -> type:
    """The class in `cls`'s MRO that declares field `name`."""
    for klass in cls.__mro__:
        if name in inspect.get_annotations(klass):
            return klass
    return cls


def describe(cls: type, name: str) -> str:
    """The description of field `name` of `cls`: its source comment, else its note, else empty."""
    owner = declaring_class(cls, name)
    return source_comments(owner).get(name) or NOTES.get(f"{owner.__name__}.{name}", "")


def _field_value(field: dataclasses.Field, instance: Any) -> Any:
    if instance is not None:
        return getattr(instance, field.name)
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def sections(cls: type, path: str = "", instance: Any = None) -> Iterator[Section]:
    """The section at `path` (values from `instance`, else the fields' defaults) and, depth first, its subsections."""
    hints = typing.get_type_hints(cls)
    rows, children = [], []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        key = f"{path}.{yaml_key(field.name)}" if path else yaml_key(field.name)
        value, tp = _field_value(field, instance), hints[field.name]
        rows.append(Row(key, type_text(tp), default_text(value), describe(cls, field.name)))
        if dataclasses.is_dataclass(tp):
            children.append((tp, key, value if dataclasses.is_dataclass(value) else None))
    yield Section(path, cls, tuple(rows))
    for child, key, value in children:
        yield from sections(child, key, value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _anchor(text: str) -> str:
    """GitHub's heading anchor of `text`."""
    kept = "".join(c for c in text.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    generated = doc.startswith(f"{cls.__name__}(")  # dataclasses invent a signature when there is no docstring
    return "" if generated else " ".join(doc.split())


def render_page(page: Page, seen: dict[tuple[type, tuple[Row, ...]], str]) -> list[str]:
    """The markdown of one config format; a section equal to one already written (same class, keys and defaults
    under the same path) links to it instead of repeating it."""
    out = [f"## {page.title}", "", f"`{page.command}` reads this format (root: `{page.root.__name__}`).", ""]
    doc = _doc(page.root)
    out += [doc, ""] if doc else []
    all_sections = list(sections(page.root))
    for key, cls in page.extra:
        all_sections += list(sections(cls, key))
    for section in all_sections:
        heading = f"{page.title}: `{section.path}`" if section.path else f"{page.title}: top level"
        out += [f"### {heading}", ""]
        signature = (section.cls, tuple(dataclasses.replace(r, key=r.key.split(".")[-1]) for r in section.rows))
        doc = _doc(section.cls) if section.path else ""
        out += [f"`{section.cls.__name__}`: {doc}", ""] if doc else [f"`{section.cls.__name__}`.", ""]
        if signature in seen and section.path:
            out += [f"Same keys and defaults as [{seen[signature]}](#{_anchor(seen[signature])}).", ""]
            continue
        seen.setdefault(signature, heading)
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        for row in section.rows:
            default, text = f"`{_cell(row.default)}`", _cell(row.description)
            if row.type == "section":
                link = f"[`{row.key}`](#{_anchor(f'{page.title}: `{row.key}`')})"
                default, text = "", f"{text}; see {link}" if text else f"see {link}"
            out.append(f"| `{row.key}` | {_cell(row.type)} | {default} | {text} |")
        out.append("")
    return out


def render() -> str:
    """The whole configuration reference as markdown."""
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m hfjax.cli.config_reference > docs/configuration.md` from the config",
        "dataclasses; do not edit: tests/test_docs.py fails when this page differs from the generator's output.",
        "-->",
        "",
        "Every config is YAML read into typed dataclasses; any key can also be set on the command line as",
        "`section.key=value` (values parsed as YAML). An unknown key, a value of the wrong type or out of its range,",
        "and an unknown registry name stop the command before any work starts, naming the full dotted key. A",
        "section's keys are written under its path, e.g. `actor.optim.lr` is `lr` inside `optim` inside `actor`.",
        "Layouts (`train_layout`, `gen_layout`, `layout`) are `{mesh: {axis: size}, rules: preset | [[logical,",
        "[mesh axes]], ...]}`; see [layouts.md](layouts.md).",
        "",
    ]
    all_pages = pages()
    out += [f"- [{p.title}](#{_anchor(p.title)}): `{p.command}`" for p in all_pages]
    out.append("")
    seen: dict[tuple[type, tuple[Row, ...]], str] = {}
    for page in all_pages:
        out += render_page(page, seen)
    return "\n".join(out).rstrip() + "\n"


def stale_notes() -> list[str]:
    """Notes that name no field, or shadow a source comment (so the note should go)."""
    classes = {}
    for page in pages():
        for section in [*sections(page.root), *(s for key, cls in page.extra for s in sections(cls, key))]:
            for klass in section.cls.__mro__:
                if dataclasses.is_dataclass(klass):
                    classes[klass.__name__] = klass
    stale = []
    for key in NOTES:
        name, _, field = key.partition(".")
        klass = classes.get(name)
        if klass is None or field not in {f.name for f in dataclasses.fields(klass)}:
            stale.append(f"{key}: no such config field")
        elif field in source_comments(declaring_class(klass, field)):
            stale.append(f"{key}: the field has a source comment now; remove the note")
    return stale


if __name__ == "__main__":
    print(render(), end="")
