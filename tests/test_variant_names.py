"""Every variant's name says what it sets (conf/variant/*.yaml): the naming convention below, checked against each
variant's composed config, so that a report row's variant name never lies about the run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import sdp.driver.train
from tests.hydra_cfg import compose_config as compose_with

CONF = Path(sdp.driver.train.CONF_DIR)
VARIANTS = sorted(p.stem for p in (CONF / "variant").glob("*.yaml"))

# *_iters: the same row under the same-iteration budget; *_shuffleR / *_rollR: the row with a plan re-draw every R steps;
# *_consF / *_consF_kdA: the row with consolidation over the last F % of the budget, distilled at weight A / 100;
# *_consF_ldQ: consolidation whose ranks run each block with probability Q / 100 (parallelism.consolidate_survival);
# *_consF_wavg: consolidation averaging each block's gradient over all ranks (parallelism.consolidate_average=world);
# *_cal: the row with assembly calibration after training; *_ac: the row with activation checkpointing (train.ac=full);
# *_rt: the row at branch scale 1 (parallelism.rescale=train); *_rn: the row with no branch scaling (rescale=none);
# *_exact: a drop baseline whose ranks keep exactly p x n blocks per batch (parallelism.depth=exact)
_FRACTION = re.compile(r"_c(\d+)(_iters)?(?:_(shuffle|roll)(\d+))?(?:_cons(\d+))?(?:_kd(\d+))?(?:_ld(\d+))?(_wavg)?(_cal)?(_ac)?(_r[tn])?"
                       r"(_exact)?$")


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_sets_method_and_coverage(variant: str):
    """A ``*_cNN`` row computes a fraction NN/100 of the blocks (SDP coverage, or a drop baseline's
    survival probability); the other rows name their strategy."""
    cfg = compose_with(f"variant={variant}", "scale=cpu")
    m = _FRACTION.search(variant)
    if m is not None and "_small_" in variant:  # DDP at one SDP worker's depth: C x the reference model's blocks
        ref = cfg.train.flops_reference
        assert cfg.parallelism.name == "ddp" and cfg.train.budget == "flops", (variant, cfg.parallelism.name, cfg.train.budget)
        assert cfg.model.n_layers == int(m.group(1)) / 100 * ref.n_layers, (variant, cfg.model.n_layers, ref)
        return
    if m is None:  # the row of a preset, named by it (ddp) or by it and its setting (diloco_h8, fsdp_ac)
        preset = re.search(r"override /parallelism: *(\w+)", (CONF / "variant" / f"{variant}.yaml").read_text()).group(1)
        assert variant == preset or variant.startswith(f"{preset}_"), (variant, preset)
        assert cfg.parallelism.name == compose_with(f"parallelism={preset}").parallelism.name, (variant, cfg.parallelism.name)
        assert "coverage" not in cfg.parallelism and "survival_prob" not in cfg.parallelism
        return
    key = "coverage" if "coverage" in cfg.parallelism else "survival_prob"
    assert cfg.parallelism[key] == int(m.group(1)) / 100, (variant, key, cfg.parallelism[key])
    if m.group(2):
        assert cfg.train.budget == "iterations", (variant, cfg.train.budget)
    if m.group(3):
        redraw = {"shuffle": "shuffle", "roll": "rolling"}[m.group(3)]
        assert (cfg.parallelism.redraw, cfg.parallelism.resample_every) == (redraw, int(m.group(4))), (variant, cfg.parallelism)
    consolidate = (int(m.group(5)) / 100 if m.group(5) else None, int(m.group(6)) / 100 if m.group(6) else 0)
    assert (cfg.parallelism.get("consolidate"), cfg.parallelism.get("distill_alpha", 0)) == consolidate, (variant, cfg.parallelism)
    survival = int(m.group(7)) / 100 if m.group(7) else 1.0
    assert cfg.parallelism.get("consolidate_survival", 1.0) == survival, (variant, cfg.parallelism.get("consolidate_survival"))
    average = cfg.parallelism.get("consolidate_average", "holders")
    assert (average == "world") == bool(m.group(8)), (variant, average)
    assert bool(m.group(9)) == bool(cfg.parallelism.get("calibrate_steps")), (variant, cfg.parallelism.get("calibrate_steps"))
    assert (cfg.train.ac == "full") == bool(m.group(10)), (variant, cfg.train.ac)
    rescale, default = cfg.parallelism.get("rescale"), "none" if cfg.parallelism.get("masking") == "backward" else None
    want = {"_rt": "train", "_rn": "none"}.get(m.group(11), default)  # backward masking scales no branch: none, always
    assert (rescale if rescale in ("train", "none") else None) == want, (variant, rescale)
    assert (cfg.parallelism.get("depth") == "exact") == bool(m.group(12)), (variant, cfg.parallelism.get("depth"))
