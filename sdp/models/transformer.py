"""Pre-norm transformer blocks shared by the LLaMA decoder and the ViT, with rotary embeddings.

One :class:`TransformerBlock` serves both: LLaMA is RMSNorm + rotary + causal attention + SwiGLU,
ViT is LayerNorm + bidirectional attention with biases + GELU MLP. q, k and v are separate
projections so that every hidden width SDP may split is a contiguous slice: the MLP hidden units
(``mlp``) and the attention heads (``heads``, ``unit_width = head_dim``). Forward passes read the
number of heads and hidden units off the weight shapes, so a block whose hidden widths were sliced
(neuron-level SDP) runs unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from sdp.models.base import HiddenDim, HiddenSlice, ResidualBlock, split_output


class Rotary(nn.Module):
    """Rotary position embedding (RoFormer), rotate-half convention as in HF/GaLore LLaMA."""

    def __init__(self, *, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        self.head_dim, self.base = head_dim, base
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self._cache: tuple[int, torch.device, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _inv_freq(self, device: torch.device | None = None) -> torch.Tensor:
        exps = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.base**exps)

    def reset_parameters(self) -> None:
        """Recompute the frequencies in place (a module materialised from the meta device)."""
        self.inv_freq.copy_(self._inv_freq(self.inv_freq.device))
        self._cache = None

    def cos_sin(self, *, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._cache
        if c is None or c[0] < seq_len or c[1] != self.inv_freq.device or c[2] != dtype:
            t = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            c = (seq_len, self.inv_freq.device, dtype, emb.cos().to(dtype), emb.sin().to(dtype))
            self._cache = c
        return c[3][:seq_len], c[4][:seq_len]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape (B, heads, T, head_dim) by its positions."""
        cos, sin = self.cos_sin(seq_len=x.shape[-2], dtype=x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Multi-head (optionally grouped-query) attention through ``F.scaled_dot_product_attention``."""

    def __init__(
        self, *, dim: int, n_heads: int, n_kv_heads: int | None = None, bias: bool = False,
        causal: bool = False, rotary_base: float | None = None,
    ) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(f"dim={dim} must be divisible by n_heads={n_heads}, and n_heads by n_kv_heads={n_kv_heads}")
        self.head_dim, self.n_heads, self.n_kv_heads, self.causal = dim // n_heads, n_heads, n_kv_heads, causal
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=bias)
        self.rotary = Rotary(head_dim=self.head_dim, base=rotary_base) if rotary_base else None

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.view(b, n, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """Attention of ``x``; ``scale`` multiplies what the heads produce, not ``wo``'s bias."""
        q, k, v = self._split(self.wq(x)), self._split(self.wk(x)), self._split(self.wv(x))
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=q.shape[1] != k.shape[1])
        return split_output(self.wo, out.transpose(1, 2).flatten(2), scale=scale)

    def head_slices(self) -> tuple[HiddenSlice, ...]:
        """Slices of the head dim (one unit = ``head_dim`` rows of q, k, v and columns of o)."""
        slices = [HiddenSlice(f"{n}.weight", 0) for n in ("wq", "wk", "wv")]
        if self.wq.bias is not None:
            slices += [HiddenSlice(f"{n}.bias", 0) for n in ("wq", "wk", "wv")]
        return tuple(slices) + (HiddenSlice("wo.weight", 1),)


