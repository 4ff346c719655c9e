"""User-written algorithms: the DAPO example (examples/dapo.py) against hand-written numpy references, the
config-load errors of `algorithm.program`, `algorithm.adv_estimator` and `actor.policy_loss` given as
`path.py:name`, the step API's stable names, DAPO training through `hfjax train` from a copy of the example
outside the package, in process and on Ray, and the long-context recipe (examples/dapo_long_context.yaml) run as
shipped but for its data, model and size: its actor trains over the sequence axis and its overlong punishment is
sized by its response length."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from support.rl_setup import build_run_inputs, rl_config, write_varied_reward

from hfjax.algos import ADVANTAGE_ESTIMATORS, actor_options, policy_loss
from hfjax.cli.main import main
from hfjax.config.rl import load_rl_config
from hfjax.records.metrics import read_metrics
from hfjax.trainer import launch
from hfjax.trainer.programs import PROGRAMS, program_for
from hfjax.trainer.step import PUBLIC_API, Step
from hfjax.typed_config import ConfigError
from hfjax.user_code import load_callable

pytest_plugins = ["support.ray_cluster"]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dapo.py"
LONG_CONTEXT = EXAMPLE.with_name("dapo_long_context.yaml")
USER_FUNCTIONS = ("program", "overlong_grpo", "clip_higher_loss")
# Appended to the test's copy of the example: each user function records its name in dapo.calls when it is called
# (the policy loss when the actor's update is traced, on whichever process runs the actor).
RECORDER = """

import functools as _functools
import pathlib as _pathlib

_CALLS = _pathlib.Path(__file__).with_suffix(".calls")


def _recorded(fn):
    @_functools.wraps(fn)
    def call(*args, **kwargs):
        with _CALLS.open("a") as f:
            f.write(fn.__name__ + "\\n")
        return fn(*args, **kwargs)

    return call


program, overlong_grpo, clip_higher_loss = map(_recorded, (program, overlong_grpo, clip_higher_loss))
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_run_inputs(tmp_path_factory.mktemp("user_algorithm"))


