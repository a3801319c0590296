"""``sdp-prepare-text``: text files -> llm.c token shards (the format :mod:`sdp.data.fineweb` reads).

Tokenizer: GPT-2 BPE through tiktoken when its encoding can be loaded (tiktoken caches it; on a
machine without network and without a cache it cannot), otherwise raw UTF-8 bytes (vocab 256).
Every document (input file) is preceded by the end-of-text token, as in llm.c's FineWeb script (the
bytes tokenizer uses byte 0, which text files do not contain). The first ``--val-tokens`` tokens of
the stream form the val shard(s), the rest the train shards of at most ``--shard-tokens`` each.
``tokenizer.json`` next to the shards records the tokenizer and its vocabulary size.

    sdp-prepare-text data/*.txt --out shards/ --val-tokens 100000
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from sdp.data.fineweb import TOKENIZER_FILE, write_shard

Encoder = Callable[[str], list[int]]


def load_tokenizer(name: str) -> tuple[str, Encoder, int, int]:
    """(name, encode, vocab_size, end-of-text id); ``auto`` tries GPT-2 and falls back to bytes."""
    if name in ("auto", "gpt2"):
        try:
            import tiktoken

            enc = tiktoken.get_encoding("gpt2")
            return "gpt2", enc.encode_ordinary, enc.n_vocab, enc.eot_token
        except Exception as exc:  # no network and no cached encoding: tiktoken raises connection errors
            if name == "gpt2":
                raise RuntimeError(f"--tokenizer gpt2: tiktoken could not load the GPT-2 encoding ({exc}); "
                                   "use --tokenizer bytes or populate TIKTOKEN_CACHE_DIR") from exc
    if name not in ("auto", "gpt2", "bytes"):
        raise ValueError(f"--tokenizer {name!r} is invalid: allowed auto, gpt2, bytes")
    return "bytes", lambda text: list(text.encode("utf-8")), 256, 0


def token_stream(paths: Iterable[Path], *, encode: Encoder, eot: int) -> Iterator[np.ndarray]:
    for path in paths:
        yield np.asarray([eot] + encode(path.read_text(encoding="utf-8", errors="replace")), dtype=np.int64)


def prepare(
    *, inputs: list[Path], out: Path, tokenizer: str = "auto", val_tokens: int = 100_000,
    shard_tokens: int = 100_000_000, prefix: str = "fineweb",
) -> dict:
    """Write ``{prefix}_val_000000.bin``, ``{prefix}_train_000001.bin``, ... and tokenizer.json; return the record."""
    missing = [str(p) for p in inputs if not p.is_file()]
    if missing or not inputs:
        raise FileNotFoundError(f"input text files not found: {missing or '(none given)'}")
    if val_tokens < 1 or shard_tokens < 1:
        raise ValueError(f"--val-tokens={val_tokens} and --shard-tokens={shard_tokens} must be >= 1")
    name, encode, vocab, eot = load_tokenizer(tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    tokens = np.concatenate(list(token_stream(inputs, encode=encode, eot=eot)))
    if len(tokens) <= val_tokens:
        raise ValueError(f"the inputs hold {len(tokens)} tokens, not more than --val-tokens={val_tokens}")
    shards: list[dict] = []
    splits = [("val", tokens[:val_tokens])] + [
        ("train", tokens[i : i + shard_tokens]) for i in range(val_tokens, len(tokens), shard_tokens)
    ]
    for index, (split, chunk) in enumerate(splits):
        path = out / f"{prefix}_{split}_{index:06d}.bin"
        write_shard(path, chunk)
        shards.append({"file": path.name, "split": split, "tokens": int(len(chunk))})
    record = {"tokenizer": name, "vocab_size": vocab, "eot_token": eot, "total_tokens": int(len(tokens)),
              "sources": [str(p) for p in inputs], "shards": shards}
    (out / TOKENIZER_FILE).write_text(json.dumps(record, indent=1))
    return record


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="sdp-prepare-text", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", type=Path, help="UTF-8 text files, one document each")
    ap.add_argument("--out", type=Path, required=True, help="output folder (dataset.root of dataset=fineweb)")
    ap.add_argument("--tokenizer", default="auto", choices=("auto", "gpt2", "bytes"), help="default: gpt2 if loadable, else bytes")
    ap.add_argument("--val-tokens", type=int, default=100_000, help="tokens of the val shard (the stream's start)")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="maximum tokens per train shard")
    ap.add_argument("--prefix", default="fineweb", help="shard file prefix (fineweb -> fineweb_train_000001.bin)")
    a = ap.parse_args(argv)
    rec = prepare(inputs=a.inputs, out=a.out, tokenizer=a.tokenizer, val_tokens=a.val_tokens,
                  shard_tokens=a.shard_tokens, prefix=a.prefix)
    print(f"{rec['total_tokens']} tokens ({rec['tokenizer']}, vocab {rec['vocab_size']}) -> "
          f"{len(rec['shards'])} shards in {a.out}; use dataset.vocab_size={rec['vocab_size']}", file=sys.stderr)


if __name__ == "__main__":
    main()
