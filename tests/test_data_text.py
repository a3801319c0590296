"""llm.c token shards (written by hand in the documented format), the loader's windows, bad shards,
sdp-prepare-text, and the synthetic sets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sdp.data import fineweb, prepare_text, synthetic
from sdp.data.fineweb import ShardError


def write_llmc_shard(path: Path, tokens: np.ndarray, *, magic: int = 20240520, version: int = 1, count: int | None = None) -> None:
    """As llm.c's data_common.write_datafile: 256 x int32 header (magic, version, count), uint16 tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    write_llmc_shard(tmp_path / "fineweb_val_000000.bin", np.arange(100) + 1000)
    write_llmc_shard(tmp_path / "fineweb_train_000001.bin", np.arange(50))        # 50 // 9 = 5 windows
    write_llmc_shard(tmp_path / "fineweb_train_000002.bin", np.arange(30) + 500)  # 30 // 9 = 3 windows
    return tmp_path


def test_windows_are_disjoint_within_shards_and_memmapped(shards: Path) -> None:
    bundle = fineweb.build(root=str(shards), seq_len=8, val_tokens=40, in_memory=False)
    assert bundle.task == "lm" and not bundle.in_memory and len(bundle.train) == 8 and len(bundle.val) == 5
    x, y = bundle.train[1]
    assert x.dtype == torch.int64 and x.tolist() == list(range(9, 17)) and y.tolist() == list(range(10, 18))
    x, y = bundle.train[5]  # first window of the second shard: never crosses a shard boundary
    assert x.tolist() == list(range(500, 508)) and y[-1] == 508
    assert bundle.val[4][0][0] == 1000 + 4 * 9
    fast = fineweb.build(root=str(shards), seq_len=8, val_tokens=40)
    assert fast.in_memory
    for i in range(8):
        torch.testing.assert_close(fast.train.tensors[0][i], bundle.train[i][0])
        torch.testing.assert_close(fast.train.tensors[1][i], bundle.train[i][1])


def test_bad_shards_name_the_file_and_the_expectation(shards: Path) -> None:
    bad = shards / "fineweb_train_000003.bin"
    write_llmc_shard(bad, np.arange(20), magic=12345)
    with pytest.raises(ShardError, match=r"fineweb_train_000003\.bin: magic number 12345, expected 20240520"):
        fineweb.build(root=str(shards), seq_len=8, val_tokens=40)
    write_llmc_shard(bad, np.arange(20), version=7)
    with pytest.raises(ShardError, match=r"000003\.bin: version 7, expected 1"):
        fineweb.build(root=str(shards), seq_len=8, val_tokens=40)
    write_llmc_shard(bad, np.arange(20), count=25)
    with pytest.raises(ShardError, match=r"000003\.bin: 1064 bytes, but its header announces 25 tokens.*truncated"):
        fineweb.build(root=str(shards), seq_len=8, val_tokens=40)
    bad.write_bytes(b"\x00" * 10)
    with pytest.raises(ShardError, match=r"000003\.bin: 10 bytes, shorter than the 1024-byte header"):
        fineweb.build(root=str(shards), seq_len=8, val_tokens=40)
    bad.unlink()
    with pytest.raises(ShardError, match=r"000002\.bin: 30 tokens, fewer than dataset\.seq_len \+ 1 = 41"):
        fineweb.build(root=str(shards), seq_len=40, val_tokens=40)
    with pytest.raises(FileNotFoundError, match=r"no shard matches 'other_train_\*\.bin'"):
        fineweb.build(root=str(shards), seq_len=8, val_tokens=40, train_pattern="other_train_*.bin")
    with pytest.raises(FileNotFoundError, match=r"dataset\.root=.*absent"):
        fineweb.build(root=str(shards / "absent"))


