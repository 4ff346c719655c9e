"""`hfjax compile CONFIG --target T`: compiles a run's programs for a target (`hfjax.automap.compiled.targets`) at
the config's shapes, and reports per program the compiler's bytes per device, what stays resident beside it, the
peak against the device's usable memory, and the cost model's prediction of the group's peak beside it.

A run fits when every program's peak is at most `FIT_FRACTION` of the usable memory (on a GPU, JAX's preallocated
fraction). When one does not, the report names the program and the config knob that shrinks it. Each program is
traced and compiled on its own: one that fails (the compiler out of memory, a Pallas kernel over its scoped VMEM, a
shape error while tracing) is a row of the report with its error's class and the knob to turn
(`hfjax.automap.compiled.failures`), and the others are still compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from hfjax.automap.compiled.failures import ProgramFailure, knob
from hfjax.automap.compiled.programs import (
    ProgramMemory,
    actor_programs,
    actor_resident,
    critic_programs,
    critic_resident,
    measure,
    scorer_programs,
    scorer_resident,
)
from hfjax.automap.compiled.targets import Target, target_devices
from hfjax.config.rl import RLConfig
from hfjax.models.config import ModelConfig
from hfjax.models.presets import HUB_SHAPES, NAMED_CONFIGS, vision_language_shape
from hfjax.models.vision_lm import language_model_config
from hfjax.parallel.layout import Layout, LayoutError
from hfjax.predict.cluster import GIB, ClusterSpec
from hfjax.predict.cost import InfeasibleError
from hfjax.predict.run_config import predict_run, run_models
from hfjax.trainer.preflight import MEMORY_ONLY_PROFILE, with_default_gen_layout
from hfjax.typed_config import ConfigError

logger = logging.getLogger(__name__)

FIT_FRACTION = 0.9


def model_shape(path: str, field: str) -> ModelConfig:
    """The model config at `path`: a local Hugging Face directory (its config.json), a Hub id of a known shape, a
    named shape of `hfjax.models.presets`, or a directory not on this machine whose name starts with a named shape
    (`/models/llama-3.2-1b-reward`: the shipped configs' scorers). ConfigError naming `field` otherwise."""
    if path in NAMED_CONFIGS or path in HUB_SHAPES:
        return NAMED_CONFIGS[HUB_SHAPES.get(path, path)]
    if (Path(path).expanduser() / "config.json").is_file():
        return language_model_config(Path(path).expanduser())
    named = [name for name in NAMED_CONFIGS if Path(path).name.startswith(name)]
    if named and not Path(path).expanduser().exists():
        return NAMED_CONFIGS[max(named, key=len)]
    raise ConfigError(
        f"{field}: {path!r} is not a local model directory, a known Hub id ({sorted(HUB_SHAPES)}) or a named shape "
        f"({sorted(NAMED_CONFIGS)})"
    )


def _layout(config: Any, devices: list, generation: bool, field: str) -> Layout:
    if config is None:
        rules, axis = ("dp_tp_gen", "data") if generation else ("fsdp", "fsdp")
        config = {"mesh": {axis: len(devices)}, "rules": rules}
    layout = Layout.from_config(config, field).on_devices(devices)
    if layout.size != len(devices):
        raise ConfigError(f"{field}: {layout.describe()} has {layout.size} devices; its group has {len(devices)}")
    return layout


@dataclasses.dataclass
class _Role:
    """A role's group (index into the placement's worker groups), what it keeps resident, and its programs."""

    group: int
    resident: int
    programs: Callable[[int], Any]  # bytes that the other roles of its group keep -> traces
    shared: int = 0  # bytes of its own copies beside the one whose programs run (safe_rlhf's second critic)
    name: str = "actor"  # its name in the report (the group of its programs; the actor's rollout programs: rollout)


def run_roles(cfg: RLConfig, devices: list) -> list[_Role]:
    """The run's model roles on `devices` split between the placement's worker groups as the trainer splits them
    (each group an equal share of one host's devices)."""
    groups = cfg.worker_groups()
    per_group = len(devices) // len(groups)

    def group_of(role: str) -> tuple[int, list]:
        index = next(i for i, names in enumerate(groups) if role in names)
        return index, devices[index * per_group : (index + 1) * per_group]

    roles = []
    index, mine = group_of("actor")
    shape = model_shape(cfg.actor.model_path, "actor.model_path")
    vision = vision_language_shape(cfg.actor.model_path)  # a vision-language policy's tower beside `shape`
    train = _layout(cfg.actor.train_layout, mine, False, "actor.train_layout")
    gen = _layout(cfg.rollout.gen_layout, mine, True, "rollout.gen_layout")
    roles.append(
        _Role(
            index,
            actor_resident(cfg, shape, train, gen, vision),
            functools.partial(actor_programs, cfg, shape, train, gen, vision=vision),
            name="actor",
        )
    )
    if cfg.uses_critic:
        index, mine = group_of("critic")
        critic = dataclasses.replace(model_shape(cfg.critic.model_path, "critic.model_path"), num_labels=1)
        layout = _layout(cfg.critic.layout, mine, False, "critic.layout")
        copies = 2 if cfg.algorithm.name == "safe_rlhf" else 1  # safe_rlhf: a reward critic and a cost critic
        one = critic_resident(cfg, critic, layout)
        roles.append(
            _Role(
                index,
                copies * one,
                functools.partial(critic_programs, cfg, critic, layout),
                shared=(copies - 1) * one,
                name="critic",
            )
        )
    for name, section in (("reward_model", cfg.reward.reward_model), ("cost_model", cfg.reward.cost_model)):
        if section.enabled:
            index, mine = group_of(name)
            scorer = model_shape(section.model_path, f"reward.{name}.model_path")
            layout = _layout(section.layout, mine, False, f"reward.{name}.layout")
            roles.append(
                _Role(
                    index,
                    scorer_resident(scorer, section.dtype, layout),
                    functools.partial(scorer_programs, cfg, name, scorer, section, layout),
                    name=name.removesuffix("_model"),
                )
            )
    return roles


class CompiledRun(NamedTuple):
    """What `compile_run` compiled (`programs`), and the programs that failed to trace or compile (`failed`)."""

    programs: list[ProgramMemory]
    failed: list[ProgramFailure]


def remat_settings(cfg: RLConfig) -> dict[str, str]:
    """Each trained group's `remat` setting (the knob of an update over its memory starts with it)."""
    return {"actor": cfg.actor.remat, "critic": cfg.critic.remat}


def _failure(
    group: str, program: str, error: Exception, progress: Callable[[str], None], remat: dict[str, str]
) -> ProgramFailure:
    """`error`, raised while tracing or compiling a program, as its row; the traceback goes to the debug log."""
    failure = ProgramFailure.of(group, program, error, remat.get(group))
    logger.debug("%s %s failed to compile", group, program, exc_info=error)
    progress(f"failed {group}: {program} ({failure.error_class})")
    return failure


def compile_run(
    cfg: RLConfig, target: Target, progress: Callable[[str], None] = print, programs: Sequence[str] = ()
) -> CompiledRun:
    """Every program of the run (actor update and passes, generation, critic, reward and cost models), compiled for
    `target`'s devices split between the placement's worker groups; each program's residents count what the other
    roles of its group keep on the same devices. `programs`: compile only those whose "group program" name starts
    with one of these (`actor loss+grad`, `rollout prefill`); the others are traced, not compiled. A program
    that fails to trace or compile is a `ProgramFailure`, and the others are still compiled; a role whose programs
    cannot be built at all is one failure named "programs"."""
    roles = run_roles(cfg, target_devices(target))
    out, failed, skipped, remat = [], [], [], remat_settings(cfg)
    with warnings.catch_warnings():
        # in a process that also runs JAX (`hfjax sweep --target`), the persistent compilation cache is on: an entry
        # of a compile-only device cannot be loaded back, JAX warns and compiles afresh
        warnings.filterwarnings("ignore", message="Error reading persistent compilation cache entry")
        for role in roles:
            others = role.shared + sum(r.resident for r in roles if r.group == role.group and r is not role)
            traces = iter(role.programs(others))
            while True:
                try:
                    trace = next(traces, None)
                except Exception as error:  # building the role's models or batches: its remaining programs
                    failed.append(_failure(role.name, "programs", error, progress, remat))
                    break
                if trace is None:
                    break
                name = f"{trace.group} {trace.program}"
                if programs and not name.startswith(tuple(programs)):
                    skipped.append(name)
                    continue
                try:
                    out.append(measure(trace))
                except Exception as error:
                    failed.append(_failure(trace.group, trace.program, error, progress, remat))
                    continue
                progress(f"compiled {trace.group}: {trace.program} ({out[-1].compile_seconds:.1f} s)")
    if not out and not failed:
        raise ConfigError(f"programs {list(programs)}: none of the run's programs {skipped} starts with one of them")
    return CompiledRun(out, failed)


def compiled_memory(cfg: RLConfig, target: Target) -> dict[str, Any]:
    """The run compiled for `target` (`compile_run`, quietly), as `hfjax sweep --target` records it: the target, the
    largest program peak in bytes per device (0 where none compiled), whether every program compiles and fits, and
    the lines of those that do not."""
    run = compile_run(cfg, target, progress=lambda _: None)
    problems = [f"{f.line()} ({f.message})" for f in run.failed] + fits(run.programs, target, remat_settings(cfg))
    return {"target": target.name, "peak_bytes": max((p.peak for p in run.programs), default=0), "fits": not problems,
            "problems": problems}  # fmt: skip


def predicted_peak(cfg: RLConfig, target: Target) -> tuple[float | None, str | None]:
    """The cost model's largest group peak, bytes per device, for the run on `target`; or None and the cost model's
    reason where it has no figure (e.g. it predicts that the run does not fit, and by how much)."""
    try:
        models = {role: model_shape(path, f"{role} model") for role, path in run_models(cfg).items()}
        cluster = ClusterSpec(1, target.num_devices, int(target.usable_bytes), MEMORY_ONLY_PROFILE)
        return max(predict_run(with_default_gen_layout(cfg), cluster, models).group_peak_bytes), None
    except (ConfigError, InfeasibleError, LayoutError, ValueError) as error:
        return None, str(error)


def fits(programs: list[ProgramMemory], target: Target, remat: dict[str, str] | None = None) -> list[str]:
    """One line per program whose peak exceeds `FIT_FRACTION` of the target's usable memory, naming the knob (`remat`:
    each trained group's setting, `remat_settings`)."""
    limit = FIT_FRACTION * target.usable_bytes
    problems = []
    for p in programs:
        if p.peak > limit:
            turn = knob("out of memory", p.group, p.program, (remat or {}).get(p.group))
            problems.append(
                f"does not fit: {p.group} {p.program} needs {p.peak / GIB:.2f} GiB of {limit / GIB:.2f} GiB "
                f"({FIT_FRACTION:.0%} of {target.usable_bytes / GIB:.2f} GiB usable per device): try {turn}"
            )
    return problems


def format_report(
    programs: list[ProgramMemory],
    target: Target,
    predicted: float | None,
    predicted_error: str | None = None,
    failed: Sequence[ProgramFailure] = (),
) -> str:
    """The table: per program, GiB per device of arguments, outputs, temporaries, residents and the peak; per program
    that failed, one row of its error's class and the knob to turn, and its message's line under it."""
    header = f"{'group':<8} {'program':<22} {'args':>7} {'outputs':>8} {'temps':>7} {'resident':>9} {'peak':>7}  GFLOP"
    lines = [f"target {target.name}: {target.num_devices} x {target.usable_bytes / GIB:.2f} GiB usable", header]
    for p in programs:
        values = (p.arguments, p.outputs - p.aliased, p.temporaries, p.resident, p.peak)
        cells = " ".join(f"{v / GIB:>{w}.2f}" for v, w in zip(values, (7, 8, 7, 9, 7), strict=True))
        lines.append(f"{p.group:<8} {p.program:<22} {cells}  {p.flops / 1e9:.0f}")
    for f in failed:
        lines.append(f"{f.group:<8} {f.program:<22} failed to compile ({f.error_class}): try {f.knob}")
        lines.append(f"{'':<8} {f.message}")
    model = f"{predicted / GIB:.2f} GiB" if predicted is not None else f"none ({predicted_error or 'no figure'})"
    peak = f"{max(p.peak for p in programs) / GIB:.2f} GiB per device" if programs else "none"
    failures = f" ({len(failed)} program{'s' if len(failed) > 1 else ''} failed to compile)" if failed else ""
    lines.append(f"step peak (compiler) {peak}{failures}; cost model {model}")
    return "\n".join(lines)
