"""Checks of a loaded config against what it points at, before Ray, any worker or any device memory: model
directories, their `config.json` and their safetensors headers (every tensor present, of the model's shape, within
its file; no tensor data read), LoRA targets against the models' modules, sequence lengths against the models'
positions, the KV cache and the run's memory per device (the cost model's memory of `hfjax.predict.cost`) against the
device's memory, the dataset files and rows (ground truth where a rule reward needs it), the tokenizer and the
prompts' token lengths against `data.max_prompt_length` (`prompt_lengths`), and the reward function (file, import,
name, signature). Each failure is one line naming the config field and what was expected.

The device memory a run is checked against: `trainer.device_memory_gib` when set; on CPU (`trainer.device: cpu`, or
`auto` with `JAX_PLATFORMS=cpu` or on a machine without GPU or TPU, `runs_on_cpu`) the host's RAM shared by its fake
devices; unknown otherwise (the controller never opens an accelerator), and then only the model-position checks run.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from hfjax.config.rl import RLConfig
from hfjax.data.prompts import parse_prompt_row
from hfjax.data.records import DataError, RowRef, read_rows
from hfjax.models.config import ModelConfig
from hfjax.models.hf import check_checkpoint, load_tokenizer
from hfjax.models.hub import is_hub_id, resolve_model
from hfjax.models.lora import check_lora_targets
from hfjax.models.model_io import trained_parameters
from hfjax.models.safetensors_io import CheckpointError
from hfjax.models.vision_lm import (
    check_policy_head,
    check_vision_lm_checkpoint,
    is_vision_language_checkpoint,
    language_model_config,
)
from hfjax.parallel.layout import Layout, LayoutError, is_param_leaf
from hfjax.predict.cluster import GIB, ClusterSpec, DeviceProfile
from hfjax.predict.cost import CostOptions, InfeasibleError, Prediction
from hfjax.predict.run_config import predict_run
from hfjax.rewards import SCORERS, RewardError, load_reward_function
from hfjax.trainer.prompt_lengths import check_prompt_lengths
from hfjax.typed_config import ConfigError

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
MEMORY_ONLY_PROFILE = DeviceProfile("memory check", 1.0, 1.0, 1.0, 1.0)  # the cost model's seconds are not used here


def model_config(path: str, field: str) -> ModelConfig:
    """The `config.json` of the local Hugging Face directory `path` (no weights read); ConfigError naming `field`."""
    if not path:
        raise ConfigError(f"{field}: expected a Hugging Face model directory, got {path!r}")
    directory = Path(path).expanduser()
    if not directory.is_dir():
        hint = (
            " (a Hub id is resolved before this check: run through hfjax train, or download it)"
            if is_hub_id(path)
            else ""
        )
        raise ConfigError(f"{field}: no such directory {path!r}; expected a local Hugging Face model directory{hint}")
    try:
        return language_model_config(directory)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{field}: {path} is not a readable Hugging Face model directory ({exc})") from exc


def check_weights(path: str, field: str, head: str) -> None:
    """The safetensors headers of the model at config `field` against the model `head` builds from it (names,
    shapes, file sizes; no tensor data read); ConfigError naming `field`."""
    directory = Path(path).expanduser()
    try:
        if not is_vision_language_checkpoint(directory):
            check_checkpoint(directory, head)
        else:
            check_policy_head(path, head)
            check_vision_lm_checkpoint(directory)
    except (CheckpointError, ValueError) as exc:
        raise ConfigError(f"{field}: {exc}") from exc


def check_positions(model: ModelConfig, tokens: int, lengths: str, field: str) -> None:
    """Raises when `tokens` (described by `lengths`, e.g. "data.max_length 512") exceed the positions of the model
    at config `field`."""
    if tokens > model.max_position_embeddings:
        raise ConfigError(
            f"{lengths} = {tokens} tokens: expected at most the max_position_embeddings "
            f"{model.max_position_embeddings} of the model at {field}"
        )


def kv_cache_bytes(model: ModelConfig, slots: int, tokens: int, itemsize: int) -> int:
    """Bytes of a KV cache of `slots` sequences of `tokens` tokens: keys and values of every layer and KV head."""
    return slots * tokens * model.num_layers * model.num_kv_heads * model.head_dim * 2 * itemsize


def kv_cache_formula(model: ModelConfig, slots: int, tokens: int, itemsize: int) -> str:
    """The KV cache's size as its factors, e.g. "64 slots x 2048 tokens x 24 layers x ... = 6.0 GiB"."""
    total = kv_cache_bytes(model, slots, tokens, itemsize)
    return (
        f"{slots} slots x {tokens} tokens x {model.num_layers} layers x {model.num_kv_heads} KV heads x "
        f"{model.head_dim} head dim x 2 (keys, values) x {itemsize} bytes = {total / GIB:.2f} GiB"
    )


