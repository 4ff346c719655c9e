"""`ServeConfig`: what `hfjax serve CONFIG` serves (the base model, its layout, the adapters' limits, the engine's
sizes) and where (address, run directory, worker process)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from hfjax.config.roles import Dtype


@dataclasses.dataclass
class ServeConfig:
    """One served base model with LoRA adapters on it, one per training client."""

    model_path: str = ""  # Hugging Face causal-LM directory (with its tokenizer unless tokenizer_path says)
    name: str = ""  # the base model's name clients ask for (`base_model=`); default: the directory's name
    tokenizer_path: str = ""  # default: model_path; clients' get_tokenizer() loads it (a local directory or Hub id)
    dtype: Dtype = "float32"  # compute dtype and the frozen base's storage (adapters and their Adam moments: float32)
    layout: dict[str, Any] | None = None  # mesh + rules of the base and adapters, e.g. {mesh: {fsdp: 4}, rules: fsdp}
    max_lora_rank: int = 64  # the largest rank a client may ask for
    lora_alpha: float = 32.0  # every adapter's term is scaled by lora_alpha / rank
    max_adapters: int = 16  # training clients at once (each holds an adapter, its gradient and Adam moments)
    max_train_tokens: int = 2048  # the longest datum of forward / forward_backward
    max_prompt_tokens: int = 512  # the longest sampling prompt
    max_new_tokens: int = 256  # the most tokens one sample may generate
    slots: int = 32  # sequences decoded at once (the engine's KV cache slots)
    run_dir: str = "runs/serve"  # checkpoints (save_state), the model registry, the server log
    host: str = "127.0.0.1"
    port: int = 8000
    # where the models run: `local` in the server's process (every device it sees); `ray` in one worker process on
    # a Ray cluster (joined at RAY_ADDRESS, else a local one started), holding `devices` devices of kind `device`
    backend: Literal["local", "ray"] = "local"
    device: str = "auto"  # with backend ray: auto (the cluster's GPUs, else TPUs, else cpu), cpu, gpu or tpu
    devices: int = 1  # with backend ray: the worker's devices (on CPU: fake devices)

    def __post_init__(self) -> None:
        for name in (
            "max_lora_rank",
            "max_adapters",
            "max_train_tokens",
            "max_prompt_tokens",
            "max_new_tokens",
            "slots",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha: expected > 0, got {self.lora_alpha!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port: expected 1..65535, got {self.port!r}")

    @property
    def base_model(self) -> str:
        """The name clients ask for."""
        return self.name or Path(self.model_path).name

    @property
    def tokenizer(self) -> str:
        return self.tokenizer_path or self.model_path
