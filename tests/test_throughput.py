"""sdp-plan's FLOPs and step time (sdp/planning/throughput.py): the model's own FLOP count against the closed
form at Llama-3-8B shapes, the step-time rule on hand-made collectives, each strategy's overlap statement, the
one device table MFU and the planner share, and the ``throughput`` keys of a plan for DDP and SDP."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from sdp.driver.config import validate
from sdp.driver.preflight import meta_model
from sdp.errors import ConfigError
from sdp.metrics.flops import peak_flops
from sdp.metrics.hardware import gpus, links
from sdp.parallel import STRATEGIES
from sdp.parallel.spec import Overlap
from sdp.planning.throughput import FIELDS, comm_times, rank_times
from tests.helpers import compose

# Llama-3-8B as issue 36 states it (torchtitan's job): model=llama_1b with these shapes
LLAMA3_8B = ["model=llama_1b", "model.dim=4096", "model.n_layers=32", "model.n_heads=32", "model.n_kv_heads=8",
             "model.hidden=14336", "dataset=synthetic_text", "dataset.vocab_size=128256", "dataset.seq_len=8192"]
SMALL_LM = ["model=llama_tiny", "dataset=synthetic_text", "optim=adamw", "cluster.world_size=4", "train.batch_size=2",
            "cluster.gpu=h100_80gb", "cluster.link=ib_ndr", "train.precision=bf16"]
KEYS = ("flops_per_token", "step_s", "compute_s", "exposed_comm_s", "tokens_per_s_per_gpu")


def test_llama3_8b_flops_per_token_is_the_closed_form_within_3_percent() -> None:
    """The model's count (FlopCounterMode on meta, 3x forward) per token against 6 (N - N_embedding) + 12 L d s
    (PaLM's appendix, nanoGPT, torchtitan): 57.9 GFLOP at seq 8192. No training, no weights."""
    cfg = compose(LLAMA3_8B)
    model = meta_model(cfg)
    seq, layers, dim = 8192, 32, 4096
    n = sum(p.numel() for p in model.parameters())
    n_emb = model.stem.weight.numel()
    assert (n, n_emb) == (8_030_261_248, 128_256 * 4096), (n, n_emb)  # Llama-3-8B's 8.03 G parameters
    closed = 6 * (n - n_emb) + 12 * layers * dim * seq
    counted = model.flops_per_sample() / seq
    assert abs(counted / closed - 1) < 0.03, f"counted {counted / 1e9:.3f} G vs closed form {closed / 1e9:.3f} G per token"
    assert abs(counted / 57.9e9 - 1) < 0.03, f"counted {counted / 1e9:.3f} G per token, issue 36's target 57.9 G"


def test_step_time_arithmetic_on_hand_made_collectives() -> None:
    """compute = FLOPs / (peak x mfu); comm = wire bytes / bus; exposed = non-overlapping kinds + max(tail,
    overlapping - window), window = 2/3 of compute for backward, all of it for step."""
    ddp = Overlap(kinds=("all_reduce",), window="backward", tail=1)
    ten = {"all_reduce": {"bytes": 0.0, "count": 10.0, "wire_bytes": 4.6e9}}  # 0.1 s at 46 GB/s
    t = rank_times(flops_per_step=1e15, peak_flops=1e15, mfu=0.5, by_kind=ten, bus_bytes_per_s=46e9, overlap=ddp)
    assert t["compute_s"] == pytest.approx(2.0) and t["comm_s"] == pytest.approx(0.1), t
    assert t["exposed_comm_s"] == pytest.approx(0.01) and t["step_s"] == pytest.approx(2.01), t  # the last of 10 buckets
    bound = {"all_reduce": {"bytes": 0.0, "count": 10.0, "wire_bytes": 92e9}}  # 2 s of all-reduce, 4/3 s of backward
    assert comm_times(by_kind=bound, bus_bytes_per_s=46e9, overlap=ddp, compute_s=2.0) == pytest.approx((2.0, 2.0 - 4 / 3))
    refresh = {**ten, "broadcast": {"bytes": 0.0, "count": 3.0, "wire_bytes": 23e9}}  # 0.5 s, after the step: exposed
    assert comm_times(by_kind=refresh, bus_bytes_per_s=46e9, overlap=ddp, compute_s=2.0) == pytest.approx((0.6, 0.51))
    assert comm_times(by_kind=ten, bus_bytes_per_s=46e9, overlap=Overlap(), compute_s=2.0) == pytest.approx((0.1, 0.1))
    fsdp = Overlap(kinds=("all_gather", "reduce_scatter"), window="step", tail=2)
    gathers = {"all_gather": {"bytes": 0.0, "count": 3.0, "wire_bytes": 69e9}, "reduce_scatter": {"bytes": 0.0, "count": 1.0, "wire_bytes": 23e9}}
    assert comm_times(by_kind=gathers, bus_bytes_per_s=46e9, overlap=fsdp, compute_s=1.5) == pytest.approx((2.0, 1.0))
    assert comm_times(by_kind=gathers, bus_bytes_per_s=46e9, overlap=fsdp, compute_s=10.0) == pytest.approx((2.0, 1.0))  # 2 of 4
    none = rank_times(flops_per_step=1e15, peak_flops=1e15, mfu=0.5, by_kind=ten, bus_bytes_per_s=None, overlap=ddp)
    assert none["exposed_comm_s"] is None and none["step_s"] is None, none  # cluster.link=null: no comm time
    alone = {"all_reduce": {"bytes": 8.0, "count": 1.0, "wire_bytes": 0.0}}  # a world of 1 puts nothing on the wire
    one = rank_times(flops_per_step=1e15, peak_flops=1e15, mfu=0.5, by_kind=alone, bus_bytes_per_s=None, overlap=ddp)
    assert one["step_s"] == pytest.approx(2.0) and one["exposed_comm_s"] == 0.0, one


def test_each_strategy_states_its_overlap_and_sdp_overlap_false_exposes_all() -> None:
    assert STRATEGIES.get("ddp").comm_overlap(cfg=OmegaConf.create({})).window == "backward"
    assert STRATEGIES.get("ddp_ac").comm_overlap(cfg=OmegaConf.create({})).kinds == ("all_reduce",)
    assert STRATEGIES.get("fsdp").comm_overlap(cfg=OmegaConf.create({})).window == "step"
    sdp = STRATEGIES.get("sdp")
    assert sdp.comm_overlap(cfg=OmegaConf.create({"overlap": True})) == sdp.overlap
    assert sdp.comm_overlap(cfg=OmegaConf.create({"overlap": False})) == Overlap(), "blocking all-reduces after backward"
    assert STRATEGIES.get("pipeline").comm_overlap(cfg=OmegaConf.create({})) is None


def test_mfu_and_the_planner_read_one_device_table() -> None:
    """The GPU names CUDA reports pick the table's rows (most specific first), so MFU divides by the same peak."""
    table = gpus()
    for device, name in (("NVIDIA H100 80GB HBM3", "h100_80gb"), ("NVIDIA H100 PCIe", "h100_pcie"),
                         ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100_80gb")):
        for dtype in ("bf16", "tf32", "fp32"):
            assert peak_flops(device_name=device, dtype=dtype) == table[name].peak_flops[dtype], (device, dtype)
    assert peak_flops(device_name="cpu", dtype="bf16") is None
    assert {"a100_80gb", "h100_80gb", "h200"} <= set(table) and {"nvlink", "ib_ndr", "eth_100g"} <= set(links())
    assert table["h100_80gb"].peak_flops["bf16"] == pytest.approx(989.4e12) and table["a100_80gb"].peak_flops["bf16"] == pytest.approx(312e12)


@pytest.mark.parametrize("bad,expect", [
    ("cluster.gpu=x", ["cluster.gpu='x'", "a100_80gb", "h200"]),
    ("cluster.link=x", ["cluster.link='x'", "nvlink", "ib_ndr", "eth_100g"]),
    ("plan.mfu=0", ["plan.mfu=0", "(0, 1]"]),
    ("plan.mfu=1.5", ["plan.mfu=1.5", "(0, 1]"]),
])
def test_bad_device_link_and_mfu_are_refused_by_name(bad: str, expect: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose(["experiment=smoke", "model=mlp", bad]), launching=False)
    assert all(e in str(err.value) for e in expect), str(err.value)


def test_plan_json_has_throughput_per_method_and_rank_for_ddp_and_sdp() -> None:
    """Both methods on the same job: every key present, SDP at C = 0.5 computes fewer FLOPs per token and puts
    fewer bytes on the wire per rank; the method's step is its slowest rank's."""
    from sdp.planning.planner import predict

    th = {}
    for par in ("ddp", "sdp"):
        plan = predict(compose([*SMALL_LM, f"parallelism={par}"]))
        th[par] = t = plan["throughput"]
        assert all(t[k] is not None and t[k] > 0 for k in KEYS if k != "exposed_comm_s"), t
        assert len(t["per_rank"]) == 4 and all(r[k] is not None for r in t["per_rank"] for k in (*FIELDS, "tokens_per_s_per_gpu")), t
        assert t["step_s"] == pytest.approx(max(r["step_s"] for r in t["per_rank"])), t
        assert t["step_s"] == pytest.approx(t["compute_s"] + t["exposed_comm_s"]), t
        per_rank_wire = [c["wire_bytes_per_step"] for c in plan["comm"]["per_rank"]]
        assert [r["comm_s"] for r in t["per_rank"]] == pytest.approx([w / 46e9 for w in per_rank_wire]), t
    assert th["sdp"]["flops_per_token"] < th["ddp"]["flops_per_token"] == th["ddp"]["model_flops_per_token"], th
    assert th["sdp"]["compute_s"] < th["ddp"]["compute_s"], th


def test_sdp_plan_plans_for_cuda_on_a_machine_without_one_and_sdp_train_still_refuses() -> None:
    """Planning for a device needs none: ``validate(launching=False)`` (sdp-plan) passes cluster.device=cuda; the
    launch's validation still refuses it where no GPU is visible (tests/test_validation.py: cuda-without-gpu)."""
    import torch

    from sdp.planning.planner import predict

    cfg = compose([*SMALL_LM, "parallelism=ddp", "cluster.device=cuda"])
    assert predict(cfg)["throughput"]["step_s"] > 0
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            validate(cfg)
