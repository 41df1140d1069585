"""Fixtures of the input-pipeline tests: one generated JPEG folder for the whole package, and its first images
decoded."""

from __future__ import annotations

import pytest
from torchvision.io import decode_jpeg, read_file

from tests.trainer.data.common import samples_of
from trainer.datagen import make_image_folder


@pytest.fixture(scope="package")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    make_image_folder(root, images=72, classes=4, workers=2, progress=False)
    return root / "train"


@pytest.fixture(scope="package")
def decoded(folder):
    return [decode_jpeg(read_file(path)) for path, _ in samples_of(folder)[:24]]
