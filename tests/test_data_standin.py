"""scale=cpu's stand-in dataset: images or real text, with every key image and language models read."""

from __future__ import annotations

import pytest
import torch

from sdp.data.standin import build


def test_text_standin_is_real_bytes_in_lm_layout():
    b = build(kind="text", seq_len=32, text_bytes=200_000)
    x, y = b.train.tensors
    assert b.task == "lm" and x.shape[1] == 32 and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 256 and len(b.val) > 0
    assert b"import" in bytes(x[:200].flatten().tolist()), "stand-in text is not Python source"


def test_image_standin_is_digits_at_model_size():
    b = build(kind="image", channels=3, image_size=32)
    assert b.task == "classification" and b.input_shape == (3, 32, 32) and b.num_classes == 10


def test_bad_kind_and_vocab_are_named():
    with pytest.raises(ValueError, match="dataset.kind='audio'"):
        build(kind="audio")
    with pytest.raises(ValueError, match="dataset.vocab_size=50257"):
        build(kind="text", vocab_size=50257)
