"""Datasets: prompt batches against a hand computation of left padding and positions and against
`tokenizer.apply_chat_template`, over-long prompts under each truncation mode, malformed rows named by file and row,
resumable shuffling, SFT and preference tokenization, the GSM8K converter and the synthetic addition task."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from hfjax.cli.main import main as cli
from hfjax.data import (
    AdditionTask,
    BatchLoader,
    DataError,
    PreferenceDataset,
    PromptDataset,
    SFTDataset,
    build_addition_tokenizer,
    read_rows,
    write_addition_task,
    write_rows,
)
from hfjax.data.gsm8k import INSTRUCTION
from hfjax.data.synthetic import addition_problems, teacher_answers
from hfjax.models.local_tokenizer import build_bpe_tokenizer
from hfjax.rewards import compute_score

# Unlike the simple template, this one only adds the assistant turn when asked to: a dataset that forgot
# add_generation_prompt=True would tokenize differently.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = [
    "the", "cat", "sat", "on", "a", "mat", "while", "seven", "dogs", "ran",
    "far", "away", "from", "home", "and", "all", "of", "them", "were", "happy",
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] + ["<|user|> <|assistant|> <|system|>"]
    return build_bpe_tokenizer(corpus, vocab_size=300, chat_template=TEMPLATE)


def _prompt_rows(rng, n: int, max_words: int = 12) -> list[dict]:
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": " ".join(rng.choice(WORDS, rng.integers(1, max_words)))}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": str(rng.choice(WORDS))})
        rows.append(
            {
                "data_source": f"src{i % 3}",
                "prompt": messages,
                "ability": "talk",
                "reward_model": {"style": "rule", "ground_truth": str(rng.integers(1000))},
                "extra_info": {"index": 100 + i, "split": "train"},
            }
        )
    return rows


def _template_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def test_prompt_batch_matches_chat_template_and_hand_padding(tokenizer, tmp_path):
    rng = np.random.default_rng()
    rows = _prompt_rows(rng, 9)
    width = 128
    for suffix in (".jsonl", ".parquet"):
        ds = PromptDataset(write_rows(rows, tmp_path / f"p{suffix}"), tokenizer, max_prompt_length=width)
        pick = rng.permutation(len(rows))[:5]
        batch = ds.collate(pick)
        ids, mask, pos = (batch.tensors[k] for k in ("input_ids", "attention_mask", "position_ids"))
        assert ids.shape == mask.shape == pos.shape == (5, width) and ids.dtype == np.int32
        for b, i in enumerate(pick):
            want = _template_ids(tokenizer, rows[i]["prompt"])
            assert want != list(tokenizer.apply_chat_template(rows[i]["prompt"])["input_ids"])
            pad = width - len(want)
            assert ids[b].tolist() == [tokenizer.pad_token_id] * pad + want
            assert mask[b].tolist() == [0] * pad + [1] * len(want)
            assert pos[b].tolist() == [0] * pad + list(range(len(want)))
            nt = {k: v[b] for k, v in batch.non_tensors.items()}
            assert nt["raw_prompt"] == rows[i]["prompt"] and nt["data_source"] == rows[i]["data_source"]
            assert nt["ground_truth"] == rows[i]["reward_model"]["ground_truth"]
            assert nt["index"] == 100 + i and nt["uid"] == str(i) and nt["extra_info"]["split"] == "train"
        longest = PromptDataset(tmp_path / f"p{suffix}", tokenizer, max_prompt_length=width, pad_to="longest")
        assert longest.collate(pick).tensors["input_ids"].shape[1] == max(len(ds[i].input_ids) for i in pick)


def test_over_long_prompts_per_truncation_mode(tokenizer, tmp_path, caplog):
    rng = np.random.default_rng()
    rows = _prompt_rows(rng, 12, max_words=20)
    path = write_rows(rows, tmp_path / "p.jsonl")
    lengths = [len(_template_ids(tokenizer, r["prompt"])) for r in rows]
    limit = int(np.median(lengths))
    over = [i for i, n in enumerate(lengths) if n > limit]
    assert over, lengths
    with pytest.raises(
        DataError, match=rf"{re.escape(str(path))}: row {over[0] + 1}: prompt has {lengths[over[0]]} tok"
    ):
        PromptDataset(path, tokenizer, max_prompt_length=limit)
    with caplog.at_level("WARNING"):
        kept = PromptDataset(path, tokenizer, max_prompt_length=limit, truncation="filter")
    assert kept.num_filtered == len(over) and f"filtered {len(over)} of {len(rows)}" in caplog.text
    assert [e.uid for e in kept.examples] == [str(i) for i in range(len(rows)) if i not in over]
    for mode, cut in (("left", slice(-limit, None)), ("right", slice(0, limit))):
        ds = PromptDataset(path, tokenizer, max_prompt_length=limit, truncation=mode)
        for i, example in enumerate(ds.examples):
            assert example.input_ids.tolist() == _template_ids(tokenizer, rows[i]["prompt"])[cut]
    with pytest.raises(DataError, match="truncation: expected one of"):
        PromptDataset(path, tokenizer, max_prompt_length=limit, truncation="middle")
    with pytest.raises(DataError, match="pad_to: expected one of"):
        PromptDataset(path, tokenizer, max_prompt_length=limit, pad_to="widest")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("prompt", [{"role": "user", "content": 5}], "field 'prompt[0].content': expected a string, got 5"),
        ("prompt", [], "field 'prompt': expected a non-empty list"),
        ("prompt", "", "field 'prompt': expected a prompt with some text (every message's content is empty), got ''"),
        ("prompt", [{"role": "system", "content": " "}, {"role": "user", "content": ""}], "some text"),
        ("prompt", [{"content": "hi"}], "field 'prompt[0].role': expected a non-empty string, got None"),
        ("data_source", None, "missing required field 'data_source'"),
        ("reward_model", "42", "field 'reward_model': expected a mapping, got '42'"),
        ("extra_info", [1], "field 'extra_info': expected a mapping, got [1]"),
    ],
)
def test_malformed_prompt_rows_name_file_row_and_field(tokenizer, tmp_path, field, value, message):
    rows = _prompt_rows(np.random.default_rng(), 5)
    bad = int(np.random.default_rng().integers(len(rows)))
    rows[bad][field] = value
    path = write_rows(rows, tmp_path / "p.jsonl")
    with pytest.raises(DataError) as info:
        PromptDataset(path, tokenizer, max_prompt_length=64)
    assert str(info.value).startswith(f"{path}: row {bad + 1}: ") and message in str(info.value)


def test_malformed_files(tokenizer, tmp_path):
    good = json.dumps(_prompt_rows(np.random.default_rng(), 1)[0])
    (tmp_path / "bad.jsonl").write_text(f"{good}\n\n{good}\n{{not json\n")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'bad.jsonl'}: row 4: invalid JSON")):
        PromptDataset(tmp_path / "bad.jsonl", tokenizer, max_prompt_length=64)
    rows = _prompt_rows(np.random.default_rng(), 4)
    rows[2]["prompt"] = None
    path = write_rows(rows, tmp_path / "p.parquet")
    with pytest.raises(DataError, match=re.escape(f"{path}: row 3: missing required field 'prompt'")):
        PromptDataset(path, tokenizer, max_prompt_length=64)
    with pytest.raises(DataError, match=re.escape("unsupported file type '.csv'")):
        read_rows(tmp_path / "x.csv")
    with pytest.raises(DataError, match="no such file"):
        read_rows(tmp_path / "absent.parquet")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_row_that_is_not_utf8_names_file_row_and_encoding(tmp_path, suffix):
    """One row holding the byte 0xff (Latin-1's "ÿ") in its prompt: a DataError naming the file and the row, in
    JSONL (a line that does not decode) and in parquet (a string column whose value does not)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _prompt_rows(np.random.default_rng(0), 6)
    prompts = [json.dumps(row["prompt"]).encode() for row in rows]
    bad = 3  # 0-based
    prompts[bad] = prompts[bad].replace(b"user", b"us\xffer")
    path = tmp_path / f"p{suffix}"
    if suffix == ".jsonl":
        path.write_bytes(b"".join(b'{"data_source": "x", "prompt": ' + p + b"}\n" for p in prompts))
        expected = f"{path}: row {bad + 1}: not valid UTF-8 (0xff at byte "
    else:
        binary = pa.array(prompts, pa.binary())
        strings = pa.Array.from_buffers(pa.string(), len(prompts), binary.buffers())  # no UTF-8 validation
        pq.write_table(pa.table({"data_source": ["x"] * len(prompts), "prompt": strings}), path, row_group_size=4)
        expected = f"{path}: row {bad + 1}: field 'prompt' is not valid UTF-8 (0xff at byte "
    with pytest.raises(DataError) as info:
        read_rows(path)
    message = str(info.value)
    assert message.startswith(expected) and message.endswith(": invalid start byte); expected UTF-8 text"), message


class _Rows:
    """A stand-in dataset whose batches are the row indices themselves."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def collate(self, indices):
        return np.asarray(indices)


def _take(loader: BatchLoader, count: int) -> list:
    """The next `count` batches, crossing epochs (the loader's position moves on)."""
    out: list = []
    while len(out) < count:
        for batch in loader:
            out.append(batch)
            if len(out) == count:
                break
    return out


@pytest.mark.parametrize("drop_last", [True, False])
def test_loader_resume_equals_uninterrupted(drop_last):
    rng = np.random.default_rng()
    n, size, seed, epochs = int(rng.integers(20, 60)), int(rng.integers(3, 9)), int(rng.integers(1 << 30)), 3

    def loader():
        return BatchLoader(_Rows(n), size, seed=seed, drop_last=drop_last)

    per_epoch = len(loader())
    assert per_epoch == (n // size if drop_last else -(-n // size))
    full = _take(loader(), epochs * per_epoch)
    for e in range(epochs):
        rows = np.concatenate(full[e * per_epoch : (e + 1) * per_epoch])
        assert len(set(rows.tolist())) == len(rows) == (per_epoch * size if drop_last else n)
    assert not np.array_equal(np.concatenate(full[:per_epoch]), np.concatenate(full[per_epoch : 2 * per_epoch]))

    for stop in (per_epoch, int(rng.integers(1, epochs * per_epoch))):  # an epoch boundary, and anywhere
        first = loader()
        seen = _take(first, stop)
        resumed = loader()
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert resumed.epoch == stop // per_epoch
        rest = [b for _ in range(resumed.epoch, epochs) for b in resumed]
        assert len(seen) + len(rest) == len(full)
        for got, want in zip(seen + rest, full, strict=True):
            np.testing.assert_array_equal(got, want)


def test_loader_state_checks():
    loader = BatchLoader(_Rows(10), 3, seed=1)
    state = loader.state_dict()
    with pytest.raises(DataError, match="seed was 1 when saved but is 2 now"):
        BatchLoader(_Rows(10), 3, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="num_rows was 10 when saved but is 11 now"):
        BatchLoader(_Rows(11), 3, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="0 <= batch < 3"):
        loader.load_state_dict({**state, "batch": 3})
    with pytest.raises(DataError, match="fewer than batch_size 11"):
        BatchLoader(_Rows(10), 11)
    assert [len(b) for b in BatchLoader(_Rows(10), 4, shuffle=False, drop_last=False)] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate(list(BatchLoader(_Rows(10), 5, shuffle=False))), np.arange(10))


def test_sft_loss_mask_and_right_padding(tokenizer, tmp_path):
    rng = np.random.default_rng()
    rows = []
    for _ in range(6):
        response = " ".join(rng.choice(WORDS, rng.integers(1, 6)))
        prompt = " ".join(rng.choice(WORDS, rng.integers(1, 6)))
        rows.append(
            {
                "prompt": prompt,
                "response": [{"role": "assistant", "content": response}] if rng.random() < 0.5 else response,
            }
        )
    path = write_rows(rows, tmp_path / "sft.jsonl")
    width = 96
    ds = SFTDataset(path, tokenizer, max_length=width)
    batch = ds.collate(range(len(rows)))
    for b, row in enumerate(rows):
        response = row["response"] if isinstance(row["response"], str) else row["response"][0]["content"]
        p = _template_ids(tokenizer, [{"role": "user", "content": row["prompt"]}])
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        pad = width - len(p) - len(r)
        assert batch.tensors["input_ids"][b].tolist() == p + r + [tokenizer.pad_token_id] * pad
        assert batch.tensors["loss_mask"][b].tolist() == [0] * len(p) + [1] * len(r) + [0] * pad
        assert batch.tensors["attention_mask"][b].tolist() == [1] * (len(p) + len(r)) + [0] * pad
        assert batch.tensors["position_ids"][b].tolist() == list(range(len(p) + len(r))) + [0] * pad
        short = SFTDataset(path, tokenizer, max_length=len(p) + 1, truncation="right")
        assert short.loss_mask[b].tolist() == [0] * len(p) + [1] and short.input_ids[b].tolist() == p + r[:1]
    rows[3]["response"] = [{"role": "user", "content": "x"}]
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'sft.jsonl'}: row 4: field 'response': expected")):
        SFTDataset(write_rows(rows, tmp_path / "sft.jsonl"), tokenizer, max_length=width)


def test_preference_pairs(tokenizer, tmp_path):
    rng = np.random.default_rng()
    rows = [
        {
            "prompt": [{"role": "user", "content": " ".join(rng.choice(WORDS, rng.integers(1, 6)))}],
            "chosen": " ".join(rng.choice(WORDS, rng.integers(1, 8))),
            "rejected": " ".join(rng.choice(WORDS, rng.integers(1, 8))),
        }
        for _ in range(5)
    ]
    as_messages = [{**r, "chosen": [{"role": "assistant", "content": r["chosen"]}]} for r in rows]
    width = 128
    plain = PreferenceDataset(
        write_rows(rows, tmp_path / "a.parquet"), tokenizer, max_length=width, padding_side="left"
    )
    chat = PreferenceDataset(
        write_rows(as_messages, tmp_path / "b.jsonl"), tokenizer, max_length=width, padding_side="left"
    )
    batch, other = plain.collate([4, 0, 2]), chat.collate([4, 0, 2])
    for key, value in batch.tensors.items():
        np.testing.assert_array_equal(value, other.tensors[key])
    for b, i in enumerate([4, 0, 2]):
        p = _template_ids(tokenizer, rows[i]["prompt"])
        for side in ("chosen", "rejected"):
            want = p + tokenizer(rows[i][side], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            ids, mask = batch.tensors[f"{side}_input_ids"][b], batch.tensors[f"{side}_attention_mask"][b]
            assert ids.tolist() == [tokenizer.pad_token_id] * (width - len(want)) + want
            assert mask.sum() == len(want) and batch.tensors[f"{side}_position_ids"][b, -1] == len(want) - 1
    rows[1]["rejected"] = None
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'c.jsonl'}: row 2: missing required field 'rejected'")):
        PreferenceDataset(write_rows(rows, tmp_path / "c.jsonl"), tokenizer, max_length=width)


GSM8K_ROWS = [
    {"question": "Ann has 3 pens and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm has 1,200 hens and sells 200.", "answer": "1,200 - 200 = 1,000\n#### 1,000"},
    {"question": "Bob owes $5 and pays $8. Change?", "answer": "8 - 5 = 3 dollars\n#### 3"},
]


def test_gsm8k_converter_round_trip(tokenizer, tmp_path, capsys):
    write_rows(GSM8K_ROWS, tmp_path / "in" / "train.jsonl")
    write_rows(GSM8K_ROWS[:1], tmp_path / "in" / "test.jsonl")
    assert cli(["data", "gsm8k", "--from", str(tmp_path / "in"), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "train: 3 rows" in out and "sft_test: 1 rows" in out
    rows = [row for _, row in read_rows(tmp_path / "out" / "train.parquet")]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1000", "3"]
    for i, (row, src) in enumerate(zip(rows, GSM8K_ROWS, strict=True)):
        assert row["prompt"] == [{"role": "user", "content": f"{src['question']} {INSTRUCTION}"}]
        assert row["data_source"] == "openai/gsm8k" and row["extra_info"]["index"] == i
        assert row["extra_info"]["answer"] == src["answer"]
        # The reference solution scores 1 under the GSM8K rule reward, against the converted ground truth.
        assert compute_score(row["data_source"], src["answer"], row["reward_model"]["ground_truth"]) == 1.0
    sft = [row for _, row in read_rows(tmp_path / "out" / "sft_train.parquet")]
    assert [r["response"] for r in sft] == [r["answer"] for r in GSM8K_ROWS]
    ds = PromptDataset(tmp_path / "out" / "train.parquet", tokenizer, max_prompt_length=256)
    assert ds.collate([1]).non_tensors["ground_truth"][0] == "1000"

    write_rows([*GSM8K_ROWS, {"question": "q", "answer": "no marker"}], tmp_path / "bad" / "test.jsonl")
    assert cli(["data", "gsm8k", "--from", str(tmp_path / "bad"), "--out", str(tmp_path / "o2")]) == 2
    error = capsys.readouterr().err
    assert f"hfjax data: {tmp_path / 'bad' / 'test.jsonl'}: row 4: field 'answer': expected a worked answer" in error


def test_addition_task(tmp_path):
    rng = np.random.default_rng()
    task = AdditionTask(min_digits=2, max_digits=3, num_train=40, num_test=20, num_sft=30, seed=int(rng.integers(1000)))
    paths = write_addition_task(task, tmp_path)
    seen = set()
    for split in ("train", "test"):
        rows = [row for _, row in read_rows(paths[split])]
        assert len(rows) == getattr(task, f"num_{split}")
        for row in rows:
            a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", row["prompt"][0]["content"]).groups())
            assert row["reward_model"]["ground_truth"] == str(a + b) and 10 <= a < 1000 and 10 <= b < 1000
            assert compute_score(row["data_source"], f" {a + b}\n", row["reward_model"]["ground_truth"]) == 1.0
            seen.add((a, b))
    sft = [row for _, row in read_rows(paths["sft"])]
    for row in sft:
        a, b = map(int, row["prompt"][0]["content"][:-1].split("+"))
        assert row["response"] == str(a + b)
        seen.add((a, b))
    assert len(seen) == 90  # no problem in two splits
    assert addition_problems(task) == addition_problems(AdditionTask(**{**task.__dict__}))
    assert addition_problems(task) != addition_problems(AdditionTask(**{**task.__dict__, "seed": task.seed + 1}))
    with pytest.raises(ValueError, match="only give 100"):
        AdditionTask(min_digits=1, max_digits=1, num_train=90, num_test=10, num_sft=1)

    tok = build_addition_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "907+45="}], add_generation_prompt=True, tokenize=False)
    pieces = tok.convert_ids_to_tokens(tok(text + "952", add_special_tokens=False)["input_ids"])
    assert [p for p in pieces if p in "0123456789+="] == list("907+45=952")  # each digit its own token
    ds = PromptDataset(paths["test"], tok, max_prompt_length=16)
    assert len(ds) == 20 and ds.collate([0]).tensors["input_ids"].shape == (1, 16)


