"""The evaluation protocol (sdp.rank.evaluation), single process: what re-estimation computes, that it
leaves the training run untouched, and that models without BatchNorm are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdp.rank.evaluation import applied, reestimate_bn
from sdp.core.distctx import DistContext


def _ctx() -> DistContext:
    return DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Dropout(0.5), nn.Linear(7, 3))


def test_reestimate_gives_the_exact_statistics_of_the_batches() -> None:
    net = _net().eval()
    batches = [torch.randn(16, 5) for _ in range(3)]
    reestimate_bn(net, shards=[batches], ctx=_ctx())
    hidden = torch.cat([net[0](x) for x in batches])
    bn = net[1]
    torch.testing.assert_close(bn.running_mean, hidden.mean(0).detach())
    # cumulative average of each batch's unbiased variance (momentum=None), as BatchNorm computes it
    expect_var = torch.stack([net[0](x).var(0, unbiased=True) for x in batches]).mean(0).detach()
    torch.testing.assert_close(bn.running_var, expect_var)
    assert not net.training and not bn.training and bn.momentum == 0.1, "modes and momentum must come back"


def test_applied_restores_the_training_statistics_and_draws_no_random_numbers() -> None:
    net = _net()
    net.train()
    for _ in range(3):  # training accumulates momentum statistics
        net(torch.randn(8, 5))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net.eval()
    rng = torch.get_rng_state()
    batches = [torch.randn(16, 5) for _ in range(2)]
    torch.set_rng_state(rng)
    with applied(net, bn="reestimate", shards=[iter(batches)], ctx=_ctx()) as model:
        assert model is net
        assert not torch.equal(net[1].running_mean, before["1.running_mean"]), "statistics were not re-estimated"
        out_a = model(batches[0])
        out_b = model(batches[0])
        torch.testing.assert_close(out_a, out_b)  # eval mode: dropout is off
    assert torch.equal(torch.get_rng_state(), rng), "re-estimation drew random numbers (dropout ran in train mode?)"
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by evaluation"


def test_average_and_models_without_batchnorm_are_left_alone() -> None:
    net = _net().eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with applied(net, bn="average", shards=[iter(())], ctx=_ctx()):
        pass
    plain = nn.Sequential(nn.Linear(5, 3))
    with applied(plain, bn="reestimate", shards=[iter(())], ctx=_ctx()):  # no BatchNorm: no batch is read
        pass
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(("model", "level", "masking", "bn", "expect"), [
    ("resnet18_cifar", "neuron", "forward", "reestimate", "none"),  # bn2 re-normalises the widened branch
    ("resnet18_cifar", "neuron", "forward", "average", "eval"),     # statistics of the narrow workers: k/n helps
    ("resnet18_cifar", "block", "forward", "reestimate", "eval"),   # a dropped block contributes nothing
    ("resnet18_cifar", "neuron", "backward", "reestimate", "none"),
    ("llama_tiny", "neuron", "forward", "reestimate", "eval"),      # pre-norm branches end in a projection
])
def test_rescale_auto_resolves_per_model_family(model: str, level: str, masking: str, bn: str, expect: str) -> None:
    from omegaconf import OmegaConf

    from sdp.parallel.sdp_config import resolve_rescale
    from sdp.registry import build
    from tests.hydra_cfg import compose_config

    data = "dataset=synthetic_text" if model.startswith("llama") else "dataset=digits"
    cfg = compose_config(f"model={model}", data, "parallelism=sdp", f"parallelism.level={level}",
                         f"parallelism.masking={masking}", f"eval.bn={bn}")
    assert cfg.parallelism.rescale == "auto", "auto is the default of the sdp preset"
    with torch.device("meta"):
        net = build(OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True)))
    assert resolve_rescale(cfg=cfg.parallelism, eval_bn=bn, model=net) == expect


def test_chunked_evaluation_loss_equals_the_whole_batch_loss() -> None:
    from torch.nn import functional as F

    from sdp.core.loss import loss_and_correct

    torch.manual_seed(0)
    logits, target = torch.randn(3, 50, 97, dtype=torch.float64), torch.randint(0, 97, (3, 50))
    loss, correct = loss_and_correct(logits, target, chunk=16)  # 150 rows in 10 chunks, the last one short
    whole = F.cross_entropy(logits.reshape(-1, 97), target.reshape(-1), reduction="sum")
    assert loss == pytest.approx(float(whole), rel=1e-12)
    assert correct == float((logits.argmax(-1) == target).sum())
