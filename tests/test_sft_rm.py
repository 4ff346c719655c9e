"""SFT and reward-model trainers end to end on a tiny local checkpoint (8 fake CPU devices, fsdp): SFT memorises a
small addition set; a run interrupted after a checkpoint and resumed logs the same metrics as an uninterrupted one;
the reward model separates chosen from rejected on held-out pairs; both exports load in transformers and reproduce
the trainer's held-out metrics; configs and CLI entry points validate."""

from pathlib import Path

import numpy as np
import pytest
from support.checkpoints import save_hf_model

from hfjax.cli.main import main as cli
from hfjax.config import RMConfig, SFTConfig
from hfjax.data import PreferenceDataset, SFTDataset, write_rows
from hfjax.data.synthetic import AdditionTask, build_addition_tokenizer, write_addition_task
from hfjax.records import CheckpointManager, MetricsLogger, read_metrics
from hfjax.trainer.rm import run_rm
from hfjax.trainer.sft import run_sft
from hfjax.typed_config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SFT_STEPS, SAVE_FREQ, CRASH_STEP = 32, 4, 14
COMPARED = ("train/loss", "train/grad_norm", "train/lr", "train/epoch", "val/loss", "val/token_accuracy")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama with the addition tokenizer saved beside it."""
    root = tmp_path_factory.mktemp("sft_rm")
    tokenizer = build_addition_tokenizer()
    _, path = save_hf_model(root, "llama", vocab_size=len(tokenizer), num_hidden_layers=1)
    tokenizer.save_pretrained(path)
    return root, path


def sft_config(base, run_dir, **trainer) -> SFTConfig:
    root, model = base
    files = write_addition_task(AdditionTask(max_digits=2, num_train=0, num_test=0, num_sft=8), root / "data")
    sft = str(files["sft"])
    return load_config(
        SFTConfig,
        {
            "model": {"path": str(model)},
            "data": {
                "train_files": [sft],
                "val_files": [sft],
                "max_length": 16,
                "batch_size": 8,
                "micro_batch_size": 4,
            },
            "optim": {"lr": 1e-2, "warmup_steps": 2, "schedule": "cosine", "min_lr_ratio": 0.1},
            "trainer": {
                "run_dir": str(run_dir),
                "epochs": 100,
                "total_steps": SFT_STEPS,
                "save_freq": SAVE_FREQ,
                "val_freq": 8,
                "progress": False,
                **trainer,
            },
        },
    )


@pytest.fixture(scope="module")
def sft_run(base, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sft_run")
    cfg = sft_config(base, run_dir)
    return cfg, run_sft(cfg), read_metrics(run_dir)


def test_sft_memorises_the_training_set(sft_run):
    cfg, final, records = sft_run
    assert [r["step"] for r in records] == list(range(1, SFT_STEPS + 1))
    first = records[0]["train/loss"]
    assert final["train/loss"] < 0.15 * first
    assert final["val/loss"] < 0.15 * first  # the held-out file is the training set: memorised
    assert final["val/token_accuracy"] > 0.8
    assert all(r["train/skipped"] == 0 and np.isfinite(r["train/grad_norm"]) for r in records)
    assert CheckpointManager(Path(cfg.trainer.run_dir) / "checkpoints").all_steps() == [24, 28, 32]


def test_sft_export_loads_in_transformers_with_the_same_loss(sft_run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, final, _ = sft_run
    export = Path(cfg.trainer.run_dir) / "hf"
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
    data = SFTDataset(cfg.data.val_files, tokenizer, max_length=cfg.data.max_length)
    batch = data.collate(np.arange(len(data))).tensors
    with torch.no_grad():
        logits = model(
            input_ids=torch.as_tensor(batch["input_ids"], dtype=torch.long),
            attention_mask=torch.as_tensor(batch["attention_mask"]),
            position_ids=torch.as_tensor(batch["position_ids"], dtype=torch.long),
        ).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1).numpy()
    targets = batch["input_ids"][:, 1:]
    picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    mask = batch["loss_mask"][:, 1:]
    assert -(picked * mask).sum() / mask.sum() == pytest.approx(final["val/loss"], rel=1e-5)
    correct = (logp.argmax(-1) == targets) * mask
    assert correct.sum() / mask.sum() == pytest.approx(final["val/token_accuracy"], abs=1e-12)


class Interrupted(Exception):
    """Stands for a crash."""


def test_resumed_sft_logs_the_same_metrics_as_an_uninterrupted_run(base, sft_run, tmp_path, monkeypatch):
    _, _, uninterrupted = sft_run
    log = MetricsLogger.log

    def crash_at_step(self, step, metrics):
        if step == CRASH_STEP:
            raise Interrupted
        log(self, step, metrics)

    with monkeypatch.context() as patch:
        patch.setattr(MetricsLogger, "log", crash_at_step)
        with pytest.raises(Interrupted):
            run_sft(sft_config(base, tmp_path))
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, CRASH_STEP))
    run_sft(sft_config(base, tmp_path))
    resumed = read_metrics(tmp_path)
    assert [r["step"] for r in resumed] == list(range(1, SFT_STEPS + 1))  # steps after the checkpoint re-run once
    restored = CRASH_STEP // SAVE_FREQ * SAVE_FREQ
    for want, got in zip(uninterrupted[restored:], resumed[restored:], strict=True):
        for key in COMPARED:
            assert (key in want) == (key in got)
            if key in want:
                assert got[key] == want[key], (got["step"], key)


def preference_rows(n: int, seed: int) -> list[dict]:
    """Pairs of equal length: `chosen` has one digit of `rejected` replaced by the marker '!'."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b = rng.integers(0, 100, 2)
        digits = "".join(map(str, rng.integers(0, 10, rng.integers(2, 5))))
        at = int(rng.integers(0, len(digits)))
        rows.append({"prompt": f"{a}+{b}=", "chosen": digits[:at] + "!" + digits[at + 1 :], "rejected": digits})
    return rows


