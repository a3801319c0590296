"""The depth gate of the CPU LM study (sdp/bench/gate.py, issue 38 item 1): the PASS / FAIL / not resolved rule on
paired differences, the gate read from run directories written by hand (the study's own task giving the study's DDP
rows at every depth; the text task taking its depth-8 runs from its record study's main sweep), its stages, and its
place first in the study's REPORT.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sdp.bench.gate import DEPTHS, GATES, MARGIN, collect_gates, gate_section, gate_stages, gate_verdict
from sdp.bench.verdicts import write_report
from sdp.report.stats import Paired
from tests.test_report_study import DDP, run_dir, study  # noqa: F401 - study: the fixture of a whole fake study

TASK = GATES["lm"]["task"]
ELSEWHERE = GATES["lm"]["elsewhere"]


@pytest.mark.parametrize("deep,mid,n,expected", [
    (Paired(-0.08, 0.02, 5), Paired(-0.05, 0.01, 5), 5, "PASS"),
    (Paired(-0.08, 0.02, 3), Paired(-0.05, 0.01, 3), 3, "screening pass (3 seeds; 5 needed for PASS)"),
    (Paired(-0.01, 0.02, 5), Paired(-0.05, 0.01, 5), 5, "FAIL (DDP-8 − DDP-4 interval above −0.05)"),
    (Paired(-0.08, 0.02, 3), Paired(0.03, 0.01, 3), 3,
     "FAIL (DDP-4 − DDP-2 interval above 0) (screening: 3 of 5 seeds at every depth)"),
    (Paired(0.12, 0.096, 2), Paired(-0.003, None, 1), 1,  # a resolved miss with a depth still at one seed
     "FAIL (DDP-8 − DDP-4 interval above −0.05) (screening: 1 of 5 seeds at every depth)"),
    (Paired(-0.04, 0.03, 5), Paired(-0.05, 0.01, 5), 5, "not resolved"),  # gain may reach the margin, below it on average
    (Paired(-0.08, 0.10, 5), Paired(-0.05, 0.01, 5), 5, "not resolved"),  # interval contains 0
    (Paired(-0.08, None, 1), Paired(-0.05, None, 1), 1,
     "not resolved (DDP-8 − DDP-4: 1 paired seed; DDP-4 − DDP-2: 1 paired seed) (screening: 1 of 5 seeds at every depth)"),
    (Paired(-0.056, 0.086, 5), Paired(-0.18, None, 1), 1,  # five seeds at 8 and 4 blocks, one at 2
     "not resolved (DDP-4 − DDP-2: 1 paired seed) (screening: 1 of 5 seeds at every depth)"),
])
def test_gate_verdict(deep: Paired, mid: Paired, n: int, expected: str) -> None:
    assert gate_verdict(deep=deep, mid=mid, n=n) == expected


def gate_run(root: Path, *, seed: int, blocks: int, loss: float, reference: bool = True) -> None:
    """One DDP run at ``blocks`` blocks (FLOP-matched to 8 when ``reference``) with the settings the gate reads."""
    run_dir(root, 0, seed=seed, par=DDP, losses=[loss + 1.0, loss], steps=100 * 8 // blocks, flops_per_step=10.0 * blocks / 8,
            n_layers=blocks)
    path = root / "0" / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["model"] |= {"dim": 32, "hidden": 88}
    cfg["train"] |= {"batch_size": 16, **({"flops_reference": {"n_layers": 8}} if reference else {})}
    cfg["dataset"] = {"kind": "text", "seq_len": 64, "text_bytes": 4_500_000}
    path.write_text(yaml.safe_dump(cfg))


def write_gate(study_dir: Path, task: str, losses: dict[int, list[float]]) -> None:
    for blocks, per_seed in losses.items():
        for seed, loss in enumerate(per_seed):
            gate_run(study_dir / "runs" / "gate" / task / f"seed-{seed}" / f"blocks-{blocks}", seed=seed, blocks=blocks, loss=loss)


def test_gate_from_run_dirs(tmp_path: Path) -> None:
    """A task whose deep model gains 0.1 nats (resolved) on 5 seeds passes; one whose depths tie fails."""
    write_gate(tmp_path, "deep_task", {8: [1.00, 1.02, 0.98, 1.01, 0.99], 4: [1.10, 1.11, 1.09, 1.12, 1.10],
                                      2: [1.30, 1.28, 1.31, 1.29, 1.30]})
    write_gate(tmp_path, "flat_task", {8: [1.38, 1.39, 1.37], 4: [1.38, 1.38, 1.38], 2: [1.39, 1.40, 1.38]})
    gates = {g.task: g for g in collect_gates(study_dir=tmp_path, study="lm")}
    deep, flat = gates["deep_task"], gates["flat_task"]
    assert deep.seeds == [0, 1, 2, 3, 4] and deep.deep.mean == pytest.approx(-0.104) and deep.deep.resolved, deep.deep
    assert deep.verdict == "PASS", (deep.deep, deep.mid)
    assert flat.verdict.startswith("FAIL (DDP-8 − DDP-4 interval above −0.05)"), (flat.deep, flat.verdict)
    assert deep.settings == {"corpus": "text, 4.5 MB", "seq_len": 64, "tokens/step": 4096, "width": "32/88", "peak lr": None, "DDP-8 steps": 100}
    assert deep.seed_s == pytest.approx(sum(0.1 * 100 * 8 // d for d in DEPTHS)), deep.train_s  # step_s x steps
    rows = {line.split(" | ")[0].strip("| `"): line for line in gate_section(study_dir=tmp_path, study="lm")
            if line.startswith("| `")}
    assert " | 0,1,2,3,4 | 5/5/5 | " in rows["deep_task"] and " | 0,1,2 | 3/3/3 | " in rows["flat_task"], rows
    write_gate(tmp_path, "uneven_task", {8: [1.0, 1.1, 1.0], 4: [1.1, 1.2, 1.1], 2: [1.3]})  # one seed at 2 blocks
    rows = [line for line in gate_section(study_dir=tmp_path, study="lm") if line.startswith("| `uneven_task`")]
    assert " | 0 | 3/3/1 | " in rows[0], rows


@pytest.mark.parametrize(("dataset", "corpus"), [
    ({"name": "pointer", "seq_len": 64, "chains": 3, "hops": 4, "queries": 13}, "pointer: 3 chains x 4 hops, 13 queries"),
    ({"name": "automaton", "seq_len": 64, "symbols": 4, "max_steps": 8}, "automaton: 4 symbols, k = 1..8 steps"),
    ({"name": "automaton", "seq_len": 64, "symbols": 8, "max_steps": 8, "neighbours": 2, "density": 0.3},
     "automaton: 8 symbols, k = 1..8 steps, 2 neighbours, density 0.3"),
    ({"name": "automaton", "seq_len": 64, "symbols": 8, "max_steps": 8, "neighbours": 1, "density": None},
     "automaton: 8 symbols, k = 1..8 steps, 1 neighbours, dense")])
def test_a_synthetic_task_names_its_shape(tmp_path: Path, dataset: dict, corpus: str) -> None:
    """dataset=pointer and automaton have no corpus size: the table names their shape (from the run's config)."""
    write_gate(tmp_path, "task", {8: [1.0], 4: [1.1], 2: [1.2]})
    path = tmp_path / "runs" / "gate" / "task" / "seed-0" / "blocks-8" / "0" / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["dataset"] = dataset
    path.write_text(yaml.safe_dump(cfg))
    (gate,) = collect_gates(study_dir=tmp_path, study="lm")
    assert gate.settings["corpus"] == corpus, gate.settings


def test_a_task_elsewhere_takes_depth_8_from_that_studys_main_sweep(study: Path) -> None:  # noqa: F811 - the fixture
    """The text task: DDP-2 and DDP-4 in this study's runs/gate, DDP-8 = the main sweep's DDP runs of the study named
    in ``elsewhere`` (a directory next to this one), never that sweep's other rows."""
    ((task, other),) = ELSEWHERE.items()
    study.rename(study.parent / other)  # the fixture's study is the record; the gate lives in a fresh "lm"
    lm = study.parent / "lm"
    write_gate(lm, task, {4: [2.00, 2.10, 1.95], 2: [2.02, 2.08, 1.97]})  # the fixture's DDP: 2.00, 2.10, 1.95
    (gate,) = collect_gates(study_dir=lm, study="lm")
    assert gate.losses[8] == {0: 2.00, 1: 2.10, 2: 1.95}, gate.losses
    assert gate.deep.mean == pytest.approx(0.0) and gate.verdict.startswith("FAIL"), (gate.deep, gate.verdict)


def test_the_studys_task_gives_its_ddp_rows(study: Path) -> None:  # noqa: F811 - the fixture
    """The study's task: its gate runs are the table's DDP rows at every depth (DDP-8 the DDP row, 5 seeds; the
    shallower ones the small dense models), the main sweep runs no DDP; the gate section comes first in REPORT.md and
    states the task's verdict."""
    from sdp.bench.study_report import Study

    for path in sorted((study / "runs" / "main").iterdir()):  # the main sweep without its DDP runs
        if yaml.safe_load((path / "config.yaml").read_text())["parallelism"]["name"] == "ddp":
            for f in path.iterdir():
                f.unlink()
            path.rmdir()
    write_gate(study, TASK, {8: [2.00, 2.10, 1.95, 2.02, 2.03], 4: [2.20, 2.28, 2.17, 2.22, 2.21],
                             2: [2.40, 2.45, 2.38, 2.41, 2.44]})
    st = Study(study_dir=study, study="lm")
    assert sorted(st.ddp.runs) == [0, 1, 2, 3, 4] and st.ddp.values("eval_loss")[1] == 2.10, st.ddp.runs
    assert sorted(st.rows["DDP n_layers=4 (FLOP-matched to n_layers=8)"].runs) == [0, 1, 2, 3, 4], sorted(st.rows)
    assert "DDP n_layers=2 (FLOP-matched to n_layers=8)" in st.rows and st.paired("B-SDP C=0.5").n == 3, sorted(st.rows)
    section = "\n".join(gate_section(study_dir=study, study="lm"))
    assert f"**The study's task (`{TASK}`, the table below): PASS**" in section, section
    assert "(paired seeds: 5 and 5; 5 at every depth;" in section, section
    write_report(study_dir=study, study="lm")
    report = (study / "REPORT.md").read_text()
    assert report.index("## Depth gate") < report.index("| method |") < report.index("## Verdicts"), report[:400]


def test_gate_stages_one_run_each() -> None:
    stages = dict(gate_stages(study="lm", out_runs=Path("/r"), common=["train.skip_done=true"]))
    for task, n_seeds in GATES["lm"]["tasks"].items():
        depths = [d for d in DEPTHS if not (task in ELSEWHERE and d == DEPTHS[-1])]  # that study has the reference
        for seed in range(n_seeds):
            for blocks in DEPTHS:
                name = f"gate-{task}-s{seed}-L{blocks}"
                assert (name in stages) == (blocks in depths), (name, sorted(stages))
                if blocks in depths:
                    args = stages[name]
                    assert args[0] == f"experiment={task}" and f"model.n_layers={blocks}" in args, args
                    assert "train.flops_reference={n_layers:8}" in args and f"seed={seed}" in args, args
                    assert args[-1] == f"hydra.sweep.dir=/r/gate/{task}/seed-{seed}/blocks-{blocks}", args
    assert gate_stages(study="image", out_runs=Path("/r"), common=[]) == []
    assert MARGIN == 0.05


def test_a_study_without_a_gate_says_why_from_its_ddp_accuracy() -> None:
    from sdp.bench.gate import no_gate_lines

    text = "\n".join(no_gate_lines(study="image", ddp_accuracy=99.1))
    assert "DDP reaches 99.10 % evaluation accuracy" in text and "0.90 points from 100 %" in text, text
    assert no_gate_lines(study="lm", ddp_accuracy=99.1) == [] and no_gate_lines(study="image", ddp_accuracy=None) == []


def test_small_dense_model_has_its_own_row(tmp_path: Path) -> None:
    """A DDP run FLOP-matched to another model (the small dense model, a gate depth) is not the DDP row."""
    from sdp.bench.study_report import row_name
    from sdp.report.runs import load_run

    gate_run(tmp_path / "small", seed=0, blocks=4, loss=1.0)
    gate_run(tmp_path / "ddp", seed=0, blocks=8, loss=1.0, reference=False)
    gate_run(tmp_path / "gate8", seed=0, blocks=8, loss=1.0)  # the gate's reference depth: matched to itself
    assert row_name(load_run(tmp_path / "small" / "0")) == "DDP n_layers=4 (FLOP-matched to n_layers=8)"
    assert row_name(load_run(tmp_path / "ddp" / "0")) == "DDP" == row_name(load_run(tmp_path / "gate8" / "0"))


def test_the_loss_by_group_shows_where_depth_pays(tmp_path: Path) -> None:
    """Runs that record ``eval_loss_by_group`` (automaton's k) add a table of DDP-8 / 4 / 2 per k, each cell the
    mean over the seeds present; a task whose runs recorded none adds nothing to the section."""
    import json

    write_gate(tmp_path, "groups_task", {8: [1.0, 1.1], 4: [1.2, 1.3], 2: [1.4]})
    write_gate(tmp_path, "plain_task", {8: [1.0], 4: [1.2], 2: [1.4]})
    plain = "\n".join(gate_section(study_dir=tmp_path, study="lm"))
    for path in (tmp_path / "runs" / "gate" / "groups_task").glob("seed-*/blocks-*/0/summary.json"):
        blocks, seed = int(path.parent.parent.name.split("-")[1]), int(path.parent.parent.parent.name.split("-")[1])
        summary = json.loads(path.read_text())
        summary["final"]["eval_loss_by_group"] = {"name": "k", "loss": {"1": 0.1 * seed, "2": blocks + seed},
                                                  "count": {"1": 630, "2": 640}}
        path.write_text(json.dumps(summary))
    section = gate_section(study_dir=tmp_path, study="lm")
    text = "\n".join(section)
    print(text)
    assert text.startswith(plain.rstrip("\n")), "the gate's own table is unchanged"
    at = section.index("| depth | k = 1 | k = 2 |")
    assert section[at - 2].startswith("Eval loss by k (`groups_task`;") and "1: 630, 2: 640" in section[at - 2], section
    assert section[at + 2 : at + 5] == ["| DDP-8 (n = 2) | 0.050 | 8.500 |", "| DDP-4 (n = 2) | 0.050 | 4.500 |",
                                        "| DDP-2 (n = 1) | 0.000 | 2.000 |"], section[at:]
    assert "plain_task`;" not in text, "a task without groups has no such table"


def test_a_study_with_only_its_gate_says_what_is_missing(tmp_path: Path) -> None:
    """Before its main sweep the study's table is the gate's DDP rows; the verdicts say which runs are missing rather
    than leaving a section empty."""
    from sdp.bench.study_report import Study
    from sdp.bench.verdicts import claims

    write_gate(tmp_path, TASK, {8: [1.0, 1.1], 4: [1.2, 1.3], 2: [1.4, 1.5]})
    text = "\n".join(claims(Study(study_dir=tmp_path, study="lm")))
    assert "- no SDP run yet (rows looked for: B-SDP C=0.25," in text and "no B-SDP C=0.5 run paired with DDP yet" in text, text
