"""LLaMA-style decoder: token embedding -> decoder layers (SDP units) -> RMSNorm + LM head.

The architecture of the LLaMA configs used by GaLore/ReLoRA-style pre-training studies (HF
``LlamaForCausalLM``): RMSNorm (eps 1e-6), rotary embeddings, SwiGLU MLP, no biases, untied
embeddings by default, N(0, 0.02) initialisation. Optional grouped-query attention (``n_kv_heads``)
and weight tying. Each decoder layer is one SDP unit (its RMSNorm weights move with it); embedding,
final norm and LM head are shared. ``task = "lm"``: logits (B, T, vocab), targets (B, T).
"""

from __future__ import annotations

import torch
from torch import nn

from sdp.models.base import SDPModel
from sdp.models.transformer import TransformerBlock


class LMHead(nn.Module):
    """Final RMSNorm and the vocabulary projection."""

    def __init__(self, *, dim: int, vocab_size: int, norm_eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.output(self.norm(x))


class LLaMA(SDPModel):
    """Decoder-only LM; ``max_seq_len`` only sizes ``example_input`` (and so the FLOPs of one sample)."""

    task = "lm"

    def __init__(
        self,
        *,
        vocab_size: int,
        dim: int,
        n_layers: int,
        n_heads: int,
        hidden: int,
        max_seq_len: int,
        n_kv_heads: int | None = None,
        tie_embeddings: bool = False,
        rope_base: float = 10000.0,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.vocab_size, self.dim, self.max_seq_len = vocab_size, dim, max_seq_len
        self.stem = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(
            TransformerBlock(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, hidden=hidden, norm="rms",
                             mlp="swiglu", bias=False, causal=True, rotary_base=rope_base, norm_eps=norm_eps)
            for _ in range(n_layers)
        )
        self.head = LMHead(dim=dim, vocab_size=vocab_size, norm_eps=norm_eps)
        self.init_std = init_std
        self.apply(self._init)
        if tie_embeddings:
            self.head.output.weight = self.stem.weight

    def _init(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.init_std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def init_module(self, module: nn.Module) -> bool:
        self._init(module)
        return isinstance(module, (nn.Linear, nn.Embedding))

    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, self.max_seq_len, dtype=torch.long, device=self.stem.weight.device)