def host_memory_per_device(devices_per_host: int) -> float:
    """The host's RAM divided among its `devices_per_host` (fake CPU) devices, in bytes."""
    import psutil

    return psutil.virtual_memory().total / devices_per_host


def device_memory(cfg: RLConfig) -> tuple[float, str] | None:
    """(bytes per device, where that number comes from) for the memory check, or None when it is not known."""
    trainer = cfg.trainer
    if trainer.device_memory_gib is not None:
        return trainer.device_memory_gib * GIB, f"trainer.device_memory_gib={trainer.device_memory_gib}"
    if not runs_on_cpu(cfg):
        return None
    per_device = host_memory_per_device(trainer.devices_per_host)
    return per_device, f"host RAM / trainer.devices_per_host={trainer.devices_per_host}"


def runs_on_cpu(cfg: RLConfig) -> bool:
    """Whether the run's workers will run on CPU: `trainer.device: cpu`, or `auto` with JAX_PLATFORMS naming cpu
    first, or `auto` on this machine (not a cluster it joins) when JAX_PLATFORMS names no platform and it has no
    GPU or TPU (`local_accelerator`)."""
    trainer = cfg.trainer
    if trainer.device != "auto":
        return trainer.device == "cpu"
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    if trainer.backend == "ray" and (trainer.ray_address or os.environ.get("RAY_ADDRESS")):
        return False  # the cluster's devices, unknown before it is joined
    return not any(local_accelerator(device) for device in ("gpu", "tpu"))


def resolve_hub_models(cfg: RLConfig) -> RLConfig:
    """A copy of `cfg` whose model and tokenizer paths that are Hugging Face Hub ids (`org/name`) are replaced by
    their local snapshots (`hfjax.models.hub`); local paths stay as they are."""
    cfg = copy.deepcopy(cfg)
    cfg.model_path = resolve_model(cfg.model_path, "model_path")
    cfg.tokenizer_path = resolve_model(cfg.tokenizer_path, "tokenizer_path")
    for field, section in (("actor", cfg.actor), ("critic", cfg.critic)):
        section.model_path = resolve_model(section.model_path, f"{field}.model_path")
    for name in ("reward_model", "cost_model"):
        section = getattr(cfg.reward, name)
        if section.model_path:
            section.model_path = resolve_model(section.model_path, f"reward.{name}.model_path")
    return cfg


