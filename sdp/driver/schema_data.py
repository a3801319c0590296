"""The typed schema of each dataset of ``conf/dataset/`` (the keyword arguments of its ``_target_``), with ranges.

Why, and how they are applied: as for the models (:mod:`sdp.driver.schema_models`): a dataset node is a
builder's arguments, which no Hydra schema types, so ``dataset.seq_len=0`` used to surface as a reshape error
of the model that reads it. :func:`sdp.driver.typed.check_built` checks the dataset before the model, so a
value a model interpolates from the dataset (``model.max_seq_len: ${dataset.seq_len}``) is named by the key
the user typed. Paths and what depends on the files (``dataset.root``, shards, class folders) are the
builders' own checks (:func:`sdp.data.common.preflight`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sdp.core.fields import Number, flag, key


@dataclass
class ImageArgs:
    """The keys every image dataset reads, which the models read too."""

    num_classes: int = key(at_least=1)
    """Label range."""
    channels: int = key(at_least=1)
    """Image channels."""
    image_size: int = key(at_least=1)
    """Image height = width."""


@dataclass
class DigitsArgs(ImageArgs):
    """``sdp.data.digits.build`` (``dataset=digits``: 10 classes, 1 or 3 channels, the builder checks both)."""

    val_fraction: Number = key(above=0, below=1)
    """Held-out fraction."""
    split_seed: int = key(at_least=0)
    """Permutation seed of the train/val split."""


@dataclass
class SyntheticArgs(ImageArgs):
    """``sdp.data.synthetic.build`` (``dataset=synthetic``, ``synthetic_image``)."""

    num_samples: int = key(at_least=1)
    """Training samples."""
    num_val: int = key(at_least=1)
    """Validation samples."""
    seed: int = key(at_least=0)
    """Data generator seed."""


@dataclass
class GeneratedTextArgs:
    """The keys every generated token dataset reads (``synthetic_text``, ``pointer``, ``automaton``): one
    declaration of each, so a key means the same in all three. A task whose sequences need more room than one token
    (the pointer's program and queries, the automaton's k-token and cells) raises its bound by declaring the field
    again in its own schema, in the same place, with the same meaning."""

    num_samples: int = key(at_least=1)
    """Training sequences."""
    num_val: int = key(at_least=1)
    """Validation sequences."""
    seq_len: int = key(at_least=1)
    """Tokens per sequence."""
    vocab_size: int = key(at_least=1)
    """Token id range."""
    seed: int = key(at_least=0)
    """Generator seed of both sets (independent of the run seed: every run reads the same sequences)."""


@dataclass
class SyntheticTextArgs(GeneratedTextArgs):
    """``sdp.data.synthetic.build_text`` (``dataset=synthetic_text``): the generated keys as they are."""


@dataclass
class CIFARArgs(ImageArgs):
    """``sdp.data.cifar.build`` (``dataset=cifar10``, ``cifar100``)."""

    download: bool = flag()
    """Fetch the official archive into root when files are missing."""
    verify: bool = flag()
    """Check torchvision's MD5 sums."""
    augment: bool = flag()
    """Random crop and horizontal flip on training batches."""
    in_memory_max_mb: Number = key(at_least=0)
    """Size limit of the in-memory tensors for in_memory=auto."""


@dataclass
class ImageNetArgs(ImageArgs):
    """``sdp.data.imagenet.build`` (``dataset=imagenet``)."""


@dataclass
class FineWebArgs:
    """``sdp.data.fineweb.build`` (``dataset=fineweb``)."""

    seq_len: int = key(at_least=1)
    """Context length."""
    vocab_size: int = key(at_least=1)
    """Token id range."""
    val_tokens: int = key(at_least=1)
    """Cap on the validation tokens (>= seq_len: the builder checks it, naming both)."""
    in_memory_max_mb: Number = key(at_least=0)
    """Size limit of the in-memory tensors for in_memory=auto."""
    warn: bool = flag()
    """Also raise the vocabulary warning as a Python warning."""


@dataclass
class StandInArgs:
    """``sdp.data.standin.build`` (``dataset=cpu_standin``)."""

    kind: str = key(choices=("image", "text"))
    """image: sklearn's digits | text: bytes of Python's stdlib source."""
    num_classes: int = key(at_least=1)
    """image: label range."""
    channels: int = key(at_least=1)
    """image: channels."""
    image_size: int = key(at_least=1)
    """image: height = width."""
    vocab_size: int = key(at_least=1)
    """text: token id range (256: bytes)."""
    seq_len: int = key(at_least=1)
    """text: tokens per sequence."""
    text_bytes: int = key(at_least=1)
    """text: corpus size."""
    val_fraction: Number = key(above=0, below=1)
    """text: held-out fraction of the corpus."""


@dataclass
class PointerArgs(GeneratedTextArgs):
    """``sdp.data.pointer.build`` (``dataset=pointer``: pointer chasing; the builder checks the rules of
    several keys: the sequence fits the program and queries, the names are enough, the vocabulary holds them).
    ``seq_len`` and ``vocab_size`` are the generated keys with this task's floors (its program and its token kinds need
    more than one token; the builder checks the exact rule of several keys)."""

    seq_len: int = key(at_least=4)
    """Tokens per sequence."""
    vocab_size: int = key(at_least=4)
    """Token id range (>= names + values + 2)."""
    names: int = key(at_least=2)
    """Name tokens a sequence draws its distinct names from."""
    values: int = key(at_least=2)
    """Digit tokens: a chain's answer."""
    chains: int = key(at_least=1)
    """Chains per sequence."""
    hops: int = key(at_least=1)
    """Bindings per chain: the most lookups a query needs."""
    queries: int = key(at_least=1)
    """Scored queries per sequence."""


@dataclass
class AutomatonArgs(GeneratedTextArgs):
    """``sdp.data.automaton.build`` (``dataset=automaton``: k steps of a causal cellular automaton; the builder
    checks that the vocabulary holds the symbols and the k-tokens). ``seq_len`` and ``vocab_size`` are the generated
    keys with this task's floors: a k-token and one cell; two symbols and one k."""

    seq_len: int = key(at_least=2)
    """Tokens per sequence: the k-token and seq_len - 1 cells."""
    vocab_size: int = key(at_least=3)
    """Token id range (>= symbols + max_steps)."""
    symbols: int = key(at_least=2)
    """Cell alphabet."""
    max_steps: int = key(at_least=1)
    """k is drawn from 1..max_steps per sequence."""
    rule_seed: int = key(at_least=0)
    """Seed of the rule's table."""
    neighbours: int = key(at_least=1, at_most=4)
    """Left neighbours the rule reads (the builder also bounds its table, symbols^neighbours entries)."""
    density: Optional[Number] = key(above=0, at_most=1)
    """Null: a dense table; q: an entry is a nonzero shift with probability q."""


DATASETS: dict[str, type] = {"sdp.data.digits.build": DigitsArgs, "sdp.data.synthetic.build": SyntheticArgs,
                             "sdp.data.synthetic.build_text": SyntheticTextArgs, "sdp.data.cifar.build": CIFARArgs,
                             "sdp.data.imagenet.build": ImageNetArgs, "sdp.data.fineweb.build": FineWebArgs,
                             "sdp.data.standin.build": StandInArgs, "sdp.data.pointer.build": PointerArgs,
                             "sdp.data.automaton.build": AutomatonArgs}
