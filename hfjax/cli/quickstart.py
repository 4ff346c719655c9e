"""The quickstart pipeline (the README's main command): a synthetic addition task, a small tokenizer and a small
random Llama built locally, supervised fine-tuning to a partial accuracy, then RL (GRPO by default, PPO with
`rl.algorithm.name=ppo`) through the Ray controller with the HybridEngine, and a table of held-out greedy accuracy
before and after RL. Nothing is downloaded. `task_type: calculator` runs the agent quickstart instead: two-digit
multiplication with a calculator tool, SFT on demonstrations of the tool-call format, then multi-turn RL
(`rollout.agent` with `hfjax/envs/examples/calculator.py:CalculatorEnv`). `task_type: shapes` runs the vision
quickstart: counting shapes in small generated images with a random Gemma 3 vision-language model.

`hfjax quickstart [CONFIG] [key=value ...]` (default config: configs/quickstart.yaml; the agent one:
configs/agent_quickstart.yaml; the vision one: configs/vision_quickstart.yaml).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Literal

from hfjax.cli.quickstart_models import BaseModelSection, build_base_model, build_vision_base_model
from hfjax.config.rl import RLConfig, load_rl_config
from hfjax.data import shapes_task, synthetic, tool_task
from hfjax.typed_config import ConfigError, load_config


@dataclasses.dataclass(frozen=True)
class TaskKind:
    """A quickstart task: its settings, data writer, tokenizer builder, data source and (for agents) environment."""

    spec: type
    write: Callable[[Any, Path], dict[str, Path]]
    tokenizer: Callable[[Any], Any]  # the task's settings -> its tokenizer (a processor for an image task)
    data_source: str
    agent_env: Callable[[], str] | None = None  # the environment's `path.py:Name`, for multi-turn RL
    tool_parser: str = ""  # the tool-call format of the task's demonstrations and tokenizer (multi-turn RL)
    vision: bool = False  # prompts with images: the base model is a vision-language Gemma 3

    @property
    def accuracy_key(self) -> str:
        return f"val/test_score/{self.data_source}"


def _calculator_env() -> str:
    from hfjax.envs.examples import calculator

    return f"{Path(calculator.__file__).resolve()}:CalculatorEnv"


TASKS = {
    "addition": TaskKind(
        synthetic.AdditionTask,
        synthetic.write_addition_task,
        lambda task: synthetic.build_addition_tokenizer(),
        synthetic.DATA_SOURCE,
    ),
    "calculator": TaskKind(
        tool_task.MultiplicationTask,
        tool_task.write_multiplication_task,
        lambda task: tool_task.build_tool_tokenizer(),
        tool_task.DATA_SOURCE,
        agent_env=_calculator_env,
        tool_parser="hermes",  # `tool_task` writes Hermes <tool_call> blocks, whatever the base model's family
    ),
    "shapes": TaskKind(
        shapes_task.ShapesTask,
        shapes_task.write_shapes_task,
        shapes_task.build_shapes_processor,
        shapes_task.DATA_SOURCE,
        vision=True,
    ),
}
ACCURACY_KEY = TASKS["addition"].accuracy_key


@dataclasses.dataclass
class QuickstartConfig:
    """Task, base model, and the SFT and RL configs (their model and data paths are filled in by the pipeline). All
    of them are checked when this loads, before anything runs (the paths the pipeline fills in as placeholders)."""

    run_dir: str = "runs/quickstart"
    task_type: Literal["addition", "calculator", "shapes"] = "addition"  # calculator: agents; shapes: images
    task: dict[str, Any] = dataclasses.field(default_factory=dict)
    model: BaseModelSection = dataclasses.field(default_factory=BaseModelSection)
    sft: dict[str, Any] = dataclasses.field(default_factory=dict)
    rl: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        placeholder = Path(self.run_dir) / "not-yet-written"
        files = {name: placeholder for name in ("sft", "train", "test")}
        for section, load in (
            ("task", lambda: load_config(TASKS[self.task_type].spec, self.task)),
            ("sft", lambda: sft_config(self, placeholder, files)),
            ("rl", lambda: rl_config(self, placeholder, files)),
        ):
            try:
                load()
            except ConfigError as exc:
                raise ValueError("\n".join(f"{section}.{line}" for line in str(exc).splitlines())) from None


def sft_config(cfg: QuickstartConfig, base: Path, files: Mapping[str, Path]) -> Any:
    """The SFT stage's config: `cfg.sft` with the base model, the SFT data and its run directory filled in."""
    from hfjax.config.supervised import SFTConfig

    paths = {
        "model": {"path": str(base)},
        "data": {"train_files": [str(files["sft"])]},
        "trainer": {"run_dir": str(Path(cfg.run_dir) / "sft"), "resume": "never"},
    }
    return load_config(SFTConfig, _merge(cfg.sft, paths))


