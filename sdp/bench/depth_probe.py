"""``sdp-bench depth-probe``: screen a depth-gate candidate task in one process, before the study's runs.

Why: the depth gate (:mod:`sdp.bench.gate`) runs DDP at 2, 4 and 8 blocks through the real trainer on 4 gloo
ranks, over 5 seeds: an hour or more per task on 2 CPU cores. Most candidates fail it on one seed, so this
screen trains the study's model (:class:`sdp.models.llama.LLaMA`) at each depth in a single process, FLOP-matched
by the model's own count (:meth:`flops_per_sample`: a shallower model runs proportionally more steps), with the
study's optimizer (AdamW, betas 0.9/0.95, weight decay 0.1, linear warm-up, cosine decay to 0.1x), one seed: a
screening figure, plumbing-grade, never a gate verdict. A candidate that looks good here gets an experiment YAML
and the study's gate runs.

Tasks (``data``): ``bytes`` (the stand-in's stdlib text, :func:`sdp.data.standin.stdlib_bytes`), ``bpe`` (the
same text through a byte-level BPE fit on its first half; needs ``pip install tokenizers``), ``automaton`` (a
causal cellular automaton of :mod:`sdp.data.automaton` with ``nb`` left neighbours and a sparse rule of
``density``, drawn from fixed seeds so that the committed figures reproduce) and ``rhm`` (the
random hierarchy model of Cagnetta et al.: the leaves of a random grammar of ``levels`` binary levels, ``v``
symbols, ``m`` rules per symbol). Each run writes ``<out>/<name>.json``; ``--render`` writes ``<out>/probes.md``.

    sdp-bench depth-probe --name auto_nb2_d03 --set '{"data": "automaton", "steps8": 2000, "lr": 0.003}'
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sdp.data.base import IGNORE_INDEX as IGNORE  # the automaton's unscored k-token target

DEFAULTS: dict[str, Any] = dict(
    data="bytes", text_bytes=2_000_000, seq_len=64, tokens=2048, dim=64, hidden=176, heads=4, vocab=256,
    depths=[8, 4, 2], steps8=1000, lr=1e-3, warmup=0, seed=0, val_seqs=1024, symbols=8, nb=2, max_steps=8,
    density=0.3, pool=100_000, v=8, m=4, s=2, levels=6)
OUT = Path("benchmarks/results/cpu-study/lm/depth_probes")


def text_pairs(a: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """``(N, 2, seq_len)`` input/target windows of the stdlib text (bytes or BPE tokens) and the vocabulary."""
    from sdp.data.standin import stdlib_bytes

    t = stdlib_bytes(max_bytes=a["text_bytes"])
    vocab = 256
    if a["data"] == "bpe":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=a["vocab"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        text = bytes(t.to(torch.uint8).tolist()).decode("utf-8", errors="replace")
        tok.train_from_iterator([text[i:i + 100_000] for i in range(0, len(text) // 2, 100_000)], trainer=trainer)
        t, vocab = torch.tensor(tok.encode(text).ids), tok.get_vocab_size()
    n = len(t) // (a["seq_len"] + 1)
    w = t[: n * (a["seq_len"] + 1)].view(n, a["seq_len"] + 1)
    return torch.stack([w[:, :-1], w[:, 1:]], 1), vocab


def automaton_pairs(a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The study's automaton (:func:`sdp.data.automaton.sequences`) with ``seq_len`` cells after the k-token, its
    rule drawn from seed 1234 and its rows from seed 7 (the probes' fixed draw); ``(N, 2, seq_len + 1)`` pairs."""
    from sdp.data.automaton import rule, sequences

    h = rule(symbols=a["symbols"], rule_seed=1234, neighbours=a["nb"], density=a["density"])
    inputs, targets, k = sequences(n=a["pool"], seed=7, seq_len=a["seq_len"] + 1, symbols=a["symbols"],
                                   max_steps=a["max_steps"], h=h)
    return torch.stack([inputs, targets], 1), k, a["symbols"] + a["max_steps"]


