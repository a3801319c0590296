"""The forward a rank runs on its device, reproduced on the meta device: ``train.precision``'s autocast
and the attention kernel that device's ``F.scaled_dot_product_attention`` dispatches to.

Why it is needed: the planner rehearses on meta tensors (nothing computed, nothing allocated), and
there (1) ``torch.autocast`` does nothing (no autocast dispatch key for meta: a bf16 job would be
counted in float32), and (2) SDPA takes the math path, which saves the T x T scores per head, where
a real run's fused kernel saves its output and a log-sum-exp, O(T) per head. :func:`device_forward`
enters two ``TorchFunctionMode`` s that make the meta forward allocate and save what the target
device's forward does:

- :class:`Autocast` (``train.precision=bf16``): the ops autocast runs in bf16 (linear, convolution,
  matmul, SDPA) get their float32 inputs cast to bf16 first, exactly as autocast does above autograd,
  so autograd saves the bf16 casts; the weight casts are cached for the region as autocast caches them
  (but inside a checkpointed block, which runs with the cache off: :func:`sdp.core.precision.weight_cache_off`)
  (a cast of a parameter, :class:`sdp.metrics.activations._WeightCopies`, is model state, not an
  activation, but is live memory the peaks include); the ops autocast runs in float32 (the losses; on
  CUDA also softmax and the normalisations) get their bf16 inputs cast up. Everything else runs in
  the dtype its inputs promote to, as under autocast. The cross-entropy on CUDA is not cast whole: torch's
  CUDA autocast lets it decompose, its ``log_softmax`` (asked for in the input's own dtype, which the
  ``fp32_set_opt_dtype`` policy keeps) runs in bf16 and only ``nll_loss``'s input is cast up and saved
  (measured on an H200: benchmarks/results/gpu/h200_check.md, the peak_trace section); casting the logits
  first, as on the CPU, would count two float32 copies of the vocabulary-sized logits where CUDA holds one.
- :class:`Attention` routes SDPA to the op the device runs, whose autograd node saves what that
  kernel saves: ``cpu``: ``_scaled_dot_product_flash_attention_for_cpu`` (grouped-query too: the CPU
  kernel takes unequal head counts); ``cuda``: ``_scaled_dot_product_flash_attention`` in bf16 (q, k, v,
  output, log-sum-exp; grouped-query native), the memory-efficient kernel in float32 (flash has no
  float32), and the math path for a float32 grouped-query call (the memory-efficient kernel refuses
  unequal head counts, so CUDA's dispatcher falls back to math, which saves the scores). A call with a
  mask, dropout or an explicit scale runs as given (the models here make none). On ``cuda`` it also routes
  ``F.rms_norm`` to the fused kernel CUDA runs (:class:`_FusedRMSNorm`: output and a per-row ``rstd``; meta's
  decomposition would save the normalised input too, one input-sized tensor per norm CUDA does not hold).

The lists are CUDA's and CPU's autocast op lists (torch's ``autocast_mode.cpp``) restricted to the
functions the models in ``sdp/models`` call; ``tests/test_device_forward.py`` checks the CPU emulation
against a real CPU autocast forward, saved bytes for saved bytes.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from sdp.core.precision import DTYPES, meta_region

_LOWER = (F.linear, F.conv1d, F.conv2d, F.conv3d, torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm,
          Tensor.bmm, torch.mm, Tensor.mm, torch.addmm, torch.baddbmm, F.scaled_dot_product_attention)
_FP32 = {"cpu": (F.cross_entropy, F.nll_loss, F.mse_loss),
         "cuda": (F.cross_entropy, F.nll_loss, F.mse_loss, F.log_softmax, F.softmax, Tensor.softmax,
                  Tensor.log_softmax, F.layer_norm, F.group_norm, torch.logsumexp)}
DEVICES = tuple(_FP32)  # cluster.device's values (its schema field names this tuple)


def _cast(value: Any, *, to: torch.dtype, frm: torch.dtype, cache: dict[int, tuple[Tensor, Tensor]] | None) -> Any:
    """``value`` with its ``frm`` floating tensors cast to ``to`` (lists and tuples walked), a leaf that
    requires grad (a weight) cast once per region when ``cache`` is given, as autocast's cast cache does: the
    cast and its source are both held until the region ends (torch's cache keeps the source's storage alive
    too, measured: a part dropped mid-region stays in memory; :func:`sdp.subnet.assemble.frozen_part`)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, to=to, frm=frm, cache=cache) for v in value)
    if not isinstance(value, Tensor) or value.dtype != frm:
        return value
    if cache is not None and value.is_leaf and value.requires_grad:
        source, cast = cache.get(id(value), (None, None))
        if source is not value:
            source, cast = value, value.to(to)
            cache[id(value)] = (source, cast)
        return cast
    return value.to(to)