class SwiGLU(nn.Module):
    """LLaMA's MLP: w2(silu(w1 x) * w3 x); hidden units are w1/w3 rows and w2 columns."""

    def __init__(self, *, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """``scale`` multiplies what the hidden units produce, not ``w2``'s bias."""
        return split_output(self.w2, F.silu(self.w1(x)) * self.w3(x), scale=scale)

    def hidden_slices(self) -> tuple[HiddenSlice, ...]:
        rows = tuple(HiddenSlice(f"{n}.{t}", 0) for n in ("w1", "w3") for t in ("weight", "bias")
                     if getattr(getattr(self, n), t) is not None)
        return rows + (HiddenSlice("w2.weight", 1),)


class GeluMLP(nn.Module):
    """ViT's MLP: fc2(gelu(fc1 x)); hidden units are fc1 rows (and bias) and fc2 columns."""

    def __init__(self, *, dim: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """``scale`` multiplies what the hidden units produce, not ``fc2``'s bias."""
        return split_output(self.fc2, F.gelu(self.fc1(x)), scale=scale)

    def hidden_slices(self) -> tuple[HiddenSlice, ...]:
        bias = (HiddenSlice("fc1.bias", 0),) if self.fc1.bias is not None else ()
        return (HiddenSlice("fc1.weight", 0),) + bias + (HiddenSlice("fc2.weight", 1),)


NORMS = {"rms": nn.RMSNorm, "layer": nn.LayerNorm}
MLPS = {"swiglu": SwiGLU, "gelu": GeluMLP}


def prefixed(prefix: str, slices: tuple[HiddenSlice, ...]) -> tuple[HiddenSlice, ...]:
    return tuple(HiddenSlice(f"{prefix}.{s.tensor}", s.dim) for s in slices)


class TransformerBlock(ResidualBlock):
    """h = x + s * attention(norm(x)); out = h + s * mlp(norm(h)). One SDP unit per layer; at neuron
    level each of attention and MLP scales its split units' output only when a hidden dim splits it."""

    def __init__(
        self, *, dim: int, n_heads: int, hidden: int, n_kv_heads: int | None = None, norm: str = "rms",
        mlp: str = "swiglu", bias: bool = False, causal: bool = False, rotary_base: float | None = None,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if norm not in NORMS or mlp not in MLPS:
            raise ValueError(f"norm={norm!r} must be one of {list(NORMS)} and mlp={mlp!r} one of {list(MLPS)}")
        self.attention_norm = NORMS[norm](dim, eps=norm_eps)
        self.attention = Attention(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, bias=bias, causal=causal,
                                   rotary_base=rotary_base)
        self.ffn_norm = NORMS[norm](dim, eps=norm_eps)
        self.feed_forward = MLPS[mlp](dim=dim, hidden=hidden, bias=bias)

    def forward_full(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.gain("attention") * self.attention(self.attention_norm(x), scale=self.scale_of("attention"))
        return h + self.gain("feed_forward") * self.feed_forward(self.ffn_norm(h), scale=self.scale_of("feed_forward"))

    def gated_branches(self) -> dict[str, tuple[str, ...]]:
        """Attention ends in ``wo``, the MLP in ``w2`` (SwiGLU) or ``fc2`` (GELU): their weight and bias."""
        ff = self.feed_forward
        last = {"attention": ("attention.wo", self.attention.wo),
                "feed_forward": ("feed_forward.w2", ff.w2) if isinstance(ff, SwiGLU) else ("feed_forward.fc2", ff.fc2)}
        return {b: (f"{n}.weight",) + ((f"{n}.bias",) if layer.bias is not None else ()) for b, (n, layer) in last.items()}

    def hidden_dims(self) -> tuple[HiddenDim, ...]:
        """MLP hidden units; attention heads too unless grouped-query attention ties q heads to kv heads
        (then a unit would be n_rep q heads but one kv head: widths differ between slices, and attention
        stays whole on every holder: neither narrowed nor rescaled)."""
        ff = self.feed_forward
        hidden = ff.w1.out_features if isinstance(ff, SwiGLU) else ff.fc1.out_features
        dims = [HiddenDim(name="mlp", size=hidden, slices=prefixed("feed_forward", ff.hidden_slices()),
                          branch="feed_forward")]
        att = self.attention
        if att.n_kv_heads == att.n_heads:
            dims.append(HiddenDim(name="heads", size=att.n_heads, unit_width=att.head_dim,
                                  slices=prefixed("attention", att.head_slices()), branch="attention"))
        return tuple(dims)
