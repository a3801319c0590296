"""A multirun launched into a sweep directory keeps the ``multirun.yaml`` already there (Hydra's sweeper rewrites
it at every launch): the earlier file comes back, this launch's is kept beside it when it differs."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from sdp.driver.sweep import SweepRecord


def started(sweep: Path) -> SweepRecord:
    record = SweepRecord()
    record.on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    return record


def test_an_earlier_record_is_restored_and_the_launch_kept_beside_it(tmp_path: Path) -> None:
    (tmp_path / "multirun.yaml").write_text("sweep: seeds 0-2\n")
    record = started(tmp_path)
    (tmp_path / "multirun.yaml").write_text("sweep: job 1 again\n")  # what Hydra's sweeper does at every launch
    record.on_job_start(OmegaConf.create({}))
    assert (tmp_path / "multirun.yaml").read_text() == "sweep: seeds 0-2\n"
    launches = sorted(tmp_path.glob("multirun.launch-*.yaml"))
    assert [p.read_text() for p in launches] == ["sweep: job 1 again\n"], launches
    assert record.settle() is None, "settled once: the end of the multirun and the exit hook change nothing"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["multirun.yaml", launches[0].name])


def test_a_first_launch_and_an_identical_relaunch_write_no_record(tmp_path: Path) -> None:
    first = started(tmp_path / "new")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "multirun.yaml").write_text("sweep\n")
    first.on_multirun_end(OmegaConf.create({}))
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["multirun.yaml"]
    again = started(tmp_path / "new")
    (tmp_path / "new" / "multirun.yaml").write_text("sweep\n")
    assert again.settle() is None and [p.name for p in (tmp_path / "new").iterdir()] == ["multirun.yaml"]


def test_a_job_elsewhere_leaves_the_file_to_the_driver_and_two_launches_in_a_second_both_stay(tmp_path: Path) -> None:
    (tmp_path / "multirun.yaml").write_text("a\n")
    one, two = started(tmp_path), started(tmp_path)
    one.driver = ("another-host", 1)  # a Slurm task: its array siblings read the file; the driver settles at the end
    (tmp_path / "multirun.yaml").write_text("b\n")
    one.on_job_start(OmegaConf.create({}))
    assert (tmp_path / "multirun.yaml").read_text() == "b\n"
    one.on_multirun_end(OmegaConf.create({}))
    assert (tmp_path / "multirun.yaml").read_text() == "a\n" and one.launch.read_text() == "b\n"
    (tmp_path / "multirun.yaml").write_text("c\n")  # the second launch, started in the same second
    two.on_multirun_end(OmegaConf.create({}))
    assert two.launch != one.launch and two.launch.read_text() == "c\n", (one.launch, two.launch)
    assert (tmp_path / "multirun.yaml").read_text() == "a\n"
