"""sdp-bench throughput-model's anchor (sdp/bench/throughput_model.py): torchtitan's Llama-3-8B tokens/s compared at
each of its measured activation-checkpointing settings, the step adding what train.ac recomputes."""

from __future__ import annotations

from sdp.bench.throughput_model import ANCHOR, ANCHOR_AC, render, timed


def test_each_measured_setting_is_predicted_with_its_own_recomputation() -> None:
    plain = timed(ANCHOR, link_names=["ib_ndr"])["ib_ndr"]
    got = {name: timed([*ANCHOR, *o], link_names=["ib_ndr"])["ib_ndr"] for name, (o, _) in ANCHOR_AC.items()}
    layer, op = got["selective layer (every 2nd block, assumed)"], got["selective op"]
    assert plain["recompute_fraction"] == 0 < op["recompute_fraction"] < layer["recompute_fraction"], (plain, op, layer)
    assert layer["tokens_per_s_per_gpu"] < op["tokens_per_s_per_gpu"] < plain["tokens_per_s_per_gpu"], got
    step = {"step_s": 1.0, "compute_s": 1.0, "exposed_comm_s": 0.0, "fraction_computed": 1.0}
    results = {"mfu": 0.4, "grid": {8: {"nvlink": {"DDP": step, "B-SDP C=0.5": step}}}, "anchor": plain,
               "anchor_ac": got, "provenance": {"versions": {"git_commit": "abc"}}, "links": {}}
    text = render(results)
    assert f"| selective op | `train.ac=op` | {op['tokens_per_s_per_gpu']:,.0f} |" in text, text
    assert f"| 2,973 | {op['tokens_per_s_per_gpu'] / 2973:.2f} |" in text, text
