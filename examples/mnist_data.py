"""MNIST for psframe's example: whole splits as normalised tensors.

The data is read from torchvision's raw layout, ``DATA/MNIST/raw``, which
``python scripts/fetch_mnist.py --data_dir DATA`` fills without internet
access beyond the package index. torchvision is optional: when it imports,
``torchvision.datasets.MNIST`` reads the files; otherwise this module parses
the IDX files itself.

Example::

    from mnist_data import load_mnist

    images, labels = load_mnist("data", train=True)  # [60000, 784], [60000]
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

MEAN = 0.1307
STD = 0.3081

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049
ROWS = COLS = 28

_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _torchvision_mnist():
    # The PyPI torchvision wheel can fail to import against a CPU-only torch
    # (RuntimeError, OSError, ...), not only with ImportError.
    try:
        from torchvision.datasets import MNIST
    except Exception:  # noqa: BLE001 - a torchvision built for another torch fails to import in many ways
        return None
    return MNIST


def _read_idx(path: Path, magic: int, dims: int) -> tuple[tuple[int, ...], bytes]:
    data = path.read_bytes()
    header = 4 * (1 + dims)
    if len(data) < header:
        raise ValueError(f"{path} is {len(data)} bytes, too short for an IDX header")
    found, *shape = struct.unpack(f">{1 + dims}I", data[:header])
    if found != magic:
        raise ValueError(f"{path} has magic number {found}, expected {magic}: not an MNIST IDX file")
    body, want = len(data) - header, int(np.prod(shape))
    if body != want:
        raise ValueError(f"{path} holds {body} data bytes, its header {tuple(shape)} says {want}")
    return tuple(shape), data[header:]


def read_idx_images(path: Path) -> np.ndarray:
    """Read an uncompressed IDX3 image file as uint8 [N, 28, 28].

    Raises:
        ValueError: wrong magic number, image size or file length.
    """
    shape, body = _read_idx(Path(path), IMAGES_MAGIC, 3)
    if shape[1:] != (ROWS, COLS):
        raise ValueError(f"{path} holds {shape[1]}x{shape[2]} images, expected {ROWS}x{COLS}")
    return np.frombuffer(body, dtype=np.uint8).reshape(shape)


def read_idx_labels(path: Path) -> np.ndarray:
    """Read an uncompressed IDX1 label file as uint8 [N].

    Raises:
        ValueError: wrong magic number, file length, or a label outside 0..9.
    """
    _shape, body = _read_idx(Path(path), LABELS_MAGIC, 1)
    labels = np.frombuffer(body, dtype=np.uint8)
    if labels.size and labels.max() > 9:
        raise ValueError(f"{path} holds label {labels.max()}, expected digits 0..9")
    return labels


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 28, 28] -> float32 [N, 784], ``(x / 255 - MEAN) / STD``."""
    x = images.reshape(images.shape[0], -1).to(torch.float32) / 255.0
    return (x - MEAN) / STD


def load_mnist(data_dir: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Load one MNIST split into memory.

    Args:
        data_dir: the directory given to ``fetch_mnist.py --data_dir``; the
            files live in ``data_dir/MNIST/raw``.
        train: the 60000-image train split if true, else the 10000-image test split.

    Returns:
        ``(images, labels)``: float32 [N, 784] normalised with MNIST's mean
        and std, and int64 [N] digits.

    Raises:
        FileNotFoundError: the split's files are missing; the message says
            how to fetch them.
        ValueError: a file is not a valid MNIST IDX file.
    """
    raw_dir = Path(data_dir) / "MNIST" / "raw"
    images_path, labels_path = (raw_dir / name for name in _FILES[train])
    missing = [p.name for p in (images_path, labels_path) if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"MNIST files {missing} not found in {raw_dir}; fetch them with "
            f"`python scripts/fetch_mnist.py --data_dir {data_dir}` from the repository root"
        )

    mnist = _torchvision_mnist()
    if mnist is not None:
        dataset = mnist(str(data_dir), train=train, download=False)
        images, labels = dataset.data, dataset.targets
    else:
        # Copies: frombuffer views are read-only, which torch warns about.
        images = torch.from_numpy(read_idx_images(images_path).copy())
        labels = torch.from_numpy(read_idx_labels(labels_path).astype(np.int64))
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{raw_dir} holds {images.shape[0]} images but {labels.shape[0]} labels")
    return normalise(images), labels.to(torch.int64)
