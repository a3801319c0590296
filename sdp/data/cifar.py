"""CIFAR-10 / CIFAR-100 from the official python-pickle batches (``cifar-10-batches-py/``, ``cifar-100-python/``).

torchvision's ``CIFAR10``/``CIFAR100`` classes name the files, download them (only with
``dataset.download=true``) and check their MD5 sums. Files that differ from the official release (a
subset, files a test or a script wrote) load only with ``dataset.verify=false``: they are then read the
same way torchvision reads them, minus the check, and the run reports it (DataBundle.notes ->
summary.json). Normalisation uses the training split's per-channel mean and std. Training batches
get the standard random crop (padding 4) and horizontal flip: on the in-memory fast path as batch
tensors (deterministic in (seed, step)), otherwise per image in DataLoader workers.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset
from torchvision import transforms
from torchvision.datasets import CIFAR10, CIFAR100
from torchvision.datasets.utils import check_integrity

from sdp.data.base import DataBundle
from sdp.data.common import FlipCrop, require_dir, use_in_memory

CLASSES: dict[int, type[CIFAR10]] = {10: CIFAR10, 100: CIFAR100}


def _files(cls: type[CIFAR10], *, train: bool) -> list[tuple[str, str]]:
    return list(cls.train_list if train else cls.test_list) + [(cls.meta["filename"], cls.meta["md5"])]


def _load_unverified(cls: type[CIFAR10], *, base: Path, train: bool) -> tuple[np.ndarray, np.ndarray]:
    """Read the batches as torchvision does (latin1 pickles, CHW rows -> HWC uint8), without MD5 checks."""
    data, targets = [], []
    for name, _ in cls.train_list if train else cls.test_list:
        path = base / name
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        key = "labels" if "labels" in entry else "fine_labels"
        if "data" not in entry or key not in entry:
            raise ValueError(f"{path}: not a CIFAR batch (keys {sorted(entry)}; expected 'data' and 'labels'/'fine_labels')")
        data.append(np.asarray(entry["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        targets.extend(entry[key])
    return np.vstack(data).transpose((0, 2, 3, 1)), np.asarray(targets, dtype=np.int64)


def load_split(
    cls: type[CIFAR10], *, root: Path, train: bool, download: bool, verify: bool
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(images N x 32 x 32 x 3 uint8, labels, names of files that differ from the official release)."""
    base = root / cls.base_folder
    files = _files(cls, train=train)
    if verify or download:  # torchvision downloads (if asked) and checks every MD5
        try:
            ds = cls(root=str(root), train=train, download=download)
        except RuntimeError as exc:
            bad = [str(base / n) for n, md5 in files if not check_integrity(str(base / n), md5)]
            raise ValueError(
                f"{cls.__name__} files differ from the official release (MD5 mismatch): {', '.join(bad)}; "
                "to load a subset or files you wrote yourself set dataset.verify=false"
            ) from exc
        return ds.data, np.asarray(ds.targets, dtype=np.int64), []
    with open(base / cls.meta["filename"], "rb") as f:
        meta = pickle.load(f, encoding="latin1")
    if cls.meta["key"] not in meta:
        raise ValueError(f"{base / cls.meta['filename']}: no {cls.meta['key']!r} entry (keys {sorted(meta)})")
    data, targets = _load_unverified(cls, base=base, train=train)
    differ = [n for n, md5 in files if not check_integrity(str(base / n), md5)]
    return data, targets, differ