def rhm_pairs(a: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Leaves of the random hierarchy model: ``levels`` levels of ``m`` random, unambiguous rules per symbol, each a
    distinct ``s``-tuple of the level below; input ``[BOS, leaves[:-1]]``, target the leaves."""
    v, m, s, N = a["v"], a["m"], a["s"], a["pool"]
    g = torch.Generator().manual_seed(4321)
    rules = []
    for _ in range(a["levels"]):
        tuples = torch.randperm(v ** s, generator=g)[: v * m].view(v, m)
        rules.append(torch.stack([(tuples // v ** (s - 1 - i)) % v for i in range(s)], -1))
    g = torch.Generator().manual_seed(7)
    sym = torch.randint(v, (N, 1), generator=g)
    for r in rules:
        sym = r[sym, torch.randint(m, sym.shape, generator=g)].reshape(N, -1)
    return torch.stack([torch.cat([torch.full((N, 1), v), sym[:, :-1]], 1), sym], 1), v + 1


def probe(a: dict[str, Any]) -> dict[str, Any]:
    """Train every depth FLOP-matched to 8 blocks at ``steps8``; final validation loss (and by k for the automaton)."""
    from sdp.models.llama import LLaMA

    torch.set_num_threads(2)
    ks = None
    if a["data"] == "automaton":
        pairs, k, vocab = automaton_pairs(a)
        ks = k[-a["val_seqs"]:]
    elif a["data"] == "rhm":
        pairs, vocab = rhm_pairs(a)
    else:
        pairs, vocab = text_pairs(a)
    train, val = pairs[:-a["val_seqs"]], pairs[-a["val_seqs"]:]
    length = pairs.shape[-1]
    batch = a["tokens"] // length

    def model(depth: int) -> LLaMA:
        torch.manual_seed(a["seed"])
        return LLaMA(vocab_size=vocab, dim=a["dim"], n_layers=depth, n_heads=a["heads"], hidden=a["hidden"],
                     max_seq_len=length)

    def evaluate(m: LLaMA) -> tuple[float, dict[int, float] | None]:
        m.eval()
        per, total, count = torch.zeros(len(val)), 0.0, 0
        with torch.no_grad():
            for i in range(0, len(val), 128):
                b = val[i:i + 128]
                loss = F.cross_entropy(m(b[:, 0]).transpose(1, 2), b[:, 1], reduction="none", ignore_index=IGNORE)
                scored = (b[:, 1] != IGNORE).sum(1)
                per[i:i + 128] = loss.sum(1) / scored
                total, count = total + loss.sum().item(), count + int(scored.sum())
        m.train()
        by_k = None if ks is None else {int(k): round(per[ks == k].mean().item(), 4) for k in ks.unique()}
        return total / count, by_k

    ref = model(8).flops_per_sample()  # steps8: the 8-block model's steps, the budget every depth matches
    out: dict[str, Any] = {"settings": a, "vocab": vocab, "depths": {}}
    for depth in a["depths"]:
        m = model(depth)
        steps = round(a["steps8"] * ref / m.flops_per_sample())
        warm = math.ceil(a["warmup"] * steps / a["steps8"])
        opt = torch.optim.AdamW(m.parameters(), lr=a["lr"], betas=(0.9, 0.95), weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else
                                                  0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
        g = torch.Generator().manual_seed(a["seed"])
        order, pos, t0, curve = torch.randperm(len(train), generator=g), 0, time.time(), []
        for step in range(steps):
            if pos + batch > len(order):
                order, pos = torch.randperm(len(train), generator=g), 0
            b = train[order[pos:pos + batch]]
            pos += batch
            loss = F.cross_entropy(m(b[:, 0]).transpose(1, 2), b[:, 1], ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if (step + 1) % max(1, steps // 4) == 0:
                curve.append(round(evaluate(m)[0], 4))
        seconds = time.time() - t0
        final, by_k = evaluate(m)
        out["depths"][str(depth)] = {"steps": steps, "epochs": round(steps * batch / len(train), 2),
                                     "train_s": round(seconds), "loss": round(final, 4), "curve": curve, "by_k": by_k}
        print(f"depth {depth}: {steps} steps, {seconds:.0f} s, val {final:.4f}, quarters {curve}, by k {by_k}",
              flush=True)
    return out


def describe(a: dict[str, Any]) -> str:
    """The task of one probe in a few words."""
    if a["data"] == "automaton":
        return (f"automaton: {a['symbols']} symbols, {a['nb']} left neighbour(s), density {a['density']}, "
                f"k = 1..{a['max_steps']}")
    if a["data"] == "rhm":
        return f"RHM: {a['levels']} levels, {a['v']} symbols, {a['m']} rules"
    tok = f"BPE {a['vocab']}" if a["data"] == "bpe" else "bytes"
    return f"text, {a['text_bytes'] / 1e6:g} MB, {tok}"


def render(out: Path) -> str:
    """``probes.md``: one row per committed probe, differences of the final loss between adjacent depths."""
    rows = ["# Depth-gate screening probes (`sdp-bench depth-probe`)", "",
            "One process, one seed per probe (its `seed`: the initial weights and the data order), every depth FLOP-matched to the 8-block model at its `steps8`: screening figures, plumbing-grade, not the "
            "gate's verdict (that is the study report's first section, 5 seeds through the real trainer). Loss: final "
            "validation loss (nats per scored token). Generated from the JSON files next to this one.", "",
            "| probe | task | seed | seq_len | tokens/step | lr | DDP-8 steps | loss 8 / 4 / 2 | D8 − D4 | D4 − D2 | train s 8 / 4 / 2 |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(out.glob("*.json")):
        r = json.loads(path.read_text())
        a, d = r["settings"], r["depths"]

        def cell(key: str, depth: int) -> str:
            return "–" if str(depth) not in d else f"{d[str(depth)][key]}"

        def diff(x: int, y: int) -> str:
            return "–" if str(x) not in d or str(y) not in d else f"{d[str(x)]['loss'] - d[str(y)]['loss']:+.4f}"

        rows.append(f"| {path.stem} | {describe(a)} | {a['seed']} | {a['seq_len']} | {a['tokens']:,} | {a['lr']:g} | {a['steps8']} | "
                    f"{' / '.join(cell('loss', x) for x in (8, 4, 2))} | {diff(8, 4)} | {diff(4, 2)} | "
                    f"{' / '.join(cell('train_s', x) for x in (8, 4, 2))} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sdp-bench depth-probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", help="the probe's name: writes <out>/<name>.json")
    ap.add_argument("--set", default="{}", help=f"JSON object of settings over the defaults {DEFAULTS}")
    ap.add_argument("--out", type=Path, default=OUT, help=f"results folder (default {OUT})")
    ap.add_argument("--render", action="store_true", help="write <out>/probes.md from the JSON files and stop")
    args = ap.parse_args(argv)
    if not args.render:
        settings = json.loads(args.set)
        unknown = sorted(set(settings) - set(DEFAULTS))
        if unknown or not args.name:
            ap.error(f"--set keys {unknown} are not settings (allowed: {sorted(DEFAULTS)})" if unknown
                     else "--name is required unless --render")
        if (args.out / f"{args.name}.json").exists():  # a probe's record is never rewritten by a later probe
            ap.error(f"--name {args.name}: {args.out / f'{args.name}.json'} exists; allowed: a new name")
        result = probe({**DEFAULTS, **settings})
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.out.is_dir():
        (args.out / "probes.md").write_text(render(args.out))
    return 0
