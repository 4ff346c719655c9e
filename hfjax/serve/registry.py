"""Who owns what in the service: sessions, training runs (model ids), sampling sessions, and the `tinker://` paths of
saved checkpoints.

Model ids are `{session_id}:train:{model_seq_id}` (the SDK derives the same id itself when it creates a training
client from a checkpoint), sampling session ids `{session_id}:sample:{seq_id}`. Checkpoint paths are
`tinker://{model_id}/weights/{name}` (training state, `save_state`) and `tinker://{model_id}/sampler_weights/{name}`
(`save_weights_for_sampler`). Each training run's metadata (base model, LoRA config, its checkpoints and where the
backend put them) is a JSON file under `{run_dir}/serve/runs/`, so a restarted server resolves the paths of earlier
runs; sessions, live adapters and sampling sessions last as long as the server process.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import re
import threading
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

from hfjax.serve.backend import ServeError

log = logging.getLogger(__name__)

TINKER_SCHEME = "tinker://"
CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def owner_of(api_key: str | None) -> str:
    """A stable, non-secret id for the API key a request carries (what ownership is checked against)."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()[:16]


def check_name(name: str | None, what: str) -> str:
    """A checkpoint name: letters, digits, '.', '_' and '-', starting with a letter or digit (it ends a path)."""
    if name is None or not _NAME.fullmatch(name):
        raise ServeError(
            f"{what} name {name!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', starting with a letter "
            "or digit"
        )
    return name


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


@dataclasses.dataclass
class RunRecord:
    """A training run (one model id): what a restarted server needs to resume from its checkpoints."""

    model_id: str
    base_model: str
    rank: int
    seed: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    owner: str
    created: str = dataclasses.field(default_factory=_now)
    user_metadata: dict[str, Any] | None = None
    checkpoints: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """'weights/{name}' -> {'dir', 'optimizer', 'time'}; 'sampler_weights/{name}' -> {'sampler', 'time'}."""

    def started_again(self, model_id: str, owner: str, user_metadata: dict[str, Any] | None) -> RunRecord:
        """A new run `model_id` with this one's adapter shape (a checkpoint of this run loaded into a new model)."""
        return dataclasses.replace(
            self, model_id=model_id, owner=owner, user_metadata=user_metadata, created=_now(), checkpoints={}
        )


@dataclasses.dataclass
class SamplerRecord:
    """A sampling session: the frozen sampler version it samples (None: the base model alone)."""

    sampling_session_id: str
    base_model: str
    sampler: str | None
    model_path: str | None
    owner: str
    clients: int = 1


@dataclasses.dataclass
class Checkpoint:
    """A resolved `tinker://` path."""

    path: str
    run: RunRecord
    kind: str  # "weights" | "sampler_weights"
    entry: dict[str, Any]