def rl_config(cfg: QuickstartConfig, model: Path, files: Mapping[str, Path], part: str = "rl") -> RLConfig:
    """The RL stage's config: `cfg.rl` with the model, the prompts and its run directory (`run_dir/part`) filled in."""
    paths: dict[str, Any] = {
        "model_path": str(model),
        "data": {"train_files": [str(files["train"])], "val_files": [str(files["test"])]},
        "trainer": {"run_dir": str(Path(cfg.run_dir) / part), "val_before_train": True, "resume": "never"},
    }
    task = TASKS[cfg.task_type]
    rl = cfg.rl
    if task.agent_env is not None:
        paths["rollout"] = {"agent": {"env": task.agent_env()}}
        rl = _merge({"rollout": {"agent": {"env_kwargs": {"parser": task.tool_parser}}}}, rl)  # a config's own wins
    return load_rl_config(_merge(rl, paths))


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def run_quickstart(cfg: QuickstartConfig) -> dict[str, float]:
    """Runs the whole pipeline; returns accuracies and timings (also written to `run_dir/result.json`). Everything
    is checked before Ray starts (`prepare`), and Ray (for an RL stage on Ray) starts before this process's first JAX
    computation, the SFT: `ray.init` forks its servers, and a fork after JAX has started may deadlock (JAX warns)."""
    started = time.perf_counter()
    files = prepare(cfg)
    with rl_ray_session(cfg):
        fine_tune(cfg, files)
        sft_s = time.perf_counter() - started
        result, rl_cfg = reinforce(cfg, files)
    result |= {"sft_seconds": sft_s, "total_seconds": time.perf_counter() - started}
    (Path(cfg.run_dir) / "result.json").write_text(json.dumps(result, indent=2))
    _print_table(result, rl_cfg)
    return result


def prepare(cfg: QuickstartConfig) -> dict[str, Path]:
    """The pipeline up to SFT, with no JAX computation in this process: writes the task's data and the random base
    model (`build_base_model`, in a spawned process) into `run_dir` (which must hold no earlier run), and checks the
    SFT and RL runs. Returns the data files."""
    from hfjax.trainer.preflight import check_rl_run
    from hfjax.trainer.supervised import check_supervised_run

    run_dir = Path(cfg.run_dir)
    earlier = [part for part in ("sft", "rl") if (run_dir / part).is_dir() and any((run_dir / part).iterdir())]
    if earlier:
        raise ValueError(
            f"run_dir: {run_dir} already holds a quickstart run ({' and '.join(earlier)}), which is never overwritten;"
            " expected a new or empty directory: pass run_dir=ANOTHER_DIR or remove that one"
        )
    kind = TASKS[cfg.task_type]
    files = kind.write(kind.spec(**cfg.task), run_dir / "data")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
        base = process.submit(_build_task_base_model, run_dir / "base", cfg).result()
    check_supervised_run(sft_config(cfg, base, files))
    check_rl_run(rl_config(cfg, base, files))  # the SFT model has the base model's shape: the RL run fits it too
    return files


def _build_task_base_model(out_dir: Path, cfg: QuickstartConfig) -> Path:
    kind = TASKS[cfg.task_type]
    build = build_vision_base_model if kind.vision else build_base_model
    return build(out_dir, cfg.model, kind.tokenizer(kind.spec(**cfg.task)))


def rl_ray_session(cfg: QuickstartConfig) -> contextlib.AbstractContextManager[None]:
    """The Ray session of the RL stage (`hfjax.trainer.launch.ray_session`, which `run_rl` then uses as it is) when
    that runs on Ray; nothing otherwise."""
    placeholder = Path(cfg.run_dir) / "not-yet-written"
    rl = rl_config(cfg, placeholder, dict.fromkeys(("sft", "train", "test"), placeholder))
    if rl.trainer.backend != "ray":
        return contextlib.nullcontext()
    from hfjax.trainer.launch import ray_session

    return ray_session(rl)


def fine_tune(cfg: QuickstartConfig, files: Mapping[str, Path]) -> None:
    """SFT of the base model of `prepare` into `run_dir/sft`."""
    from hfjax.trainer.sft import run_sft

    run_sft(sft_config(cfg, Path(cfg.run_dir) / "base", files))


def reinforce(cfg: QuickstartConfig, files: Mapping[str, Path], part: str = "rl") -> tuple[dict[str, Any], RLConfig]:
    """RL from the fine-tuned model of `fine_tune` into `run_dir/part`; returns the held-out accuracy before and after
    (and the gain in points, the algorithm, the RL seconds) and the RL config."""
    from hfjax.trainer.launch import run_rl

    started = time.perf_counter()
    kind = TASKS[cfg.task_type]
    rl_cfg = rl_config(cfg, Path(cfg.run_dir) / "sft" / "hf", files, part)
    history = run_rl(rl_cfg)
    before = _first_validation(Path(rl_cfg.trainer.run_dir) / "metrics.jsonl", kind.accuracy_key)
    after = history[-1][kind.accuracy_key]
    result = {
        "sft_accuracy": before,
        "rl_accuracy": after,
        "gain_points": 100 * (after - before),
        "algorithm": rl_cfg.algorithm.name,
        "rl_seconds": time.perf_counter() - started,
    }
    return result, rl_cfg


def _first_validation(metrics_file: Path, key: str) -> float:
    for line in metrics_file.read_text().splitlines():
        record = json.loads(line)
        if key in record:
            return float(record[key])
    raise RuntimeError(f"{metrics_file}: no {key} record (validation before RL did not run)")


def _print_table(result: dict[str, Any], rl_cfg: RLConfig) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"quickstart: held-out greedy accuracy ({result['algorithm']}, {rl_cfg.trainer.total_steps} steps)"
    )
    for column in ("checkpoint", "accuracy", "time (s)"):
        table.add_column(column)
    table.add_row("after SFT", f"{100 * result['sft_accuracy']:.1f}%", f"{result['sft_seconds']:.0f}")
    table.add_row("after RL", f"{100 * result['rl_accuracy']:.1f}%", f"{result['total_seconds']:.0f}")
    table.add_row("gain", f"{result['gain_points']:+.1f} points", "")
    Console().print(table)


def quickstart_main(config_path: str | None, overrides: Sequence[str]) -> int:
    """`hfjax quickstart [CONFIG] [key=value ...]` (a bad config raises `ConfigError`, which the CLI prints)."""
    run_quickstart(load_config(QuickstartConfig, config_path, overrides))
    return 0