def test_prepare_text_writes_shards_the_loader_reads(tmp_path: Path) -> None:
    docs = []
    for i, text in enumerate(["To be, or not to be: that is the question.\n" * 3, "Now is the winter of our discontent.\n" * 4]):
        docs.append(tmp_path / f"doc{i}.txt")
        docs[-1].write_text(text)
    out = tmp_path / "shards"
    prepare_text.main([str(d) for d in docs] + ["--out", str(out), "--tokenizer", "bytes", "--val-tokens", "40",
                                                 "--shard-tokens", "100"])
    rec = json.loads((out / "tokenizer.json").read_text())
    assert rec["tokenizer"] == "bytes" and rec["vocab_size"] == 256
    names = sorted(p.name for p in out.glob("*.bin"))
    assert names == ["fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_train_000003.bin", "fineweb_val_000000.bin"]
    stream = np.concatenate([np.fromfile(out / n, dtype=np.uint16, offset=1024) for n in sorted(names, key=lambda n: n[-10:])])
    expected = b"".join(b"\x00" + d.read_bytes() for d in docs)
    assert bytes(stream.astype(np.uint8)) == expected
    with pytest.raises(ValueError, match=r"dataset\.vocab_size=100 is smaller than the bytes tokenizer's 256"):
        fineweb.build(root=str(out), seq_len=8, val_tokens=16, vocab_size=100)
    with pytest.warns(UserWarning, match=r"dataset\.vocab_size=50257 is 196x what the data needs \(256: the bytes tokenizer"):
        bundle = fineweb.build(root=str(out), seq_len=8, val_tokens=16, vocab_size=50257, warn=True)
    assert "set dataset.vocab_size=256" in bundle.notes[0]
    assert bytes(bundle.val[0][0].numpy().astype(np.uint8)) == expected[:8]
    near = fineweb.build(root=str(out), seq_len=8, val_tokens=16, vocab_size=300)
    assert near.notes == (f"shards in {out} use the bytes tokenizer (256 ids); dataset.vocab_size=300 leaves 44 "
                          "embedding rows unused",)


def test_val_split_defaults_to_what_the_val_shards_hold_capped_by_val_tokens(shards: Path) -> None:
    capped = fineweb.build(root=str(shards), seq_len=8, val_tokens=40, vocab_size=1100)
    assert len(capped.val) == 5 and capped.notes == ()  # 40 // 8 windows of the 11 the val shard holds
    whole = fineweb.build(root=str(shards), seq_len=8, val_tokens=400, vocab_size=1100)
    assert len(whole.val) == 11  # 100 tokens // 9 = 11 windows, fewer than 400 // 8 = 50
    assert whole.notes == ("validation: all 11 windows of the val shards (88 target tokens), fewer than "
                           "dataset.val_tokens=400 would allow (50 windows)",)


def test_vocab_size_is_checked_against_the_largest_token_id(shards: Path) -> None:
    # No tokenizer.json: what the data needs is the largest id of the 5 val windows used (1044) + 1.
    with pytest.raises(ValueError, match=r"dataset\.vocab_size=1044 is too small: .* hold token id 1044; set "
                                         r"dataset\.vocab_size to at least 1045"):
        fineweb.build(root=str(shards), seq_len=8, val_tokens=40, vocab_size=1044)
    with pytest.warns(UserWarning, match=r"dataset\.vocab_size=50257 is 48x what the data needs \(1045: the largest "
                                         r"token id of the val windows is 1044"):
        fineweb.preflight(root=str(shards), seq_len=8, val_tokens=40, vocab_size=50257)
    assert fineweb.build(root=str(shards), seq_len=8, val_tokens=40, vocab_size=2089).notes == ()
    # A training id beyond the range fails where it is read (memory-mapped) or loaded (in memory), named.
    write_llmc_shard(shards / "fineweb_train_000003.bin", np.arange(18) + 1990)
    lazy = fineweb.build(root=str(shards), seq_len=8, val_tokens=40, vocab_size=1100, in_memory=False)
    assert len(lazy.train) == 10 and lazy.train[7][0][0] == 518  # windows of the first shards read as before
    with pytest.raises(ShardError, match=r"000003\.bin holds token id 1998, but dataset\.vocab_size=1100 only has ids "
                                         r"< 1100; set dataset\.vocab_size to at least 1999"):
        lazy.train[8]
    with pytest.raises(ShardError, match=r"000003\.bin holds token id 2007, but dataset\.vocab_size=1100"):
        fineweb.build(root=str(shards), seq_len=8, val_tokens=40, vocab_size=1100, in_memory=True)


def test_prepare_text_auto_falls_back_to_bytes_offline_or_uses_gpt2(tmp_path: Path) -> None:
    name, encode, vocab, eot = prepare_text.load_tokenizer("auto")
    assert (name, vocab, eot) in {("bytes", 256, 0), ("gpt2", 50257, 50256)}
    assert len(encode("hello world")) >= 2


def test_synthetic_text_is_shifted_and_seeded() -> None:
    a, b = synthetic.build_text(num_samples=8, num_val=4, seq_len=5, vocab_size=11), synthetic.build_text(num_samples=8, num_val=4, seq_len=5, vocab_size=11)
    x, y = a.train.tensors
    assert tuple(x.shape) == (8, 5) and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 11
    assert torch.equal(x, b.train.tensors[0]) and a.task == "lm" and a.in_memory
