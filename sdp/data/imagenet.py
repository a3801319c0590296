"""ImageNet (or any image-classification folder tree) in torchvision's ``ImageFolder`` layout.

``root/train/<class>/*.JPEG`` and ``root/val/<class>/*.JPEG`` (val sorted into class folders, as the
usual ``valprep.sh`` does). Training: RandomResizedCrop(image_size) + horizontal flip; evaluation:
Resize(image_size * 256 / 224) + CenterCrop(image_size); both normalised with the ImageNet channel
statistics. Images are decoded in DataLoader workers (``train.num_workers``), never held in memory.
Both splits are checked first so a missing split, an empty class folder or a class present in only
one split fails with the folder named, not with a mid-run label error.
"""

from __future__ import annotations

from pathlib import Path

from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from sdp.data.base import DataBundle
from sdp.data.common import require_dir

# The channel statistics of the ImageNet-1k training set (torchvision's reference recipes).
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def check_split(split_dir: Path) -> list[str]:
    """Class names of ``split_dir``; raises naming the folder if a split or class folder is empty."""
    classes = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
    if not classes:
        raise FileNotFoundError(f"{split_dir}: no class folders; expected {split_dir}/<class>/<image> (ImageFolder layout)")
    for name in classes:
        if not any(f.is_file() and f.name.lower().endswith(IMG_EXTENSIONS) for f in (split_dir / name).rglob("*")):
            raise FileNotFoundError(f"{split_dir / name}: empty class folder; expected images with extensions "
                                    f"{', '.join(IMG_EXTENSIONS)}")
    return classes


def preflight(*, root: str, channels: int = 3, train_dir: str = "train", val_dir: str = "val", **_: object) -> dict[str, Path]:
    """Cheap checks before ranks start (no walk over the images): keys, root and both split folders."""
    if channels != 3:
        raise ValueError(f"dataset.channels={channels}: ImageFolder images are decoded as RGB (3 channels)")
    base = require_dir(key="dataset.root", path=root, what=f"an ImageFolder tree with {train_dir}/ and {val_dir}/")
    return {sub: require_dir(key=key, path=base / sub, what=f"{base / sub}/<class>/<image> (ImageFolder layout)")
            for key, sub in (("dataset.train_dir", train_dir), ("dataset.val_dir", val_dir))}


def build(
    *, root: str, num_classes: int = 1000, channels: int = 3, image_size: int = 224, train_dir: str = "train",
    val_dir: str = "val",
) -> DataBundle:
    """Train and val ImageFolders under ``root`` with the standard augmentation."""
    dirs = preflight(root=root, channels=channels, train_dir=train_dir, val_dir=val_dir)
    train_classes, val_classes = check_split(dirs[train_dir]), check_split(dirs[val_dir])
    if train_classes != val_classes:
        only = sorted(set(train_classes) ^ set(val_classes))
        raise ValueError(f"class folders of {dirs[train_dir]} and {dirs[val_dir]} differ: {only[:10]} in only one split")
    if len(train_classes) != num_classes:
        raise ValueError(f"dataset.num_classes={num_classes} but {dirs[train_dir]} has {len(train_classes)} class folders")
    norm = transforms.Normalize(MEAN, STD)
    train_tf = transforms.Compose([transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(round(image_size * 256 / 224)), transforms.CenterCrop(image_size),
                                 transforms.ToTensor(), norm])
    return DataBundle(
        train=ImageFolder(str(dirs[train_dir]), transform=train_tf),
        val=ImageFolder(str(dirs[val_dir]), transform=val_tf),
        task="classification", num_classes=num_classes, input_shape=(3, image_size, image_size),
    )