def check_rl_run(cfg: RLConfig) -> None:
    """Every check of the module docstring for an RL run; raises ConfigError (or DataError for a dataset row)."""

    def field(role: str, path: str) -> str:  # the config key that set a role's checkpoint
        return f"{role}.model_path" if path != cfg.model_path else "model_path"

    checkpoints = [(field("actor", cfg.actor.model_path), cfg.actor.model_path, "causal_lm")]  # (field, path, head)
    if cfg.uses_critic:
        checkpoints.append((field("critic", cfg.critic.model_path), cfg.critic.model_path, "token_cls"))
    for name in ("reward_model", "cost_model"):
        section = getattr(cfg.reward, name)
        if section.enabled:
            checkpoints.append((f"reward.{name}.model_path", section.model_path, "seq_cls"))
    models = {key: model_config(path, key) for key, path, _ in checkpoints}
    dense_actor = not any(models[checkpoints[0][0]].moe_layers)
    if cfg.actor.router_replay and dense_actor:
        raise ConfigError(f"actor.router_replay: {cfg.actor.model_path} has no mixture-of-experts layers to replay")
    if cfg.actor.router_aux_loss_coef and dense_actor:
        raise ConfigError(f"actor.router_aux_loss_coef: {cfg.actor.model_path} has no mixture-of-experts router")
    trained = [("actor", cfg.actor.lora, checkpoints[0][0])]
    if cfg.uses_critic:
        trained.append(("critic", cfg.critic.lora, checkpoints[1][0]))
    for role, lora, key in trained:
        try:
            check_lora_targets(models[key], lora, f"{role}.lora.targets", getattr(cfg, role).model_path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    try:
        trained_parameters(cfg.actor.model_path, cfg.actor.freeze_vision_tower)
        if cfg.actor.images_per_step and not is_vision_language_checkpoint(cfg.actor.model_path):
            raise ValueError(f"images_per_step: {cfg.actor.images_per_step} on a text model; expected 0")
    except ValueError as exc:
        raise ConfigError(f"actor.{exc}") from exc
    for key, path, head in checkpoints:  # the model each role builds against the checkpoint's tensors
        check_weights(path, key, head)
    tokenizer = run_tokenizer(cfg.tokenizer_path)
    prompt, response = cfg.data.max_prompt_length, cfg.rollout.response_length
    lengths = f"data.max_prompt_length {prompt} + rollout.response_length {response}"
    for field, model in models.items():
        check_positions(model, prompt + response, lengths, field)
    if cfg.reward.function is not None:
        try:
            load_reward_function(cfg.reward.function)
        except RewardError as exc:
            raise ConfigError(f"reward.function: {exc}") from exc
    needs_truth = cfg.reward.use_rule and cfg.reward.function is None
    data = cfg.data
    train = check_prompt_files(data.train_files, "data.train_files", needs_truth, required=True)
    if len(train) < data.train_batch_size:
        raise ConfigError(
            f"data.train_batch_size={data.train_batch_size}: expected at most the {len(train)} rows of data.train_files"
        )
    batch = (data.train_batch_size, "one batch (data.train_batch_size)")
    check_prompt_lengths(train, "data.train_files", tokenizer, data, batch)
    val = check_prompt_files(data.val_files, "data.val_files", needs_truth, required=False)
    check_prompt_lengths(val, "data.val_files", tokenizer, data, (1, "validation"))
    check_placement(cfg)
    check_train_layouts(cfg)
    check_memory(cfg, next(iter(models.values())))


def run_tokenizer(path: str) -> Any:
    """The tokenizer at `tokenizer_path`, loaded as the run loads it; ConfigError naming the field."""
    if not Path(path).expanduser().is_dir():
        raise ConfigError(f"tokenizer_path: no such directory {path!r}; expected a local tokenizer")
    try:
        return load_tokenizer(path)
    except CheckpointError as exc:
        raise ConfigError(f"tokenizer_path: {exc}") from exc


def check_placement(cfg: RLConfig) -> None:
    """`backend: local` runs one worker group, and a `trainer.device` accelerator exists where this machine's own Ray
    (or this process) will look for it."""
    trainer, groups = cfg.trainer, cfg.worker_groups()
    if trainer.backend == "local" and len(groups) > 1:
        raise ConfigError(
            f"trainer.placement={trainer.placement}: runs {len(groups)} worker groups ({groups}) on separate devices, "
            "which needs trainer.backend=ray; use trainer.placement=colocate with trainer.backend=local"
        )
    joins_a_cluster = trainer.backend == "ray" and (trainer.ray_address or os.environ.get("RAY_ADDRESS"))
    if trainer.device in ("gpu", "tpu") and not joins_a_cluster and not local_accelerator(trainer.device):
        raise ConfigError(
            f"trainer.device={trainer.device}: this machine has no {trainer.device.upper()} "
            f"(no {ACCELERATOR_FILES[trainer.device]}); "
            "use trainer.device=auto or cpu, or join a cluster that has them (trainer.ray_address)"
        )


ACCELERATOR_FILES = {"gpu": "/dev/nvidia* or /dev/kfd", "tpu": "/dev/accel* or /dev/vfio/*"}


def local_accelerator(device: str) -> bool:
    """Whether this machine shows devices of kind `device` (gpu: NVIDIA or AMD device files; tpu: TPU VM ones)."""
    patterns = {"gpu": ("nvidia[0-9]*", "kfd"), "tpu": ("accel[0-9]*", "vfio/[0-9]*")}[device]
    return any(next(Path("/dev").glob(pattern), None) is not None for pattern in patterns)


def check_train_layouts(cfg: RLConfig) -> None:
    """Every parameter of the actor (and critic) divides over the mesh axes of its training layout: the configured
    one, or the default fsdp over the group's devices (`trainer.hosts` x the group's share of
    `trainer.devices_per_host`); abstract shapes only."""
    from flax import nnx

    from hfjax.models.hf import abstract_model

    roles = [("actor.train_layout", cfg.actor.train_layout, cfg.actor.model_path, "causal_lm", "actor")]
    if cfg.uses_critic:
        roles.append(("critic.layout", cfg.critic.layout, cfg.critic.model_path, "token_cls", "critic"))
    for field, config, path, head, role in roles:
        hosts, per_host = cfg.group_shape(role)
        default = {"mesh": {"fsdp": hosts * per_host}, "rules": "fsdp"}
        layout = Layout.from_config(config if config is not None else default, field)
        model = dataclasses.replace(language_model_config(path), num_labels=1)  # a critic's head has one output
        params = nnx.state(abstract_model(model, head), nnx.Param)
        problems = []
        for key, leaf in jax.tree_util.tree_leaves_with_path(params, is_leaf=is_param_leaf):
            axes = leaf.get_metadata().get("logical_axes") or (None,) * len(leaf.shape)
            try:
                layout.spec(axes, leaf.shape, jax.tree_util.keystr(key, simple=True, separator="."))
            except LayoutError as exc:
                problems.append(str(exc))
        if not problems:
            continue
        where = (
            f"{field} {layout.describe()}"
            if config is not None
            else f"trainer.devices_per_host={cfg.trainer.devices_per_host}: the default {field} {layout.describe()}"
        )
        raise ConfigError(
            f"{where} cannot shard {len(problems)} parameters of the model at {path} (e.g. {problems[0]}); "
            f"choose a number of devices that divides them, or give {field} a mesh that does"
        )


def check_prompt_files(
    files: Sequence[str], field: str, needs_truth: bool, required: bool
) -> list[tuple[RowRef, dict[str, Any]]]:
    """The prompt files exist and every row parses; with `needs_truth` (the built-in rule rewards), every row's
    `data_source` has a scorer and its `reward_model.ground_truth` is set. Returns the rows."""
    if required and not files:
        raise ConfigError(f"{field}: expected at least one parquet or JSONL file, got []")
    for i, file in enumerate(files):
        if not Path(file).is_file():
            raise ConfigError(f"{field}[{i}]: no such file {file!r}")
    rows = read_rows(files)
    for ref, row in rows:
        fields = parse_prompt_row(ref, row)
        if not needs_truth:
            continue
        if fields["data_source"] not in SCORERS:
            raise ref.error("data_source", f"a data source with a rule reward ({', '.join(sorted(SCORERS))})", row)
        if fields["ground_truth"] is None:
            raise DataError(
                f"{ref}: missing field 'reward_model.ground_truth', which the rule reward of data_source "
                f"{fields['data_source']!r} scores against (or give reward.function, or set reward.use_rule=false)"
            )
    return rows


def with_default_gen_layout(cfg: RLConfig) -> RLConfig:
    """`cfg` with `rollout.gen_layout` set to its default when unset: data parallel over the generating group's
    devices (what the workers use; the cost model needs it spelled out)."""
    if cfg.rollout.gen_layout is not None:
        return cfg
    hosts, per_host = cfg.group_shape("rollout" if cfg.disaggregated else "actor")
    default = {"mesh": {"data": hosts * per_host}, "rules": "dp_tp_gen"}
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, gen_layout=default))


