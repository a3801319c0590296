"""``sdp-bench depth-probe`` (sdp/bench/depth_probe.py): every depth runs the 8-block model's FLOPs (a shallower
one proportionally more steps), the automaton's targets are the rule applied k times, the RHM's leaves follow its
grammar, a bad setting is refused, and probes.md is rendered from the JSON files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sdp.bench import depth_probe as dp
from sdp.models.llama import LLaMA


def _settings(**kw) -> dict:
    return {**dp.DEFAULTS, **kw}


def test_a_shallower_model_runs_the_8_block_models_flops(tmp_path: Path) -> None:
    assert dp.main(["--name", "tiny", "--out", str(tmp_path), "--set",
                    json.dumps({"data": "rhm", "levels": 3, "pool": 300, "val_seqs": 64, "steps8": 4, "depths": [4, 2]})]) == 0
    out = json.loads((tmp_path / "tiny.json").read_text())
    flops = {d: LLaMA(vocab_size=9, dim=64, n_layers=d, n_heads=4, hidden=176, max_seq_len=8).flops_per_sample()
             for d in (8, 4, 2)}
    for d in (4, 2):
        assert out["depths"][str(d)]["steps"] == round(4 * flops[8] / flops[d]), (d, out["depths"][str(d)], flops)
        assert out["depths"][str(d)]["loss"] > 0
    table = (tmp_path / "probes.md").read_text()
    assert "| tiny | RHM: 3 levels" in table and "– / " in table, table  # no 8-block run: its cells say so


def test_every_automaton_target_is_the_rule_applied_k_times() -> None:
    a = _settings(data="automaton", symbols=5, nb=2, max_steps=4, density=0.5, pool=30, seq_len=12)
    pairs, k, vocab = dp.automaton_pairs(a)
    g = torch.Generator().manual_seed(1234)
    h = torch.randint(1, 5, (5, 5), generator=g) * (torch.rand((5, 5), generator=g) < 0.5)
    assert vocab == 9 and set(k.tolist()) <= set(range(1, 5)), (vocab, k)
    for i in range(len(k)):
        row = pairs[i, 0, 1:].tolist()
        assert int(pairs[i, 0, 0]) == 5 + int(k[i]) - 1 and int(pairs[i, 1, 0]) == dp.IGNORE
        for _ in range(int(k[i])):
            padded = [0, 0, *row]
            row = [(padded[t + 2] + int(h[padded[t], padded[t + 1]])) % 5 for t in range(len(row))]
        assert pairs[i, 1, 1:].tolist() == row, i


def test_rhm_leaves_parse_back_to_one_root_through_the_rules() -> None:
    """Every adjacent pair of leaves is one rule's right-hand side at the level above, up to a single root."""
    a = _settings(data="rhm", v=4, m=2, s=2, levels=3, pool=20)
    pairs, vocab = dp.rhm_pairs(a)
    assert vocab == 5 and pairs.shape == (20, 2, 8) and bool((pairs[:, 0, 0] == 4).all())
    assert torch.equal(pairs[:, 0, 1:], pairs[:, 1, :-1])  # input = [BOS, leaves[:-1]]
    g = torch.Generator().manual_seed(4321)
    rules = []
    for _ in range(3):
        t = torch.randperm(16, generator=g)[:8].view(4, 2)
        rules.append({(int(x) // 4, int(x) % 4): parent for parent in range(4) for x in t[parent]})
    for leaves in pairs[:, 1].tolist():
        level = leaves
        for r in reversed(rules):
            assert all((level[i], level[i + 1]) in r for i in range(0, len(level), 2)), level
            level = [r[(level[i], level[i + 1])] for i in range(0, len(level), 2)]
        assert len(level) == 1


def test_an_unknown_setting_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        dp.main(["--name", "x", "--out", str(tmp_path), "--set", '{"stepz": 3}'])
    assert "stepz" in capsys.readouterr().err


def test_a_recorded_probe_is_never_rewritten(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(SystemExit):
        dp.main(["--name", "x", "--out", str(tmp_path), "--set", '{"steps8": 1}'])
    assert "x.json exists" in capsys.readouterr().err and (tmp_path / "x.json").read_text() == "{}"
