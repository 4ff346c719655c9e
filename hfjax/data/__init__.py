"""Datasets for RLHF: RL prompts in verl's schema, SFT and preference data, resumable shuffled batching, GSM8K
conversion and the quickstart's synthetic addition task. Never imports JAX."""

from hfjax.data.gsm8k import convert_gsm8k
from hfjax.data.loader import BatchLoader
from hfjax.data.preference import PreferenceDataset
from hfjax.data.prompts import PromptDataset, PromptExample
from hfjax.data.records import DataError, RowRef, read_rows, write_rows
from hfjax.data.sft import SFTDataset
from hfjax.data.synthetic import AdditionTask, build_addition_tokenizer, write_addition_task
from hfjax.data.tokenize import TRUNCATIONS, Batch, Truncation, position_ids

__all__ = [
    "TRUNCATIONS",
    "AdditionTask",
    "Batch",
    "BatchLoader",
    "DataError",
    "PreferenceDataset",
    "PromptDataset",
    "PromptExample",
    "RowRef",
    "SFTDataset",
    "Truncation",
    "build_addition_tokenizer",
    "convert_gsm8k",
    "position_ids",
    "read_rows",
    "write_addition_task",
    "write_rows",
]