def example_copy(directory: Path, record: bool = False) -> Path:
    """The example copied into `directory` (outside the package), optionally recording its calls."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "dapo.py"
    shutil.copy(EXAMPLE, path)
    if record:
        path.write_text(path.read_text() + RECORDER)
    return path


# ---------------------------------------------------------------- the example against numpy references


def test_overlong_grpo_matches_numpy_reference(tmp_path):
    rng = np.random.default_rng(3)
    rows, width = 12, 8
    lengths = rng.integers(0, width + 1, rows)
    mask = (np.arange(width) < lengths[:, None]).astype(np.float32)
    rewards = rng.normal(size=(rows, width)).astype(np.float32) * mask
    index = np.repeat(np.arange(4), 3)
    estimator = f"{example_copy(tmp_path)}:overlong_grpo"
    advantages, returns = ADVANTAGE_ESTIMATORS.get(estimator)(rewards, mask, index, True)

    buffer = width * 0.5  # OVERLONG_BUFFER of the width
    scores = rewards.sum(-1) - np.clip((lengths - (width - buffer)) / buffer, 0, 1)
    expected = np.zeros(rows)
    for group in range(4):
        members = index == group
        group_scores = scores[members]
        expected[members] = (group_scores - group_scores.mean()) / (group_scores.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(advantages, expected[:, None] * mask, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(returns, advantages)


def loss_case(seed: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (16, 12)
    mask = (np.arange(shape[1]) < rng.integers(1, shape[1] + 1, shape[0])[:, None]).astype(np.float32)
    old = rng.normal(size=shape).astype(np.float32) - 2
    log_ratio = rng.uniform(-1.5, 1.5, shape).astype(np.float32)  # ratios from 0.22 to 4.5: every clip region
    advantages = rng.normal(size=shape).astype(np.float32)
    return {"old": old, "new": old + log_ratio, "advantages": advantages, "mask": mask}


def loss_and_grad(name: str, case: dict[str, np.ndarray], **options: object) -> tuple[float, np.ndarray]:
    def loss(new: jax.Array) -> jax.Array:
        return policy_loss(name, case["old"], new, case["advantages"], case["mask"], **options)[0]

    value, grad = jax.value_and_grad(loss)(jnp.asarray(case["new"]))
    return float(value), np.asarray(grad)


def test_clip_higher_loss_matches_numpy_reference_and_differs_from_ppo_where_it_should(tmp_path):
    spec = f"{example_copy(tmp_path)}:clip_higher_loss"
    case = loss_case()
    low, high, tokens = 0.2, 0.28, case["mask"].sum()
    clip = {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": 3.0}
    options = actor_options(spec, **clip)
    assert options == {"clip_ratio_low": low, "clip_ratio_high": high}  # it takes no dual-clip bound
    # token-level whatever the aggregation mode says
    value, grad = loss_and_grad(spec, case, loss_agg_mode="seq-mean-token-mean", **options)

    a, mask = case["advantages"], case["mask"]
    ratio = np.exp(case["new"].astype(np.float64) - case["old"])
    token_losses = np.maximum(-a * ratio, -a * np.clip(ratio, 1 - low, 1 + high))
    clipped_away = ((a > 0) & (ratio > 1 + high)) | ((a < 0) & (ratio < 1 - low))
    np.testing.assert_allclose(value, (token_losses * mask).sum() / tokens, rtol=1e-5)
    np.testing.assert_allclose(grad, np.where(clipped_away, 0, -a * ratio) * mask / tokens, rtol=1e-4, atol=1e-7)

    # the built-in ppo (symmetric clip 0.2, dual clip at 3) has no gradient where clip-higher frees a token with a
    # positive advantage (1.2 < r <= 1.28) or the dual clip bounds a negative one (r > 3), and the same elsewhere
    _, ppo_grad = loss_and_grad("ppo", case, loss_agg_mode="token-mean")
    freed = ((a > 0) & (ratio > 1.2) & (ratio <= 1 + high)) | ((a < 0) & (ratio > 3.0))
    differs = ~np.isclose(grad, ppo_grad, rtol=1e-5, atol=1e-9)
    assert (freed & (mask > 0)).any()
    np.testing.assert_array_equal(differs, freed & (mask > 0))
    np.testing.assert_array_equal(ppo_grad[freed], 0)


def test_varied_groups_keeps_the_groups_whose_scores_differ(tmp_path):
    varied_groups = load_callable(f"{example_copy(tmp_path)}:varied_groups", "test")
    uids = np.array(["a", "a", "b", "b", "c", "c"], dtype=object)
    scores = np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5], np.float32)
    np.testing.assert_array_equal(varied_groups(scores, uids), [False, False, True, True, False, False])


def _config(program: str, **algorithm: object) -> dict:
    return {"model_path": "unused", "rollout": {"n": 2}, "algorithm": {"program": program, **algorithm}}


# ---------------------------------------------------------------- config load


BAD_PROGRAMS = {
    "missing file": (None, r"no such file .*nowhere\.py"),
    "missing name": ("def other(step):\n    pass\n", r".*algo\.py has no 'program' \(its functions: \['other'\]"),
    "not callable": ("program = 3\n", r"'program' is a int, not a function"),
    "signature": (
        "def program(step, extra):\n    pass\n",
        r"cannot be called as program\(\.\.\.\) .*def program\(step\)",
    ),
    "roles": ("ROLES = ['critc']\ndef program(step):\n    pass\n", r"its file's ROLES is \['critc'\]; expected"),
    "import": ("import no_such_module_hfjax\n", r"importing .* failed: ModuleNotFoundError"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROGRAMS))
def test_bad_programs_fail_at_config_load_naming_algorithm_program(tmp_path, monkeypatch, case):
    source, pattern = BAD_PROGRAMS[case]
    monkeypatch.chdir(tmp_path)
    spec = "nowhere.py:program" if source is None else "algo.py:program"
    if source is not None:
        (tmp_path / "algo.py").write_text(source)
    with pytest.raises(ConfigError, match=rf"^algorithm\.program: user program '{spec}': {pattern}"):
        load_rl_config(_config(spec))


def test_user_specs_become_absolute_and_choose_roles(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "algo.py").write_text("ROLES = ('critic',)\ndef program(step):\n    step.generate()\n")
    example_copy(tmp_path)
    cfg = load_rl_config(
        _config("algo.py:program", adv_estimator="dapo.py:overlong_grpo"),
        ["actor.policy_loss=dapo.py:clip_higher_loss"],
    )
    assert cfg.algorithm.program == f"{tmp_path / 'algo.py'}:program"
    assert cfg.algorithm.adv_estimator == cfg.algorithm.estimator == f"{tmp_path / 'dapo.py'}:overlong_grpo"
    assert cfg.actor.policy_loss == f"{tmp_path / 'dapo.py'}:clip_higher_loss"
    assert cfg.role_names() == ["actor", "critic"] and cfg.uses_critic
    assert program_for(cfg.algorithm).__name__ == "program"
    builtin = load_rl_config(
        {"model_path": "unused", "rollout": {"n": 2}, "algorithm": {"name": "ppo", "adv_estimator": "grpo"}}
    )
    assert builtin.algorithm.estimator == "grpo" and builtin.role_names() == ["actor", "critic"]
    assert program_for(builtin.algorithm) is PROGRAMS["ppo"]


def test_bad_estimators_and_losses_fail_at_config_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text(
        "def estimator(token_level_rewards, temperature):\n    pass\n"
        "def loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode):\n    pass\n"
        "def values_estimator(token_level_rewards, values):\n    pass\n"
    )
    errors = {
        "algorithm.adv_estimator=mine.py:estimator": r"^algorithm\.adv_estimator: .*parameters \['temperature'\]",
        "algorithm.adv_estimator=mine.py:values_estimator": r"^algorithm\.adv_estimator: .*the values of a critic",
        "algorithm.adv_estimator=mine.py:nope": r"^algorithm\.adv_estimator: .* 'mine.py:nope': .*has no 'nope'",
        "algorithm.adv_estimator=gpro": r"^algorithm\.adv_estimator: expected a registered .*did you mean 'grpo'",
        "algorithm.adv_estimator=optimal_token_baseline": r"^algorithm\.adv_estimator: .* needs sum_pi_squared",
        "actor.loss_agg_mode=token-summ": r"^actor\.loss_agg_mode: .*token-sum",
        "actor.policy_loss=mine.py:loss": r"^actor\.policy_loss: .*lacks keyword-only \['global_tokens'",
        "actor.policy_loss=mine.py:estimator": r"^actor\.policy_loss: policy loss 'mine.py:estimator' cannot be called",
    }
    for override, pattern in errors.items():
        with pytest.raises(ConfigError, match=pattern):
            load_rl_config({"model_path": "unused", "rollout": {"n": 2}}, [override])
    verl_names = ["algorithm.adv_estimator=gdpo", "actor.policy_loss=cispo", "actor.loss_agg_mode=token-sum"]
    cfg = load_rl_config({"model_path": "unused", "rollout": {"n": 2}}, verl_names)
    assert (cfg.algorithm.estimator, cfg.actor.policy_loss, cfg.actor.loss_agg_mode) == ("gdpo", "cispo", "token-sum")


def test_a_role_the_program_did_not_declare_is_a_clear_error(tmp_path):
    cfg = load_rl_config({"model_path": "unused", "rollout": {"n": 2}})
    with pytest.raises(ValueError, match=r"calls the critic role, which this run does not start .* ROLES"):
        Step(cfg, {}, None, 0, None).values("critic", "values")


def test_the_stable_step_api_is_documented():
    for name in PUBLIC_API:
        member = getattr(Step, name, None)
        if member is None:  # state set by the constructor
            assert name in Step.__doc__, name
        else:
            assert callable(member) and member.__doc__, name


# ---------------------------------------------------------------- training through `hfjax train`


def dapo_run(inputs: dict[str, str], root: Path, backend: str, steps: int) -> list[dict[str, float]]:
    """`hfjax train` on a config naming the recording copy of the example by a path relative to the working
    directory (the config resolves it); returns the logged steps."""
    example_copy(root / "user", record=True)
    config = rl_config(
        inputs,
        root / "run",
        "grpo",
        actor={"policy_loss": "dapo.py:clip_higher_loss", "clip_ratio_high": 0.28, "use_kl_loss": False},
        reward={"function": write_varied_reward(root)},
        trainer={"backend": backend, "total_steps": steps},
    )
    config["algorithm"] = {"program": "dapo.py:program", "adv_estimator": "dapo.py:overlong_grpo"}
    (root / "user" / "dapo.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", "dapo.yaml"]) == 0
    return [r for r in read_metrics(root / "run") if "timing_s/step" in r]


def assert_trained(history: list[dict[str, float]], root: Path, steps: int) -> None:
    assert [r["step"] for r in history] == list(range(1, steps + 1))
    bad = [(r["step"], k, v) for r in history for k, v in r.items() if not math.isfinite(v)]
    assert not bad, bad
    assert all(0 <= r["dapo/kept_groups_fraction"] <= 1 for r in history)
    updated = [r for r in history if "actor/pg_loss" in r]
    assert updated, "no step kept a group with varied rewards"
    assert all("actor/pg_clipfrac" in r and "actor/kl_loss" not in r for r in updated)
    calls = (root / "user" / "dapo.calls").read_text().split()
    assert set(calls) == set(USER_FUNCTIONS)
    assert calls.count("program") == steps and calls.count("overlong_grpo") == steps


def test_dapo_trains_through_hfjax_train_in_process(inputs, tmp_path, monkeypatch):
    (tmp_path / "user").mkdir()
    monkeypatch.chdir(tmp_path / "user")
    history = dapo_run(inputs, tmp_path, "local", steps=3)
    assert_trained(history, tmp_path, steps=3)


@pytest.mark.ray
def test_dapo_trains_through_hfjax_train_on_ray(ray_cluster, inputs, tmp_path, monkeypatch):
    (tmp_path / "user").mkdir()
    monkeypatch.chdir(tmp_path / "user")  # the Ray workers run elsewhere: they load the file by its absolute path
    history = dapo_run(inputs, tmp_path, "ray", steps=1)  # the in-process run above takes three steps
    assert_trained(history, tmp_path, steps=1)


# ---------------------------------------------------------------- the long-context recipe

# Appended to the test's copy of the example: every call of the estimator saves its inputs and advantages.
ESTIMATOR_RECORDER = """

