"""qwenkit.data.images: the grid predicted from an image's size is the image processor's, and image entries
(relative, absolute, under data.image_dir, bytes) read to the same pixels."""

import base64
import json

import pytest
from conftest import make_cfg
from PIL import Image

from data.test_pipeline import ROW, assert_same_samples, write_two_image_set
from qwenkit.data import read_dataset
from qwenkit.data.images import predict_grid
from qwenkit.model.processor import Processor


@pytest.mark.parametrize("bounds", [(56 * 56, 112 * 112), (56 * 56, 28 * 28 * 256), (128 * 128, 200 * 200)])
def test_predicted_grid_equals_the_image_processor(tiny_path, bounds):
    processor = Processor.from_pretrained(tiny_path, min_pixels=bounds[0], max_pixels=bounds[1])
    for size in [(28, 28), (29, 57), (300, 168), (1000, 30), (640, 480), (13, 400), (511, 512)]:
        out = processor.image_processor(images=[Image.new("RGB", size)], return_tensors="pt")
        assert predict_grid(size, processor.image_processor) == tuple(out["image_grid_thw"][0].tolist()), size


def test_image_entries_relative_absolute_image_dir_and_bytes(tmp_path, processor):
    reference = read_dataset(
        make_cfg().data, processor, str(write_two_image_set(tmp_path / "rel", ["img/a.png", "img/b.png"]))
    )[0]
    absolute = tmp_path / "abs"
    path = write_two_image_set(absolute, [str(absolute / "img" / "a.png"), str(absolute / "img" / "b.png")])
    assert_same_samples(reference, read_dataset(make_cfg().data, processor, str(path))[0])

    elsewhere = tmp_path / "json_only"
    elsewhere.mkdir()
    (elsewhere / "data.json").write_text(json.dumps([dict(ROW, images=["a.png", "b.png"])]))
    with_dir = read_dataset(
        make_cfg(image_dir=str(absolute / "img")).data, processor, str(elsewhere / "data.json")
    )[0]
    assert_same_samples(reference, with_dir)

    a, b = ((absolute / "img" / n).read_bytes() for n in ("a.png", "b.png"))
    uri = [f"data:image/png;base64,{base64.b64encode(x).decode()}" for x in (a, b)]
    (elsewhere / "uri.json").write_text(json.dumps([dict(ROW, images=uri)]))
    assert_same_samples(reference, read_dataset(make_cfg().data, processor, str(elsewhere / "uri.json"))[0])