def _cuda_cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: Any = None,
                        ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                        label_smoothing: float = 0.0) -> Tensor:
    """``F.cross_entropy`` as CUDA's autocast runs it (the module docstring): log-softmax in the input's dtype, the
    negative log-likelihood on a float32 copy of it (which autograd saves). Label smoothing adds terms CUDA
    computes on the same log-probabilities; only the copy's dtype matters here, so it is passed through."""
    assert size_average is None and reduce is None, "the deprecated size_average/reduce arguments are not emulated"
    logp = F.log_softmax(input, dim=1 if input.dim() >= 2 else 0, dtype=input.dtype).float()
    w = weight.float() if weight is not None else None
    if label_smoothing:
        return F.cross_entropy(logp, target, weight=w, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
    return F.nll_loss(logp, target, weight=w, ignore_index=ignore_index, reduction=reduction)


def device_optimizer(*, factory: Any, params: list[Tensor], device: str | None = None) -> Any:
    """The optimizer ``factory`` builds over ``params``, with the implementation it picks on ``device`` (None: a
    caller that wants only the state, whatever the step holds): torch's optimizers left at ``foreach=None`` (and
    not fused) run the multi-tensor (foreach) step on CUDA and the per-tensor loop on the CPU and on meta. The
    foreach step holds a temporary as large as the state it reads (AdamW's ``_foreach_sqrt`` of ``exp_avg_sq``: a
    float32 copy of every parameter it updates, measured on an H200), which a meta rehearsal sees only if it runs
    foreach too; foreach ops run on meta tensors. A ``foreach`` the user set is kept.

    ``fused=True`` (torchtitan's default AdamW) is rehearsed as the device runs it: torch refuses it over meta
    tensors only at a parameter's lazy state initialisation, whose device check (:func:`_fused_admits_meta`) does
    not list meta, although the fused kernels have meta implementations; over meta parameters the step runs with
    meta admitted, so the real ``_fused_adamw_`` runs and its state (the moments and a float32 ``step`` per
    parameter, on the device, as on CUDA) is what the device holds. It updates parameters and moments in place with
    no temporary: AdamW over three float32 tensors (4.6 MB, the largest 4.0 MB), the second step's peak above its
    start, measured with :class:`~sdp.metrics.live.LiveTensorTracker`: fused 0 B on the CPU (a real step) and on
    meta, foreach 4.6 MB (a copy of every parameter) on both, the per-tensor loop 8.0 MB (two copies of the
    largest parameter) on both; ``tests/test_fused_optimizer_plan.py``."""
    opt = factory(params)
    if device == "cuda":
        for group in opt.param_groups:
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True
    if any(p.device.type == "meta" for g in opt.param_groups if g.get("fused") for p in g["params"]):
        step = opt.step

        def fused_step(*args: Any, **kwargs: Any) -> Any:
            with _fused_admits_meta():
                return step(*args, **kwargs)
        opt.step = fused_step
    return opt


@contextmanager
def _fused_admits_meta() -> Iterator[None]:
    """torch's list of the devices with fused optimizer kernels, with ``meta`` added while the block runs: the list
    (``torch.optim.optimizer._get_fused_kernels_supported_devices``) is what ``_device_dtype_check_for_fused``, the
    one check every fused optimizer makes (at a parameter's lazy state initialisation), asks; the meta kernels
    exist (``torch._fused_adamw_`` on meta tensors runs, torch 2.14). Patched there and restored after, rather than
    the optimizer's state built by hand, so that any torch optimizer with a fused step (Adam, AdamW, SGD, ...)
    initialises its own state as it does on the device."""
    from torch.optim import optimizer as torch_optimizer

    listed = torch_optimizer._get_fused_kernels_supported_devices
    torch_optimizer._get_fused_kernels_supported_devices = lambda: [*listed(), "meta"]
    try:
        yield
    finally:
        torch_optimizer._get_fused_kernels_supported_devices = listed


class Autocast(TorchFunctionMode):
    """``torch.autocast(device, dtype)`` for meta tensors (see the module docstring); one instance per
    autocast region, its weight-cast cache dropped on exit."""

    def __init__(self, *, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        assert device in DEVICES, f"device={device!r} not in {DEVICES}"
        self.dtype, self.fp32, self.device = dtype, _FP32[device], device
        self._cache: dict[int, tuple[Tensor, Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.cross_entropy and self.device == "cuda":
            return _cuda_cross_entropy(*args, **kwargs)
        if func in _LOWER:
            cache = self._cache if torch.is_autocast_cache_enabled() else None  # torch's switch (precision.weight_cache_off)
            args = _cast(args, to=self.dtype, frm=torch.float32, cache=cache)
            kwargs = {k: _cast(v, to=self.dtype, frm=torch.float32, cache=cache) for k, v in kwargs.items()}
        elif func in self.fp32:
            args = _cast(args, to=torch.float32, frm=self.dtype, cache=None)
        return func(*args, **kwargs)

    def __exit__(self, *exc: Any) -> Any:
        self._cache.clear()
        return super().__exit__(*exc)


class _FusedRMSNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm (``aten._fused_rms_norm``, what ``F.rms_norm`` runs on a CUDA tensor) on meta: the output
    and a float32 ``rstd`` per row, saving the input, the weight and ``rstd``. On meta ``F.rms_norm`` decomposes
    (pow, mean, rsqrt, two muls), whose autograd saves the normalised input as well: one more input-sized tensor
    per norm than CUDA holds (the H200 trace: +12 MiB per norm of LLaMA-134M, its 25 norms 300 MiB of the step)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, normalized_shape: Any, weight: Tensor | None, eps: Any) -> Tensor:  # noqa: ARG004
        dims = len(tuple(normalized_shape))
        rstd = x.new_empty((*x.shape[:x.dim() - dims], *([1] * dims)), dtype=torch.float32)
        ctx.save_for_backward(x, weight, rstd)
        return x.new_empty(x.shape, dtype=torch.result_type(x, weight) if weight is not None else x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), None, (torch.empty_like(weight) if weight is not None else None), None


def _rms_norm_args(input: Tensor, normalized_shape: Any, weight: Tensor | None = None, eps: Any = None) -> tuple:
    """``F.rms_norm``'s arguments, positional (its signature)."""
    return input, normalized_shape, weight, eps


class Attention(TorchFunctionMode):
    """SDPA on meta routed to the op ``device`` runs (see the module docstring); on ``cuda`` also RMSNorm, to
    its fused kernel (:class:`_FusedRMSNorm`)."""

    def __init__(self, *, device: str) -> None:
        super().__init__()
        assert device in DEVICES, f"device={device!r} not in {DEVICES}"
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.rms_norm and self.device == "cuda":
            norm_args = _rms_norm_args(*args, **kwargs)
            if norm_args[0].device.type == "meta":
                return _FusedRMSNorm.apply(*norm_args)
        if func is not F.scaled_dot_product_attention or len(args) != 3 or kwargs.get("attn_mask") is not None \
                or kwargs.get("dropout_p") or kwargs.get("scale") is not None:
            return func(*args, **kwargs)
        q, k, v = args
        causal = bool(kwargs.get("is_causal"))
        if self.device == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[0]
        if q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[0]
        if q.shape[1] == k.shape[1]:
            return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[0]
        return func(*args, **kwargs)  # float32 grouped-query on CUDA: the math path, as the dispatcher picks


@contextmanager
def device_forward(*, precision: str, device: str, attention: bool = True) -> Iterator[None]:
    """The meta forward of a rank on ``device`` (``cluster.device``) under ``precision`` (``train.precision``):
    the device's attention kernel (``attention=False``: not routed, for a caller that enters
    :class:`Attention` once around several regions) and, under bf16, autocast. Enter it where the ranks
    enter :func:`sdp.core.precision.autocast`: around a training forward and its loss (not the backward),
    and around a whole evaluation (:meth:`sdp.rank.trainer.Trainer` evaluates under it)."""
    assert precision in DTYPES, f"precision={precision!r} not in {tuple(DTYPES)}"
    with ExitStack() as stack:
        if attention:
            stack.enter_context(Attention(device=device))
        if precision != "fp32":  # meta_region: SDP's re-joined weights cast ahead as on the ranks (sdp.subnet.rejoin)
            stack.enter_context(meta_region(dtype=DTYPES[precision]))
            stack.enter_context(Autocast(device=device, dtype=DTYPES[precision]))
        yield