import pathlib as _pathlib

_RECORDS = _pathlib.Path(__file__).with_suffix(".estimates")
_estimate = overlong_grpo


def overlong_grpo(token_level_rewards, response_mask, index, norm_adv_by_std):
    advantages, returns = _estimate(token_level_rewards, response_mask, index, norm_adv_by_std)
    _RECORDS.mkdir(exist_ok=True)
    np.savez(
        _RECORDS / f"{len(list(_RECORDS.iterdir()))}.npz",
        rewards=np.asarray(token_level_rewards),
        mask=np.asarray(response_mask),
        groups=np.unique(np.asarray(index), return_inverse=True)[1],
        advantages=np.asarray(advantages),
    )
    return advantages, returns
"""


def grpo_reference(scores: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """GRPO's advantage per row: its score minus its group's mean, over the group's (unbiased) std + 1e-6."""
    out = np.zeros(len(scores))
    for group in np.unique(groups):
        members = groups == group
        out[members] = (scores[members] - scores[members].mean()) / (scores[members].std(ddof=1) + 1e-6)
    return out


@pytest.mark.slow  # a whole `hfjax train` of the shipped recipe
def test_long_context_recipe_trains_over_the_sequence_axis_with_its_overlong_penalty(inputs, tmp_path, monkeypatch):
    """examples/dapo_long_context.yaml through `hfjax train`, with the test's tiny model and data, 2 prompts and 2
    iterations instead of the quickstart's (its response length, layout, loss and program as shipped): the actor's
    worker trained over `fsdp=4, sequence=2`; the estimator got every response at the width of the recipe's
    `rollout.response_length`, and its advantages are GRPO's of the scores minus the soft overlong penalty over the
    last `OVERLONG_BUFFER` of that length (NumPy, below), which differ from those without it: the run had responses
    in the punished zone beside shorter ones in their groups."""
    recipe = yaml.safe_load(LONG_CONTEXT.read_text())
    assert recipe["actor"]["train_layout"]["mesh"] == {"fsdp": 4, "sequence": 2}
    response_length = recipe["rollout"]["response_length"]
    user = tmp_path / "user"
    example_copy(user).write_text(EXAMPLE.read_text() + ESTIMATOR_RECORDER)
    for section, key in (("actor", "policy_loss"), ("algorithm", "program"), ("algorithm", "adv_estimator")):
        assert recipe[section][key].startswith("examples/dapo.py:")
        recipe[section][key] = recipe[section][key].removeprefix("examples/")  # the recording copy
    recipe["model_path"] = inputs["policy"]
    recipe["data"].update(train_files=[inputs["train"]], val_files=[inputs["test"]], train_batch_size=2)
    recipe["rollout"]["slots"] = 16
    recipe["actor"].update(ppo_mini_batch_size=16, micro_batch_size=8)
    recipe["reward"] = {"function": write_varied_reward(tmp_path)}
    recipe["trainer"].update(
        run_dir=str(tmp_path / "run"), total_steps=2, test_freq=0, val_before_train=False, backend="local"
    )
    recipe["trainer"].update(progress=False, plot=False)
    (user / "recipe.yaml").write_text(yaml.safe_dump(recipe))

    trainers = []

    class Recorded(launch.RLTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainers.append(self)

    monkeypatch.setattr(launch, "RLTrainer", Recorded)
    monkeypatch.chdir(user)
    assert main(["train", "recipe.yaml"]) == 0
    history = [r for r in read_metrics(tmp_path / "run") if "timing_s/step" in r]
    assert [r["step"] for r in history] == [1, 2]
    assert any("actor/pg_loss" in r for r in history)
    (trainer,) = trainers
    assert {info["train_layout"] for info in trainer.role_info["actor"]} == {"mesh(fsdp=4, sequence=2)"}

    calls = [np.load(path) for path in sorted((user / "dapo.estimates").iterdir())]
    assert len(calls) == 2
    buffer = 0.5 * response_length  # OVERLONG_BUFFER of the recipe's response length
    punished = 0
    for call in calls:
        mask, groups = call["mask"], call["groups"]
        assert mask.shape[1] == response_length  # the batch's width, whatever its longest response
        lengths = mask.sum(-1)
        penalty = np.clip((lengths - (response_length - buffer)) / buffer, 0, 1)
        scores = call["rewards"].sum(-1)
        expected = grpo_reference(scores - penalty, groups)
        np.testing.assert_allclose(call["advantages"], expected[:, None] * mask, rtol=1e-4, atol=1e-4)
        unpunished = grpo_reference(scores, groups)
        punished += int((~np.isclose(expected, unpunished, atol=1e-3)).sum())
    assert punished > 0
