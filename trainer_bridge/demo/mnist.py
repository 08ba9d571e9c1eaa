"""Synthetic MNIST-format (idx) files, because nothing can be downloaded here.

Each class is a fixed random 28x28 stroke pattern; a sample is its class
pattern, faint (0.4), shifted by up to four pixels, under strong noise, and
one label in twenty is wrong. That is hard enough for the demo's loss to
fall over a few hundred steps, as a real one does, instead of at once, and
the wrong labels keep it from reaching zero. (Measured with the demo's
LeNet5, lr 0.01, batch 32: mean loss 2.30 over steps 1-50, 1.75 at 200,
1.0 at 350, 0.6 at 550.) ``mindspore.dataset.MnistDataset`` reads the
files unchanged.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

IMAGES = "train-images-idx3-ubyte"
LABELS = "train-labels-idx1-ubyte"
# Written last; files without it (an older demo's data) are made again.
VERSION = ".rankwatch-synthetic-v2"
AMPLITUDE, NOISE, MAX_SHIFT, WRONG_LABELS = 0.4, 1.0, 4, 0.05


def _class_patterns(rng: np.random.Generator, classes: int = 10) -> np.ndarray:
    patterns = np.zeros((classes, 28, 28), np.float32)
    for c in range(classes):
        for _ in range(4):  # four thick strokes per class
            r0, c0, r1, c1 = rng.integers(4, 24, size=4)
            for t in np.linspace(0.0, 1.0, 40):
                r, q = int(r0 + (r1 - r0) * t), int(c0 + (c1 - c0) * t)
                patterns[c, r - 1 : r + 2, q - 1 : q + 2] = 1.0
    return patterns


def write_mnist(directory: str | Path, samples: int = 6000, seed: int = 0) -> Path:
    """Write ``samples`` images and labels in idx format into ``directory``.

    Idempotent: existing files with the right sample count are kept, so
    relaunching a demo job does not rewrite its data.
    """
    directory = Path(directory)
    images_path, labels_path = directory / IMAGES, directory / LABELS
    if images_path.exists() and labels_path.exists() and (directory / VERSION).exists():
        with open(labels_path, "rb") as f:
            magic, count = struct.unpack(">II", f.read(8))
        if magic == 2049 and count == samples:
            return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    patterns = _class_patterns(rng)
    labels = rng.integers(0, 10, size=samples).astype(np.uint8)
    shifts = rng.integers(-MAX_SHIFT, MAX_SHIFT + 1, size=(samples, 2))
    noise = rng.random((samples, 28, 28), dtype=np.float32) * NOISE
    images = np.empty((samples, 28, 28), np.uint8)
    for i in range(samples):
        img = np.roll(patterns[labels[i]], tuple(shifts[i]), axis=(0, 1)) * AMPLITUDE + noise[i]
        images[i] = np.clip(img * 255.0, 0, 255).astype(np.uint8)
    wrong = rng.random(samples) < WRONG_LABELS
    labels[wrong] = rng.integers(0, 10, size=int(wrong.sum()))
    # idx format: big-endian magic (0x0803 images, 0x0801 labels) and dims.
    with open(images_path, "wb") as f:
        f.write(struct.pack(">IIII", 2051, samples, 28, 28))
        f.write(images.tobytes())
    with open(labels_path, "wb") as f:
        f.write(struct.pack(">II", 2049, samples))
        f.write(labels.tobytes())
    (directory / VERSION).touch()
    return directory
