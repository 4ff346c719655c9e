"""The vision quickstart's synthetic task, generated in code: small images of coloured shapes, one per occupied cell of
a 2 x 2 grid, and the question "how many shapes?" (answer "1".."4"). Written as disjoint RL train / held-out test
prompt files in verl's multimodal schema (an `images` column of PNG bytes, `<image>` in the prompt) and an SFT file,
with a small local Gemma 3 processor (a BPE tokenizer that keeps every digit a token of its own, Gemma 3's image
tokens, images resized to `image_size`). The prompt text is the same in every row: only the image tells the answer."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hfjax.data.images import IMAGE_MARK
from hfjax.data.records import write_rows

DATA_SOURCE = "hfjax/shapes"
QUESTION = f"{IMAGE_MARK}how many shapes?"
CELLS = 4  # a 2 x 2 grid
COLOURS = np.asarray([[230, 40, 40], [40, 200, 60], [50, 90, 240], [240, 210, 40], [230, 230, 230]], np.uint8)
SPLITS = ("train", "test", "sft")


@dataclass(frozen=True)
class ShapesTask:
    """Images of `image_size` pixels a side holding 1..4 shapes (the count uniform; each in its own cell of a 2 x 2
    grid, of a random colour, size and place within the cell, on a dark noisy background), split into `num_train` RL
    prompts, `num_test` held-out prompts and `num_sft` supervised examples. The SFT answers come from a teacher that
    misses one shape (answers count - 1) on a `sft_miss` fraction of the images with 3 or more; RL prompts and the
    held-out split are scored against the true count."""

    image_size: int = 32  # pixels a side
    num_train: int = 2048  # RL prompts
    num_test: int = 256  # held-out prompts (validation accuracy)
    num_sft: int = 2048  # supervised examples
    seed: int = 0  # seed of the images, splits and the teacher's misses
    sft_miss: float = 0.6  # fraction of the SFT images with 3 or more shapes whose answer misses one

    def __post_init__(self) -> None:
        if self.image_size < 8 or self.image_size % 2:
            raise ValueError(f"image_size: expected an even number of pixels >= 8, got {self.image_size}")
        if min(self.num_train, self.num_test, self.num_sft) < 0:
            raise ValueError(f"split sizes must be >= 0, got {self.num_train}, {self.num_test}, {self.num_sft}")
        if not 0.0 <= self.sft_miss <= 1.0:
            raise ValueError(f"sft_miss: expected a fraction in [0, 1], got {self.sft_miss}")


def draw(rng: np.random.Generator, size: int, cells: np.ndarray) -> np.ndarray:
    """[size, size, 3] uint8: a dark noisy background with one shape (a filled square or disc of a random colour,
    at least a third of the cell wide) in each of the grid `cells` (indices 0..3, row-major)."""
    image = rng.integers(0, 40, (size, size, 3), dtype=np.uint8)
    half = size // 2
    for cell in cells.tolist():
        width = int(rng.integers(max(2, half // 3), half - 1))
        top = (cell // 2) * half + int(rng.integers(0, half - width + 1))
        left = (cell % 2) * half + int(rng.integers(0, half - width + 1))
        colour = COLOURS[rng.integers(len(COLOURS))]
        rows, cols = np.mgrid[top : top + width, left : left + width]
        if rng.random() < 0.5:  # a disc in the square's place
            centre, radius = (width - 1) / 2, width / 2
            keep = (rows - top - centre) ** 2 + (cols - left - centre) ** 2 <= radius**2
            rows, cols = rows[keep], cols[keep]
        image[rows, cols] = colour
    return image


def png(pixels: np.ndarray) -> bytes:
    """The image `pixels` ([height, width, 3] uint8) encoded as PNG."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def shape_images(task: ShapesTask) -> dict[str, list[tuple[np.ndarray, int]]]:
    """(image, shape count) per split, drawn with `task.seed`."""
    rng = np.random.default_rng(task.seed)
    sizes = (task.num_train, task.num_test, task.num_sft)
    out = {}
    for split, count in zip(SPLITS, sizes, strict=True):
        shapes = rng.integers(1, CELLS + 1, count)
        out[split] = [(draw(rng, task.image_size, rng.permutation(CELLS)[:n]), int(n)) for n in shapes]
    return out


def teacher_answers(task: ShapesTask, counts: list[int]) -> list[int]:
    """The SFT teacher's answers: the true count, except count - 1 on a seeded `task.sft_miss` fraction of the images
    with 3 or more shapes."""
    misses = np.random.default_rng([task.seed, 1]).random(len(counts)) < task.sft_miss
    return [n - int(miss and n >= 3) for n, miss in zip(counts, misses, strict=True)]


def prompt_row(image: np.ndarray, count: int, split: str, index: int) -> dict[str, Any]:
    """One RL prompt row in verl's multimodal schema; the ground truth is the count's digit."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": QUESTION}],
        "images": [{"bytes": png(image)}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": str(count)},
        "extra_info": {"split": split, "index": index},
    }


def write_shapes_task(task: ShapesTask, out_dir: str | Path) -> dict[str, Path]:
    """Writes `train.parquet`, `test.parquet` (prompt schema) and `sft.parquet` (`prompt`, `images`, `response`) under
    `out_dir`; returns the paths by split name."""
    out_dir = Path(out_dir)
    images = shape_images(task)
    paths = {
        split: write_rows(
            [prompt_row(image, n, split, i) for i, (image, n) in enumerate(images[split])], out_dir / f"{split}.parquet"
        )
        for split in ("train", "test")
    }
    answers = teacher_answers(task, [n for _, n in images["sft"]])
    sft_rows = [
        {"prompt": [{"role": "user", "content": QUESTION}], "images": [{"bytes": png(image)}], "response": str(answer)}
        for (image, _), answer in zip(images["sft"], answers, strict=True)
    ]
    paths["sft"] = write_rows(sft_rows, out_dir / "sft.parquet")
    return paths


def build_shapes_processor(task: ShapesTask, tokens_per_image: int = 4) -> Any:
    """A local Gemma 3 processor for the task: images resized to `task.image_size`, `tokens_per_image` soft tokens
    each, over a BPE tokenizer learnt from the question and the digits."""
    from hfjax.models.local_tokenizer import build_gemma3_processor

    words = ["user", "assistant", ": ", "\n", QUESTION.replace(IMAGE_MARK, ""), *"0123456789"]
    return build_gemma3_processor(words, 512, task.image_size, tokens_per_image)
