"""CPU-scale stand-in data for ``scale=cpu``: real data that needs no download, for image or text models.

Why one dataset for both: ``scale=cpu`` replaces any experiment's dataset without knowing its model, and
a model reads its input sizes from the dataset, so the stand-in exposes every key an image or a language
model interpolates and picks its content from ``kind`` (``image``: the bundled digits; ``text``: bytes of
the Python standard library's own source files, a real, learnable corpus present on every machine with
Python, deterministic for a given Python version). An experiment of language models sets the top-level
key ``stand_in: text``.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from sdp.data import digits
from sdp.data.base import DataBundle


def stdlib_bytes(*, max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the standard library's ``*.py`` files in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < max_bytes:
        raise ValueError(f"dataset.text_bytes={max_bytes}: the standard library at {root} holds only {len(blob)} bytes")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


def text_bundle(*, seq_len: int, text_bytes: int, val_fraction: float) -> DataBundle:
    """Disjoint windows of ``seq_len + 1`` bytes; the last ``val_fraction`` of the corpus is validation."""
    tokens = stdlib_bytes(max_bytes=text_bytes)
    n_val = int(len(tokens) * val_fraction)

    def windows(t: torch.Tensor) -> TensorDataset:
        n = len(t) // (seq_len + 1)
        w = t[: n * (seq_len + 1)].view(n, seq_len + 1)
        return TensorDataset(w[:, :-1].contiguous(), w[:, 1:].contiguous())

    return DataBundle(train=windows(tokens[:-n_val]), val=windows(tokens[-n_val:]), task="lm",
                      num_classes=256, input_shape=(seq_len,),
                      notes=(f"scale=cpu text stand-in: {text_bytes} bytes of Python stdlib source, vocab 256",))


def build(
    *, kind: str, num_classes: int = 10, channels: int = 1, image_size: int = 16, vocab_size: int = 256,
    seq_len: int = 64, text_bytes: int = 2_000_000, val_fraction: float = 0.1,
) -> DataBundle:
    if kind == "image":
        return digits.build(image_size=image_size, channels=channels, num_classes=num_classes, val_fraction=0.2)
    if kind == "text":
        if vocab_size != 256:
            raise ValueError(f"dataset.vocab_size={vocab_size} is invalid: the text stand-in is bytes (vocab 256)")
        return text_bundle(seq_len=seq_len, text_bytes=text_bytes, val_fraction=val_fraction)
    raise ValueError(f"dataset.kind={kind!r} is invalid: allowed image, text (set top-level stand_in: text for LMs)")
