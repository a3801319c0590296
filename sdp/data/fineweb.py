"""FineWeb (or any corpus) as llm.c / modded-nanogpt token shards, memory-mapped.

Shard format (``fineweb_train_*.bin``, ``fineweb_val_*.bin``): a header of 256 little-endian int32
(``[0]`` magic 20240520, ``[1]`` version 1, ``[2]`` token count), then that many uint16 tokens. A
sample is one of the disjoint windows of ``seq_len + 1`` tokens a shard holds (windows never cross a
shard boundary): ``x = window[:-1]``, ``y = window[1:]``. The trainer's step-indexed sampler deals
disjoint samples to ranks. Validation reads the first ``val_tokens // seq_len`` windows of the val
shards, or all of them when they hold fewer (said in the run's notes; ``summary.json`` ``data``
records what was used), so every run on the same files evaluates the same tokens.

Token range: ``sdp-prepare-text`` writes this format and a ``tokenizer.json`` that records the
vocabulary. A ``dataset.vocab_size`` below it, or not above the largest id of the val windows (scanned
at load, cheap) or of any training window (checked as it is read), is refused, naming the key; one
at least :data:`FAR_LARGER` times what the data needs (the recorded vocabulary, else the largest val
id + 1) draws a warning naming both numbers: the embedding and output layer would be mostly rows of
ids that never occur (GPT-2's 50,257 on byte shards costs ~200x the embedding of 256).
"""

from __future__ import annotations

import bisect
import json
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from sdp.data.base import DataBundle
from sdp.data.common import require_dir, use_in_memory

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
HEADER_BYTES = HEADER_INTS * 4
TOKENIZER_FILE = "tokenizer.json"
FAR_LARGER = 2  # a dataset.vocab_size at least this many times what the data needs draws a warning


class ShardError(ValueError):
    """A token shard that is not in the llm.c format, or too short for the requested windows."""


def read_header(path: Path) -> int:
    """Validate ``path``'s header and size; return its token count."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header (256 x int32) of a token shard")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ShardError(f"{path}: magic number {header[0]}, expected {MAGIC} (llm.c / modded-nanogpt token shard)")
    if header[1] != VERSION:
        raise ShardError(f"{path}: version {header[1]}, expected {VERSION} (uint16 tokens)")
    n = int(header[2])
    if size != HEADER_BYTES + 2 * n:
        raise ShardError(
            f"{path}: {size} bytes, but its header announces {n} tokens: expected {HEADER_BYTES} + 2 x {n} = "
            f"{HEADER_BYTES + 2 * n} bytes (truncated or corrupt shard)"
        )
    return n


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """Write ``tokens`` (ids < 65536) as one shard in the llm.c format."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"token ids span [{tokens.min()}, {tokens.max()}]; the shard format stores uint16 (< 65536)")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, tokens.size)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


class TokenWindows(Dataset):
    """Disjoint ``seq_len + 1``-token windows of a list of shards; item i -> (x, y) int64 of length seq_len.

    With ``vocab_size`` every window is checked as it is read (memory-mapped) or loaded (``as_tensors``):
    a token id the model's embedding cannot index fails there, naming the shard and ``dataset.vocab_size``.
    """

    def __init__(self, *, paths: list[Path], seq_len: int, max_windows: int | None = None,
                 vocab_size: int | None = None) -> None:
        self.paths, self.window, self.vocab_size = paths, seq_len + 1, vocab_size
        self.starts = [0]
        for path in paths:
            n = read_header(path)
            if n < self.window:
                raise ShardError(f"{path}: {n} tokens, fewer than dataset.seq_len + 1 = {self.window}; "
                                 "lower dataset.seq_len or write larger shards")
            self.starts.append(self.starts[-1] + n // self.window)
        self.length = self.starts[-1] if max_windows is None else min(max_windows, self.starts[-1])
        self._maps: list[np.memmap] | None = None  # opened lazily: cheap to pickle into DataLoader workers

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.length:
            raise IndexError(f"window {i} out of range [0, {self.length})")
        if self._maps is None:
            self._maps = [np.memmap(p, dtype="<u2", mode="r", offset=HEADER_BYTES) for p in self.paths]
        shard = bisect.bisect_right(self.starts, i) - 1
        off = (i - self.starts[shard]) * self.window
        tokens = self._maps[shard][off : off + self.window]
        self._check(self.paths[shard], tokens)
        buf = torch.from_numpy(tokens.astype(np.int64))
        return buf[:-1], buf[1:]

    def _check(self, path: Path, tokens: np.ndarray) -> None:
        if self.vocab_size is not None and tokens.size and int(tokens.max()) >= self.vocab_size:
            raise ShardError(f"{path} holds token id {int(tokens.max())}, but dataset.vocab_size={self.vocab_size} "
                             f"only has ids < {self.vocab_size}; set dataset.vocab_size to at least {int(tokens.max()) + 1}")

    def shard_tokens(self) -> Iterator[tuple[Path, int, np.ndarray]]:
        """(shard, windows, its memory-mapped tokens of those windows) for every shard this set reads."""
        remaining = self.length
        for path, s0, s1 in zip(self.paths, self.starts, self.starts[1:]):
            n = min(s1 - s0, remaining)
            if n <= 0:
                break
            yield path, n, np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES)[: n * self.window]
            remaining -= n

    def max_token(self) -> int:
        """The largest token id of the windows this set serves (one pass over the memory-mapped shards)."""
        return max(int(tokens.max()) for _, _, tokens in self.shard_tokens())

    def as_tensors(self) -> TensorDataset:
        """The same windows, in the same order, as two (N, seq_len) tensors (the in-memory fast path)."""
        chunks = []
        for path, n, tokens in self.shard_tokens():
            self._check(path, tokens)
            chunks.append(torch.from_numpy(tokens.astype(np.int64)).view(n, self.window))
        w = torch.cat(chunks)
        return TensorDataset(w[:, :-1].contiguous(), w[:, 1:].contiguous())


