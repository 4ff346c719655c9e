"""Every run's typed config, in one place: the RL run (`rl`: data, algorithm, reward, async sections, and
`load_rl_config`), the sections it composes (`roles`: actor, rollout, critic, reward model; `trainer`: the loop,
placement and health), and the supervised runs (`supervised`: SFT and reward-model training). The YAML loader they
share is `hfjax.typed_config`. Names load lazily, so importing `hfjax.config.roles` does not import the RL config's
dependencies."""

from __future__ import annotations

from hfjax.lazy_names import lazy_names

_EXPORTS = {
    "RLConfig": "rl",
    "load_rl_config": "rl",
    "DataConfig": "rl",
    "AlgorithmConfig": "rl",
    "RewardConfig": "rl",
    "TrainerConfig": "trainer",
    "AsyncConfig": "rl",
    "ActorConfig": "roles",
    "RolloutConfig": "roles",
    "CriticConfig": "roles",
    "RewardModelConfig": "roles",
    "SFTConfig": "supervised",
    "RMConfig": "supervised",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_names(__name__, _EXPORTS)
