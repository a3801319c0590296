"""CIFAR pickles and ImageFolder trees written by the test in the real on-disk formats."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import CIFAR10, CIFAR100
from torchvision.datasets import cifar as tv_cifar

from sdp.data import cifar, imagenet
from sdp.data.base import DataBundle, GlobalBatchSampler, train_batches
from sdp.data.common import FlipCrop


def write_cifar10_by_hand(root: Path, *, per_batch: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The official layout: latin1-readable pickles of dicts with 'data' (N x 3072, CHW rows) and 'labels'."""
    rng = np.random.default_rng(seed)
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    images, labels = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        y = rng.integers(0, 10, per_batch).tolist()
        with open(base / name, "wb") as f:
            pickle.dump({"batch_label": name, "labels": y, "data": x, "filenames": [f"{i}.png" for i in range(per_batch)]}, f)
        images.append(x)
        labels.append(y)
    with open(base / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)], "num_vis": 3072}, f)
    return np.vstack(images), np.concatenate(labels)


def test_cifar10_unverified_matches_torchvision_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw, labels = write_cifar10_by_hand(tmp_path)
    x, y, differ = cifar.load_split(CIFAR10, root=tmp_path, train=True, download=False, verify=False)
    assert x.shape == (30, 32, 32, 3) and len(differ) == 6  # 5 batches + batches.meta
    np.testing.assert_array_equal(x.transpose(0, 3, 1, 2).reshape(30, -1), raw[:30])
    np.testing.assert_array_equal(y, labels[:30])
    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *a, **k: True)  # torchvision's own reader, MD5 skipped
    tv = CIFAR10(root=str(tmp_path), train=False)
    xt, yt, _ = cifar.load_split(CIFAR10, root=tmp_path, train=False, download=False, verify=False)
    np.testing.assert_array_equal(tv.data, xt)
    assert tv.targets == yt.tolist() and tv.classes == [f"c{i}" for i in range(10)]


def test_cifar10_verify_rejects_unofficial_files_and_false_reports_them(tmp_path: Path) -> None:
    write_cifar10_by_hand(tmp_path)
    with pytest.raises(ValueError, match=r"data_batch_1.*dataset\.verify=false"):
        cifar.build(root=str(tmp_path))
    bundle = cifar.build(root=str(tmp_path), verify=False)
    assert bundle.notes and "dataset.verify=false" in bundle.notes[0] and "7 differ" in bundle.notes[0]
    assert bundle.in_memory and len(bundle.train) == 30 and len(bundle.val) == 6
    x, _ = bundle.train.tensors
    torch.testing.assert_close(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-4, rtol=0)  # train-split normalisation
    slow = cifar.build(root=str(tmp_path), verify=False, in_memory=False, augment=False)
    assert not slow.in_memory
    torch.testing.assert_close(slow.val[3][0], bundle.val.tensors[0][3])
    assert int(slow.val[3][1]) == int(bundle.val.tensors[1][3])


def test_cifar100_written_by_helper_loads_with_fine_labels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
    y = rng.integers(0, 100, 40)
    cifar.write_batches(root=tmp_path, num_classes=100, train=(x[:30], y[:30]), test=(x[30:], y[30:]),
                        label_names=[f"f{i}" for i in range(100)])
    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *a, **k: True)
    tv = CIFAR100(root=str(tmp_path), train=True)
    np.testing.assert_array_equal(tv.data, x[:30])
    assert tv.targets == y[:30].tolist()
    bundle = cifar.build(root=str(tmp_path), num_classes=100, verify=False)
    assert bundle.num_classes == 100 and len(bundle.train) == 30