def predict_memory(cfg: RLConfig, per_device: float) -> Prediction:
    """The cost model's prediction for `cfg` on its own hosts and devices of `per_device` bytes each (its seconds are
    meaningless here: only the memory is used)."""
    trainer = cfg.trainer
    cluster = ClusterSpec(trainer.hosts, trainer.devices_per_host, max(1, int(per_device)), MEMORY_ONLY_PROFILE)
    return predict_run(with_default_gen_layout(cfg), cluster)


def check_memory(cfg: RLConfig, actor: ModelConfig) -> None:
    """The run's memory per device from the cost model (master weights, optimizer state, gradients, generation
    copy, activations), and the KV cache of `rollout.slots` on top of the actor's resident state, against the
    device's memory (`device_memory`); skipped where that is unknown."""
    known = device_memory(cfg)
    if known is None:
        return
    per_device, source = known
    options = CostOptions()
    usable = per_device * options.usable_memory_fraction
    per_host = cfg.group_shape("rollout" if cfg.disaggregated else "actor")[1]  # the devices the KV cache spans
    resident = 0.0
    infeasible = None  # the cost model's reason, reported after the KV cache's own, more specific, check
    try:
        roles = predict_memory(cfg, per_device).roles
    except InfeasibleError as exc:
        if "rollout.slots" not in str(exc):  # not the KV cache's: the run's resident state or activations
            raise ConfigError(f"memory: {exc} ({source})") from exc
        roles, infeasible = {}, exc
    except LayoutError as exc:
        raise ConfigError(f"memory: {exc} ({source})") from exc
    except ValueError:
        roles = {}  # a run the cost model does not model (asynchronous disaggregated)
    if "rollout" in roles:  # disaggregated: the KV cache sits beside the rollout group's copy of the weights
        resident = roles["rollout"].static_bytes
    elif "actor" in roles:
        actor_cost = roles["actor"]
        resident = actor_cost.static_bytes + actor_cost.memory.get("gen_extra_params", 0.0)
        resident += roles["ref"].static_bytes if "ref" in roles else 0.0
    itemsize = ITEMSIZE[cfg.actor.dtype]
    slots = cfg.rollout.slots
    pool = cfg.rollout.prompt_cache_tokens or slots * cfg.data.max_prompt_length  # the shared prompt KV pool
    tokens = cfg.rollout.response_length + -(-pool // slots)  # per slot: its response and its share of the pool
    kv = kv_cache_bytes(actor, slots, tokens, itemsize) / per_host  # one engine per process (host), sharded
    if resident + kv > usable:
        raise ConfigError(
            f"rollout.slots={slots}: the KV cache of {kv_cache_formula(actor, slots, tokens, itemsize)} is "
            f"{kv / GIB:.2f} GiB per device on {per_host} devices, which with {resident / GIB:.2f} GiB of the actor's "
            f"resident state exceeds the {usable / GIB:.2f} GiB usable of {per_device / GIB:.2f} GiB per device "
            f"({source}); lower rollout.slots, rollout.response_length or data.max_prompt_length"
        )
    if infeasible is not None:
        raise ConfigError(f"memory: {infeasible} ({source})") from infeasible


def local_device_memory(devices: int) -> tuple[float, str] | None:
    """(bytes per device, where from) of this process's accelerator (its allocator's limit), or on CPU the host's RAM
    shared by `devices` devices; None when the backend does not say."""
    import jax

    device = jax.local_devices()[0]
    if device.platform == "cpu":
        return host_memory_per_device(devices), f"host RAM / {devices} devices"
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return None if limit is None else (float(limit), f"{device.device_kind} memory limit")


def check_generation(
    model: ModelConfig, prompt_tokens: int, new_tokens: int, slots: int, dtype: str, devices: int
) -> None:
    """`hfjax generate`: prompts of `prompt_tokens` plus `new_tokens` fit the model's positions, and its weights in
    `dtype` with the KV cache of `slots` sequences, spread over `devices`, fit a device (`local_device_memory`)."""
    lengths = f"--max-prefill-length (or the longest prompt) {prompt_tokens} + --max-new-tokens {new_tokens}"
    check_positions(model, prompt_tokens + new_tokens, lengths, "--model")
    if dtype not in ITEMSIZE:
        raise ConfigError(f"--dtype: expected one of {', '.join(ITEMSIZE)}, got {dtype!r}")
    known = local_device_memory(devices)
    if known is None:
        return
    per_device, source = known
    itemsize = ITEMSIZE[dtype]
    kv = kv_cache_bytes(model, slots, prompt_tokens + new_tokens, itemsize) / devices
    weights = model.num_params * itemsize / devices
    usable = per_device * CostOptions().usable_memory_fraction
    if kv + weights > usable:
        raise ConfigError(
            f"--slots {slots}: the KV cache of {kv_cache_formula(model, slots, prompt_tokens + new_tokens, itemsize)} "
            f"is {kv / GIB:.2f} GiB per device on {devices} devices, which with {weights / GIB:.2f} GiB of weights "
            f"exceeds the {usable / GIB:.2f} GiB usable of {per_device / GIB:.2f} GiB per device ({source}); lower "
            "--slots, --max-new-tokens or --max-prefill-length"
        )