@pytest.fixture(scope="module")
def rm_run(base, tmp_path_factory):
    root, model = base
    train = write_rows(preference_rows(64, 0), root / "prefs_train.jsonl")
    val = write_rows(preference_rows(32, 1), root / "prefs_val.jsonl")
    run_dir = tmp_path_factory.mktemp("rm_run")
    cfg = load_config(
        RMConfig,
        {
            "model": {"path": str(model)},
            "data": {
                "train_files": [str(train)],
                "val_files": [str(val)],
                "max_length": 20,
                "batch_size": 16,
                "micro_batch_size": 8,
            },
            "optim": {"lr": 3e-3},
            "trainer": {"run_dir": str(run_dir), "epochs": 4, "val_freq": 2, "progress": False},
        },
    )
    return cfg, run_rm(cfg), read_metrics(run_dir)


def test_reward_model_separates_held_out_pairs(rm_run):
    _, final, records = rm_run
    val = [r for r in records if "val/accuracy" in r]
    assert [r["step"] for r in val] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert final["val/accuracy"] >= 0.9 and final["val/margin"] > 1.0
    assert final["val/chosen_score"] > final["val/rejected_score"]
    assert final["val/loss"] < 0.5 * val[0]["val/loss"]
    assert records[-1]["train/loss"] < 0.5 * records[0]["train/loss"]


def test_reward_model_export_scores_match_in_transformers(rm_run):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg, final, _ = rm_run
    export = Path(cfg.trainer.run_dir) / "hf"
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForSequenceClassification.from_pretrained(export, attn_implementation="eager").eval()
    assert model.config.num_labels == 1
    data = PreferenceDataset(cfg.data.val_files, tokenizer, max_length=cfg.data.max_length)
    batch = data.collate(np.arange(len(data))).tensors
    scores = {}
    with torch.no_grad():
        for side in ("chosen", "rejected"):
            scores[side] = (
                model(
                    input_ids=torch.as_tensor(batch[f"{side}_input_ids"], dtype=torch.long),
                    attention_mask=torch.as_tensor(batch[f"{side}_attention_mask"]),
                )
                .logits[:, 0]
                .double()
                .numpy()
            )
    margin = scores["chosen"] - scores["rejected"]
    assert np.mean(margin > 0) == pytest.approx(final["val/accuracy"], abs=1e-12)
    assert np.mean(margin) == pytest.approx(final["val/margin"], rel=1e-5)
    assert np.mean(scores["chosen"]) == pytest.approx(final["val/chosen_score"], rel=1e-5)


def test_configs_validate_and_errors_name_the_key(base, tmp_path, capsys):
    sft = load_config(SFTConfig, CONFIGS / "sft_addition.yaml", ["trainer.total_steps=5"])
    assert sft.trainer.total_steps == 5 and sft.data.batch_size % sft.data.micro_batch_size == 0
    rm = load_config(RMConfig, CONFIGS / "rm_example.yaml")
    assert rm.trainer.run_dir and rm.data.val_files
    with pytest.raises(ConfigError, match=r"data\.batch_size: expected a multiple of micro_batch_size=4, got 10"):
        load_config(SFTConfig, CONFIGS / "sft_addition.yaml", ["data.batch_size=10", "data.micro_batch_size=4"])
    with pytest.raises(ConfigError, match=r"^optim\.lr: expected > 0, got 0\.0 \(from overrides\)$"):
        load_config(RMConfig, CONFIGS / "rm_example.yaml", ["optim.lr=0"])
    assert cli(["sft", str(CONFIGS / "sft_addition.yaml"), "trainer.epochz=2"]) == 2
    assert capsys.readouterr().err.startswith("hfjax sft: trainer.epochz: unknown key")
    assert cli(["rm", str(CONFIGS / "rm_example.yaml"), "model.dtype=float8"]) == 2


def test_resume_never_refuses_a_run_dir_with_checkpoints(base, sft_run):
    cfg, _, _ = sft_run
    with pytest.raises(ValueError, match=r"trainer\.resume=never"):
        run_sft(sft_config(base, cfg.trainer.run_dir, resume="never"))