class Registry:
    """Thread-safe (the HTTP handlers and the backend thread both use it)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self._runs_dir = Path(run_dir) / "serve" / "runs"
        self._runs_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._sessions: dict[str, str] = {}  # session id -> owner
        self._live: dict[str, str] = {}  # model id -> session id, for adapters alive in this process
        self._samplers: dict[str, SamplerRecord] = {}
        self._runs: dict[str, RunRecord] = {}
        fields = {field.name for field in dataclasses.fields(RunRecord)}
        for file in sorted(self._runs_dir.glob("*.json")):
            try:
                record = RunRecord(**{k: v for k, v in json.loads(file.read_text()).items() if k in fields})
            except (ValueError, TypeError) as error:
                log.warning("skipping the unreadable run record %s: %s", file, error)
                continue
            self._runs[record.model_id] = record

    def new_session(self, owner: str) -> str:
        session_id = f"session-{uuid.uuid4().hex[:20]}"
        with self._lock:
            self._sessions[session_id] = owner
        return session_id

    def check_session(self, session_id: str, owner: str) -> None:
        with self._lock:
            if self._sessions.get(session_id) != owner:
                raise ServeError(f"unknown session {session_id!r} (sessions do not outlive a server restart)", 404)

    def end_session(self, session_id: str, owner: str) -> list[str]:
        """Ends a session: returns the model ids of its live adapters, which are no longer live."""
        with self._lock:
            self.check_session(session_id, owner)
            del self._sessions[session_id]
            ended = [model_id for model_id, session in self._live.items() if session == session_id]
            for model_id in ended:
                del self._live[model_id]
            return ended

    @staticmethod
    def model_id(session_id: str, model_seq_id: int) -> str:
        return f"{session_id}:train:{model_seq_id}"

    @staticmethod
    def sampling_session_id(session_id: str, seq_id: int) -> str:
        return f"{session_id}:sample:{seq_id}"

    def add_run(self, record: RunRecord, session_id: str) -> None:
        """Records a new live training run (after the backend created its adapter) and writes its metadata."""
        with self._lock:
            self._runs[record.model_id] = record
            self._live[record.model_id] = session_id
            self._save(record)

    def live_run(self, model_id: str, owner: str) -> RunRecord:
        """The live run `model_id` of the caller; 404 for an unknown, ended or someone else's model id."""
        with self._lock:
            record = self._runs.get(model_id)
            if record is None or model_id not in self._live or record.owner != owner:
                raise ServeError(f"unknown model id {model_id!r} (not a live training client of this API key)", 404)
            return record

    def is_live(self, model_id: str) -> bool:
        with self._lock:
            return model_id in self._live

    def live_session(self, model_id: str) -> str:
        """The session a live model belongs to."""
        with self._lock:
            if model_id not in self._live:
                raise ServeError(f"unknown model id {model_id!r}", 404)
            return self._live[model_id]

    def checkpoints(self, model_id: str) -> dict[str, dict[str, Any]]:
        """The checkpoints of any run this server knows of, live or from an earlier server process."""
        with self._lock:
            if model_id not in self._runs:
                raise ServeError(f"unknown training run {model_id!r}", 404)
            return {name: dict(entry) for name, entry in self._runs[model_id].checkpoints.items()}

    @staticmethod
    def checkpoint_path(model_id: str, kind: str, name: str) -> str:
        return f"{TINKER_SCHEME}{model_id}/{kind}/{name}"

    def add_checkpoint(self, model_id: str, kind: str, name: str, entry: dict[str, Any]) -> str:
        """Records a saved checkpoint of the run; returns its `tinker://` path."""
        with self._lock:
            record = self._runs[model_id]
            record.checkpoints[f"{kind}/{name}"] = {**entry, "time": _now()}
            self._save(record)
        return self.checkpoint_path(model_id, kind, name)

    def has_checkpoint(self, model_id: str, kind: str, name: str) -> bool:
        with self._lock:
            return f"{kind}/{name}" in self._runs[model_id].checkpoints

    def resolve(self, path: str, kind: str | None = None) -> Checkpoint:
        """The checkpoint at `path` (a path this server or an earlier one on the same run_dir handed out)."""
        parts = path[len(TINKER_SCHEME) :].split("/") if path.startswith(TINKER_SCHEME) else []
        if len(parts) != 3 or parts[1] not in CHECKPOINT_KINDS:
            raise ServeError(f"path {path!r} is not a checkpoint path: tinker://MODEL_ID/weights|sampler_weights/NAME")
        model_id, found_kind, name = parts
        if kind is not None and found_kind != kind:
            raise ServeError(
                f"path {path!r} is a {CHECKPOINT_KINDS[found_kind]} checkpoint; this needs a {CHECKPOINT_KINDS[kind]} "
                f"one (tinker://MODEL_ID/{kind}/NAME, from "
                f"{'save_state' if kind == 'weights' else 'save_weights_for_sampler'})"
            )
        with self._lock:
            record = self._runs.get(model_id)
            entry = record.checkpoints.get(f"{found_kind}/{name}") if record else None
            if record is None or entry is None:
                raise ServeError(f"unknown checkpoint path {path!r}", 404)
            return Checkpoint(path=path, run=record, kind=found_kind, entry=dict(entry))

    def add_sampler(self, record: SamplerRecord) -> None:
        with self._lock:
            self._samplers[record.sampling_session_id] = record

    def sampler(self, sampling_session_id: str, owner: str) -> SamplerRecord:
        with self._lock:
            record = self._samplers.get(sampling_session_id)
            if record is None or record.owner != owner:
                raise ServeError(f"unknown sampling session {sampling_session_id!r}", 404)
            return record

    def join_sampler(self, sampling_session_id: str, owner: str) -> int:
        """A new client id within the sampling session (the original client is 0)."""
        with self._lock:
            record = self.sampler(sampling_session_id, owner)
            record.clients += 1
            return record.clients - 1

    def _save(self, record: RunRecord) -> None:
        file = self._runs_dir / f"{quote(record.model_id, safe='')}.json"
        tmp = file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(record), indent=1, sort_keys=True))
        os.replace(tmp, file)