def preflight(
    *, root: str, num_classes: int = 10, channels: int = 3, image_size: int = 32, download: bool = False, **_: object
) -> tuple[type[CIFAR10], Path]:
    """Cheap checks (run by the driver before ranks start, and by ``build``): keys, root, every file present."""
    if num_classes not in CLASSES:
        raise ValueError(f"dataset.num_classes={num_classes} is invalid: 10 (CIFAR-10) or 100 (CIFAR-100)")
    if channels != 3 or image_size != 32:
        raise ValueError(f"dataset.channels={channels}, dataset.image_size={image_size}: CIFAR images are 3 x 32 x 32")
    cls = CLASSES[num_classes]
    if download:
        return cls, Path(root).expanduser()
    path = require_dir(key="dataset.root", path=root, what=f"a folder holding {cls.base_folder}/ (the python-pickle batches)")
    base = path / cls.base_folder
    files = [n for n, _ in _files(cls, train=True) + _files(cls, train=False)[:-1]]
    missing = [n for n in files if not (base / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{cls.__name__} under dataset.root={str(root)!r}: missing {', '.join(str(base / n) for n in missing)}; "
            f"expected the python-pickle batches {files} in {base} (set dataset.download=true to fetch the official files)"
        )
    return cls, path


class ArrayImages(Dataset):
    """uint8 HWC images + labels with a torchvision transform (the DataLoader path)."""

    def __init__(self, *, data: np.ndarray, targets: np.ndarray, transform: transforms.Compose) -> None:
        self.data, self.targets, self.transform = data, torch.as_tensor(targets), transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        return self.transform(Image.fromarray(self.data[i])), self.targets[i]


def build(
    *, root: str, num_classes: int = 10, channels: int = 3, image_size: int = 32, download: bool = False,
    verify: bool = True, augment: bool = True, in_memory: str | bool = "auto", in_memory_max_mb: float = 2048,
) -> DataBundle:
    """CIFAR-10 (``num_classes=10``) or CIFAR-100 (``num_classes=100``) under ``root``."""
    cls, path = preflight(root=root, num_classes=num_classes, channels=channels, image_size=image_size, download=download)
    x_tr, y_tr, bad_tr = load_split(cls, root=path, train=True, download=download, verify=verify)
    x_va, y_va, bad_va = load_split(cls, root=path, train=False, download=download, verify=verify)
    for split, y in (("train", y_tr), ("test", y_va)):
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise ValueError(f"{cls.__name__} {split} labels span [{y.min()}, {y.max()}], expected 0..{num_classes - 1}")
    notes: tuple[str, ...] = ()
    if not verify:
        bad = sorted(set(bad_tr + bad_va))
        notes = (f"dataset.verify=false: {cls.__name__} files under {path / cls.base_folder} loaded without the MD5 check; "
                 f"{len(bad)} differ from the official release{': ' + ', '.join(bad) if bad else ''}",)
    pixels = torch.from_numpy(x_tr).float().div_(255)
    mean, std = pixels.mean(dim=(0, 1, 2)), pixels.std(dim=(0, 1, 2))
    nbytes = (len(x_tr) + len(x_va)) * 3 * 32 * 32 * 4
    common = dict(task="classification", num_classes=num_classes, input_shape=(3, 32, 32), notes=notes)
    if use_in_memory(setting=in_memory, nbytes=nbytes, max_mb=in_memory_max_mb):
        def tensor(x: np.ndarray) -> torch.Tensor:
            t = torch.from_numpy(x).permute(0, 3, 1, 2).float().div_(255)
            return ((t - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)).contiguous()

        aug = FlipCrop(padding=4, fill=-mean / std) if augment else None
        return DataBundle(train=TensorDataset(tensor(x_tr), torch.from_numpy(y_tr)),
                          val=TensorDataset(tensor(x_va), torch.from_numpy(y_va)), augment=aug, **common)
    norm = [transforms.ToTensor(), transforms.Normalize(mean.tolist(), std.tolist())]
    train_tf = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if augment else []
    return DataBundle(
        train=ArrayImages(data=x_tr, targets=y_tr, transform=transforms.Compose(train_tf + norm)),
        val=ArrayImages(data=x_va, targets=y_va, transform=transforms.Compose(norm)), **common,
    )


def write_batches(*, root: Path, num_classes: int, train: tuple[np.ndarray, np.ndarray],
                  test: tuple[np.ndarray, np.ndarray], label_names: list[str]) -> Path:
    """Write images (N x 32 x 32 x 3 uint8) and labels as the official python-pickle batches under ``root``.

    For turning other images into CIFAR-format files (scripts/build_real_data.py); they load with
    ``dataset.verify=false`` since their MD5 sums are not the official ones.
    """
    cls = CLASSES[num_classes]
    base = Path(root) / cls.base_folder
    base.mkdir(parents=True, exist_ok=True)
    label_key = "labels" if num_classes == 10 else "fine_labels"
    train_files = [name for name, _ in cls.train_list]
    chunks = np.array_split(np.arange(len(train[0])), len(train_files))
    for name, (x, y), idx in [(n, train, c) for n, c in zip(train_files, chunks)] + [(cls.test_list[0][0], test, None)]:
        idx = np.arange(len(x)) if idx is None else idx
        entry = {"batch_label": name, label_key: [int(v) for v in y[idx]],
                 "data": np.ascontiguousarray(x[idx].transpose(0, 3, 1, 2)).reshape(len(idx), -1),
                 "filenames": [f"{name}_{i}.png" for i in idx]}
        with open(base / name, "wb") as f:
            pickle.dump(entry, f)
    with open(base / cls.meta["filename"], "wb") as f:
        pickle.dump({cls.meta["key"]: label_names}, f)
    return base
