"""What a GPU user expects (issue 29, item 5): TF32 and cuDNN autotuning on CUDA unless asked otherwise,
recorded in summary.json, and ``train.deterministic=true`` refused before any rank starts for a model that
would raise on CUDA at its first backward. Runs on CPU: the backend flags can be set without a GPU, and the
validation path is taken with ``cluster.device=cuda`` against a stubbed CUDA runtime.

Before, no rank set TF32 or cudnn.benchmark (PyTorch's defaults: TF32 matmuls off), and a model without a
deterministic CUDA backward passed validation and failed inside every rank.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch
from torch import nn

from sdp.driver import sweep
from sdp.driver.config import validate
from sdp.errors import ConfigError
from sdp.metrics.flops import compute_dtype
from sdp.models.resnet import ResNetCIFAR
from sdp.rank.rankenv import set_backends
from tests.hydra_cfg import compose_config

CUDA = torch.device("cuda", 0)  # a device object needs no GPU; only running a kernel on it would


@pytest.fixture
def restore_backends() -> Iterator[None]:
    """Leave torch's process-wide switches as the test found them."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
             torch.backends.cudnn.deterministic, torch.are_deterministic_algorithms_enabled(),
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark,
     torch.backends.cudnn.deterministic) = saved[:4]
    torch.use_deterministic_algorithms(saved[4])
    if saved[5] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[5]


def flags() -> tuple[bool, bool, bool]:
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)


def test_cuda_rank_gets_tf32_and_autotuning_by_default(restore_backends: None) -> None:
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = False, False, False
    record = set_backends(device=CUDA, deterministic=False, tf32=True)
    assert flags() == (True, True, True)
    assert record == {"device_type": "cuda", "deterministic": False, "tf32_matmul": True, "tf32_cudnn": True,
                      "cudnn_benchmark": True, "cudnn_deterministic": False}


def test_tf32_off_and_deterministic_turn_their_parts_off(restore_backends: None) -> None:
    set_backends(device=CUDA, deterministic=False, tf32=False)
    assert flags() == (False, False, True), "train.tf32=false: full fp32 matmuls and convolutions, autotuning still on"
    record = set_backends(device=CUDA, deterministic=True, tf32=True)
    assert flags() == (True, True, False), "deterministic: no autotuning (it picks kernels by timing)"
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert record["cudnn_benchmark"] is False and record["deterministic"] is True


def test_cpu_rank_leaves_the_flags_alone(restore_backends: None) -> None:
    before = flags()
    record = set_backends(device=torch.device("cpu"), deterministic=False, tf32=True)
    assert flags() == before and not torch.are_deterministic_algorithms_enabled()
    assert record == {"device_type": "cpu", "deterministic": False, "tf32_matmul": None, "tf32_cudnn": None,
                      "cudnn_benchmark": None, "cudnn_deterministic": None}


def test_mfu_of_an_fp32_run_on_tf32_uses_the_tf32_peak() -> None:
    assert compute_dtype({"precision": "fp32", "backends": {"tf32_matmul": True}}) == "tf32"
    assert compute_dtype({"precision": "fp32", "backends": {"tf32_matmul": False}}) == "fp32"
    assert compute_dtype({"precision": "fp32"}) == "fp32"  # an older run, or CPU
    assert compute_dtype({"precision": "bf16", "backends": {"tf32_matmul": True}}) == "bf16"


def test_tf32_key_is_typed() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=r"train.tf32=maybe") as info:  # the schema's bool: Hydra refuses
        validate(compose_config("experiment=smoke", "model=mlp", "train.tf32=maybe"))
    assert "not a valid bool" in str(info.value.__cause__) and "full_key: train.tf32" in str(info.value.__cause__), info.value.__cause__


def test_skip_done_reuses_a_cpu_run_recorded_before_the_tf32_key() -> None:
    then = {"train": {"steps": 4}, "cluster": {"device": "cpu"}}
    assert sweep.first_difference(now={"train": {"steps": 4, "tf32": True}, "cluster": {"device": "cpu"}}, then=then) is None
    cuda_then = {"train": {"steps": 4}, "cluster": {"device": "cuda"}}
    assert sweep.first_difference(now={"train": {"steps": 4, "tf32": True}, "cluster": {"device": "cuda"}},
                                  then=cuda_then) == ("train.tf32", True, "<absent>"), "a CUDA run computed without it"


class PooledResNet(ResNetCIFAR):
    """ResNet-CIFAR whose head pools to 2 x 2: ``adaptive_avg_pool2d`` to a size other than 1 has no
    deterministic CUDA backward (size 1 runs as a mean over the spatial dims, which has)."""

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        ch = self.head[-1].in_features
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * ch, self.head[-1].out_features))


@pytest.fixture
def stub_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with one visible GPU, as far as the driver's validation asks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


RESNET = ["model=resnet18_cifar", "model.width=4"]
RUN = ["experiment=smoke", "parallelism=ddp", "cluster.world_size=1"]
CUDA_RUN = [*RUN, "cluster.device=cuda"]
POOLED = f"model._target_={__name__}.PooledResNet"


def test_deterministic_cuda_run_of_a_model_without_a_deterministic_backward_is_refused(stub_cuda: None) -> None:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(*CUDA_RUN, *RESNET, POOLED, "train.deterministic=true"))
    msg = str(err.value)
    assert msg.startswith("train.deterministic=True is invalid: model ") and "aten._adaptive_avg_pool2d_backward" in msg, msg
    assert "train.deterministic=false" in msg and "cluster.device=cpu" in msg, msg
    validate(compose_config(*CUDA_RUN, *RESNET, POOLED, "train.deterministic=false"))  # not asked to be deterministic: runs
    validate(compose_config(*RUN, *RESNET, "cluster.device=cpu", POOLED, "train.deterministic=true"))  # CPU has a kernel


@pytest.mark.parametrize("model", [RESNET, ["model=swin_t", "dataset=synthetic_image"]], ids=["resnet", "swin"])
def test_suite_models_pool_by_a_mean_and_pass(stub_cuda: None, model: list[str]) -> None:
    """ResNet's and Swin's ``AdaptiveAvgPool2d(1)`` run as a mean on every device, whose backward is deterministic."""
    validate(compose_config(*CUDA_RUN, *model, "train.deterministic=true"))


def test_argument_dependent_entries_are_read_by_name() -> None:
    """An op that raises only with some arguments (median with indices, scatter_reduce 'prod', a reduced
    spatial NLL loss) is reported for those only, wherever the argument is passed."""
    from torch.nn import functional as F

    from sdp.driver.determinism import _Recorder

    x = torch.empty(4, 3, device="meta")
    index = torch.zeros(4, 3, dtype=torch.long, device="meta")
    with _Recorder() as quiet:
        x.median()
        x.scatter_reduce(0, index, x, reduce="sum")
        F.nll_loss(torch.empty(2, 3, 4, 4, device="meta"), torch.zeros(2, 4, 4, dtype=torch.long, device="meta"),
                   reduction="none")
    with _Recorder() as loud:
        x.median(dim=1)
        x.scatter_reduce(0, index, x, reduce="prod")
        F.nll_loss(torch.empty(2, 3, 4, 4, device="meta"), torch.zeros(2, 4, 4, dtype=torch.long, device="meta"))
    assert quiet.found == {}, quiet.found
    assert set(loud.found) == {"aten.median", "aten.scatter_reduce", "aten.nll_loss2d_forward"}, loud.found