def test_sloppy_sft_teacher_forgets_the_carry_only_in_sft_answers(tmp_path):
    task = AdditionTask(min_digits=1, max_digits=2, num_train=300, num_test=100, num_sft=2000, sft_carry_slip=0.5)
    paths = write_addition_task(task, tmp_path)
    slipped = carrying = 0
    for _, row in read_rows(paths["sft"]):
        a, b = map(int, row["prompt"][0]["content"][:-1].split("+"))
        carry = a % 10 + b % 10 >= 10
        assert int(row["response"]) in ((a + b, a + b - 10) if carry else (a + b,)), row
        carrying += carry
        slipped += int(row["response"]) == a + b - 10
    # about half of the carrying problems slip (binomial, 5 sigma); the RL and held-out answers are the true sums
    assert carrying > 500 and abs(slipped - carrying / 2) < 5 * (carrying / 4) ** 0.5, (slipped, carrying)
    for split in ("train", "test"):
        for _, row in read_rows(paths[split]):
            a, b = map(int, re.fullmatch(r"(\d+)\+(\d+)=", row["prompt"][0]["content"]).groups())
            assert row["reward_model"]["ground_truth"] == str(a + b)
    always = AdditionTask(max_digits=2, num_train=0, num_test=0, num_sft=4, sft_carry_slip=1.0)
    assert teacher_answers(always, [(7, 5), (23, 19), (41, 8), (95, 5)]) == [2, 32, 49, 90]
    never = AdditionTask(max_digits=2, num_train=0, num_test=0, num_sft=4)
    assert teacher_answers(never, [(7, 5), (23, 19), (41, 8), (95, 5)]) == [12, 42, 49, 100]
    with pytest.raises(ValueError, match="sft_carry_slip"):
        AdditionTask(sft_carry_slip=1.5)
