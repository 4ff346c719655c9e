"""Images of multimodal prompt rows (`hfjax.data.images`): verl's encodings decode to the pixels written, bad images
are one-line errors naming file, row and image, and a prompt with `<image>` marks runs through a Gemma 3 processor
(built locally) into the placeholders and pixel values the processor itself makes."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.vision import BOI, EOI, SOFT, build_gemma3_processor, pixels, png

from hfjax.data import DataError, PromptDataset, RowRef, write_rows
from hfjax.data.images import decode_images, image_messages, process_prompt

REF = RowRef("train.parquet", 7)


@pytest.fixture(scope="module")
def processor():
    return build_gemma3_processor()


def test_every_encoding_decodes_to_the_pixels_written(tmp_path: Path) -> None:
    a, b, c = pixels(0), pixels(1, (5, 7, 3)), pixels(2)
    path = tmp_path / "c.png"
    path.write_bytes(png(c))
    gray = io.BytesIO()
    Image.fromarray(a[..., 0]).save(gray, "PNG")
    decoded = decode_images([{"bytes": png(a), "path": "a.png"}, png(b), str(path), gray.getvalue()], REF, 4)
    for image, want in zip(decoded, (a, b, c, np.repeat(a[..., :1], 3, 2)), strict=True):
        assert image.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(image), want)
    assert decode_images(None, REF, 4) == []


@pytest.mark.parametrize(
    ("images", "message"),
    [
        ([png(pixels(0)), {"bytes": b"not an image"}], "train.parquet: row 7: field 'images' image 1: cannot decode"),
        ([{"bytes": b""}], "image 0: a zero-size image (0 bytes)"),
        ([png(pixels(0))] * 3, "3 images, more than max_images 2"),
        ([3.5], "image 0: expected encoded bytes"),
        ("a.png", "field 'images': expected a list of images"),
    ],
)
def test_a_bad_image_is_one_line_naming_file_row_and_image(images, message: str) -> None:
    with pytest.raises(DataError) as caught:
        decode_images(images, REF, 2)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_image_marks_become_image_parts() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "<image>left or<image> right?"}]
    parts, marks = image_messages(messages)
    assert marks == 2 and parts[0] == messages[0]
    assert parts[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "left or"},
        {"type": "image"},
        {"type": "text", "text": " right?"},
    ]


def test_a_prompt_with_images_runs_through_the_checkpoints_processor(processor) -> None:
    images = decode_images([png(pixels(0)), png(pixels(1))], REF, 2)
    messages = [{"role": "user", "content": "<image> and <image>: how many shapes"}]
    text, ids, values = process_prompt(processor, messages, images, REF)
    tokenizer = processor.tokenizer
    soft, boi, eoi = (tokenizer.convert_tokens_to_ids(t) for t in (SOFT, BOI, EOI))
    assert values.shape == (2, 3, 32, 32) and values.dtype == np.float32 and ids.dtype == np.int32
    assert np.sum(ids == soft) == 8 and np.sum(ids == boi) == 2 and np.sum(ids == eoi) == 2
    want = processor(text=[text], images=[images], return_tensors="np")
    np.testing.assert_array_equal(ids, want["input_ids"][0])
    np.testing.assert_array_equal(values, want["pixel_values"])
    _, ids, values = process_prompt(processor, [{"role": "user", "content": "how many"}], [], REF)
    assert values.shape == (0,) and not np.any(ids == soft)
    with pytest.raises(DataError, match="marks 1 images with '<image>' but the row has 2"):
        process_prompt(processor, [{"role": "user", "content": "<image> how many"}], images, REF)


def _row(text: str, images: list) -> dict:
    return {"data_source": "shapes", "prompt": [{"role": "user", "content": text}], "images": images,
            "reward_model": {"ground_truth": "3"}}  # fmt: skip


def test_a_prompt_dataset_with_images_batches_their_pixels(processor, tmp_path: Path) -> None:
    """verl's multimodal parquet (two images, one, none) through `PromptDataset` with the processor: each row's
    ids and pixels are `process_prompt`'s, batches carry [rows, images per row, ...] zero-padded with the counts;
    a bad image names its row, and an over-long prompt with images is not truncated."""
    encoded = [[{"bytes": png(pixels(0))}, {"bytes": png(pixels(1))}], [{"bytes": png(pixels(2))}], []]
    files = write_rows([_row("<image><image> how many", encoded[0]), _row("<image> how many", encoded[1]),
                        _row("how many", encoded[2])], tmp_path / "train.parquet")  # fmt: skip
    data = PromptDataset(files, processor.tokenizer, max_prompt_length=64, processor=processor, max_images=2)
    batch = data.collate([0, 1, 2])
    images, counts = batch.tensors["images"], batch.tensors["image_counts"]
    assert images.shape == (3, 2, 3, 32, 32) and counts.tolist() == [2, 1, 0]
    for i, text in enumerate(["<image><image> how many", "<image> how many", "how many"]):
        ref = RowRef(str(files), i + 1)
        _, ids, values = process_prompt(processor, [{"role": "user", "content": text}],
                                        decode_images(encoded[i], ref, 2), ref)  # fmt: skip
        np.testing.assert_array_equal(data[i].input_ids, ids)
        np.testing.assert_array_equal(images[i, : counts[i]], values.reshape(-1, 3, 32, 32))
        assert not np.any(images[i, counts[i] :])
    assert data.collate([2]).tensors["images"].shape[:2] == (1, 0)  # no images in the batch: text only
    bad = write_rows([_row("<image> how many", [{"bytes": b"junk"}])], tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: row 1: field 'images' image 0: cannot decode"):
        PromptDataset(bad, processor.tokenizer, max_prompt_length=64, processor=processor)
    with pytest.raises(DataError, match=r"row 1: prompt has \d+ tokens with its images"):
        PromptDataset(files, processor.tokenizer, max_prompt_length=12, truncation="left", processor=processor)