def test_cifar_bad_inputs_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"dataset\.root=.*nope.*no such directory"):
        cifar.build(root=str(tmp_path / "nope"))
    write_cifar10_by_hand(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing .*data_batch_3.*download=true"):
        cifar.build(root=str(tmp_path), verify=False)
    with pytest.raises(ValueError, match=r"num_classes=7"):
        cifar.build(root=str(tmp_path), num_classes=7)


def test_flipcrop_is_a_shifted_window_with_fill_and_flip() -> None:
    aug = FlipCrop(padding=2, fill=torch.tensor([-1.0, -2.0]))
    x = torch.arange(2 * 2 * 4 * 4, dtype=torch.float32).view(2, 2, 4, 4)
    params = torch.tensor([[2, 2, 0], [0, 2, 1]])  # centre/no flip; shifted up 2 rows, flipped
    out = aug.apply(x, params)
    torch.testing.assert_close(out[0], x[0])
    expected = torch.cat((torch.tensor([-1.0, -2.0]).view(2, 1, 1).expand(2, 2, 4), x[1, :, :2]), dim=1).flip(-1)
    torch.testing.assert_close(out[1], expected)


def test_in_memory_augmentation_does_not_depend_on_the_replica_split() -> None:
    x = torch.randn(16, 3, 8, 8)
    bundle = DataBundle(train=torch.utils.data.TensorDataset(x, torch.arange(16)), val=torch.utils.data.TensorDataset(x, torch.arange(16)),
                        task="classification", num_classes=16, input_shape=(3, 8, 8), augment=FlipCrop(padding=2, fill=torch.zeros(3)))
    sampler = GlobalBatchSampler(num_samples=16, global_batch=8, seed=3)
    whole = list(train_batches(bundle, sampler=sampler, start=0, stop=3, replica=0, replicas=1))
    halves = [list(train_batches(bundle, sampler=sampler, start=0, stop=3, replica=r, replicas=2)) for r in (0, 1)]
    for step in range(3):
        torch.testing.assert_close(torch.cat((halves[0][step][0], halves[1][step][0])), whole[step][0])
    assert not torch.equal(whole[0][0], x[whole[0][1]]), "augmentation did nothing"


def write_image_folder(root: Path, *, classes: dict[str, int], splits: tuple[str, ...] = ("train", "val")) -> None:
    rng = np.random.default_rng(0)
    for split in splits:
        for k, (name, n) in enumerate(classes.items()):
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                img = Image.fromarray(rng.integers(0, 256, (20 + i, 24, 3), dtype=np.uint8))
                img.save(root / split / name / (f"{i}.JPEG" if (i + k) % 2 else f"{i}.png"))


def test_image_folder_loads_png_and_jpeg_with_standard_transforms(tmp_path: Path) -> None:
    write_image_folder(tmp_path, classes={"cat": 3, "dog": 2})
    bundle = imagenet.build(root=str(tmp_path), num_classes=2, image_size=16)
    assert len(bundle.train) == 5 and len(bundle.val) == 5 and not bundle.in_memory
    x, y = bundle.train[4]
    assert tuple(x.shape) == (3, 16, 16) and y == 1
    xv, _ = bundle.val[0]
    assert tuple(xv.shape) == (3, 16, 16)
    torch.testing.assert_close(bundle.val[0][0], xv)  # evaluation transform is deterministic


def test_image_folder_bad_inputs_name_the_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"dataset\.root"):
        imagenet.build(root=str(tmp_path / "missing"))
    write_image_folder(tmp_path, classes={"cat": 2, "dog": 1}, splits=("train",))
    with pytest.raises(FileNotFoundError, match=r"dataset\.val_dir.*val"):
        imagenet.build(root=str(tmp_path), num_classes=2)
    write_image_folder(tmp_path, classes={"cat": 1, "dog": 1}, splits=("val",))
    with pytest.raises(ValueError, match=r"num_classes=3 .* 2 class folders"):
        imagenet.build(root=str(tmp_path), num_classes=3)
    (tmp_path / "train" / "empty").mkdir()
    (tmp_path / "train" / "empty" / "notes.txt").write_text("not an image")
    with pytest.raises(FileNotFoundError, match=r"train/empty: empty class folder"):
        imagenet.build(root=str(tmp_path), num_classes=3)


@pytest.mark.parametrize(("model", "dataset"), [("resnet18_cifar", "cifar10"), ("resnet18_cifar", "cifar100"),
                                                ("resnet18", "imagenet"), ("llama_tiny", "fineweb")])
def test_driver_preflight_rejects_a_missing_root_before_any_rank(tmp_path: Path, model: str, dataset: str) -> None:
    from sdp.driver.config import validate
    from tests.hydra_cfg import compose_config

    cfg = compose_config(f"model={model}", f"dataset={dataset}", f"dataset.root={tmp_path}/none")
    with pytest.raises(FileNotFoundError, match=r"dataset\.root=.*none.*no such directory"):
        validate(cfg)