def find_shards(root: Path, pattern: str) -> list[Path]:
    paths = sorted(root.glob(pattern))
    if not paths:
        raise FileNotFoundError(f"dataset.root={str(root)!r}: no shard matches {pattern!r}; expected llm.c token "
                                "shards (write them with sdp-prepare-text)")
    return paths


def check_vocab(*, vocab_size: int, base: Path, val: TokenWindows) -> tuple[list[str], str | None]:
    """(notes, warning) on ``dataset.vocab_size`` against what the data needs; raise if it is too small.

    Needed: the vocabulary ``tokenizer.json`` records, else the largest id of the val windows + 1 (a
    lower bound: training windows are checked as they are read)."""
    tok_file = base / TOKENIZER_FILE
    tok = json.loads(tok_file.read_text()) if tok_file.is_file() else None
    if tok is not None and vocab_size < tok["vocab_size"]:
        raise ValueError(f"dataset.vocab_size={vocab_size} is smaller than the {tok['tokenizer']} tokenizer's "
                         f"{tok['vocab_size']} ids recorded in {tok_file}; set dataset.vocab_size={tok['vocab_size']}")
    seen = val.max_token()
    if vocab_size <= seen:
        raise ValueError(f"dataset.vocab_size={vocab_size} is too small: the val shards {[p.name for p in val.paths]} "
                         f"hold token id {seen}; set dataset.vocab_size to at least {seen + 1}")
    needed = tok["vocab_size"] if tok is not None else seen + 1
    source = (f"the {tok['tokenizer']} tokenizer's {needed} ids recorded in {tok_file}" if tok is not None else
              f"the largest token id of the val windows is {seen}; no {TOKENIZER_FILE} in {base}")
    if vocab_size >= FAR_LARGER * needed:
        return [], (f"dataset.vocab_size={vocab_size} is {vocab_size / needed:.0f}x what the data needs ({needed}: "
                    f"{source}): {vocab_size - needed} embedding and output rows for ids that never occur; "
                    f"set dataset.vocab_size={needed}")
    if tok is not None and vocab_size > needed:
        return [f"shards in {base} use the {tok['tokenizer']} tokenizer ({needed} ids); "
                f"dataset.vocab_size={vocab_size} leaves {vocab_size - needed} embedding rows unused"], None
    return [], None


def build(
    *, root: str, seq_len: int = 1024, vocab_size: int = 50257, val_tokens: int = 10_485_760,
    train_pattern: str = "fineweb_train_*.bin", val_pattern: str = "fineweb_val_*.bin",
    in_memory: str | bool = "auto", in_memory_max_mb: float = 1024, warn: bool = False,
) -> DataBundle:
    """Train windows from every train shard; the first ``val_tokens // seq_len`` windows of the val shards
    (all of them when they hold fewer). ``warn``: also raise the vocabulary warning as a Python warning
    (the driver's :func:`preflight` does, once, before any rank starts); it is a note of the run either way."""
    if seq_len < 1 or val_tokens < seq_len:
        raise ValueError(f"dataset.seq_len={seq_len} must be >= 1 and dataset.val_tokens={val_tokens} >= seq_len")
    base = require_dir(key="dataset.root", path=root, what="a folder of fineweb_train_*.bin / fineweb_val_*.bin shards")
    train = TokenWindows(paths=find_shards(base, train_pattern), seq_len=seq_len, vocab_size=vocab_size)
    n_val = val_tokens // seq_len
    val = TokenWindows(paths=find_shards(base, val_pattern), seq_len=seq_len, max_windows=n_val, vocab_size=vocab_size)
    notes, warning = check_vocab(vocab_size=vocab_size, base=base, val=val)
    if warning is not None:
        notes.append(warning)
        if warn:
            warnings.warn(warning, stacklevel=2)
    if len(val) < n_val:
        notes.append(f"validation: all {len(val)} windows of the val shards ({len(val) * seq_len} target tokens), fewer "
                     f"than dataset.val_tokens={val_tokens} would allow ({n_val} windows)")
    nbytes = (len(train) + len(val)) * seq_len * 2 * 8
    if use_in_memory(setting=in_memory, nbytes=nbytes, max_mb=in_memory_max_mb):
        train, val = train.as_tensors(), val.as_tensors()  # type: ignore[assignment]
    return DataBundle(train=train, val=val, task="lm", num_classes=vocab_size, input_shape=(seq_len,), notes=tuple(notes))


def preflight(**cfg: object) -> None:
    """Cheap checks before ranks start: every shard header, the windows, the val split and the token range
    (the val windows are read once; train tokens are checked as ranks read them)."""
    build(**{**cfg, "in_memory": False, "warn": True})  # type: ignore[arg-type]
