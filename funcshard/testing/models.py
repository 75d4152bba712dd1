"""Small reference models for tests and benchmarks: a GPT with a tied head, a BatchNorm CNN,
a stack of feed-forward blocks.

Each is plain PyTorch, the way a user writes it, so the tests compare funcshard against the
module called directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT; the defaults are tiny, for tests (a 14M model is vocab 8192, d 384)."""

    vocab_size: int = 61  # prime: does not divide any world size, like real vocabularies
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32
    tie_embeddings: bool = True
    dropout: float = 0.0  # on each block's two residual branches, in train mode


class CausalSelfAttention(nn.Module):
    """Multi-head attention where each position sees only earlier ones."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    """Position-wise feed-forward layer, 4x wide."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """A pre-norm transformer block: the natural unit of sharding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:
        x = x + self._drop(self.attn(self.ln1(x)))
        return x + self._drop(self.mlp(self.ln2(x)))

    def _drop(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.dropout, self.training) if self.dropout else x


class GPT(nn.Module):
    """A decoder-only language model whose output head shares the token embedding."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        # scaled by d**-0.5: the tied head shares the N(0, 1) embedding, and unscaled logits
        # would start the loss near 60 instead of ln(vocab)
        return self.head(self.ln_f(x)) * self.cfg.d_model**-0.5  # (B, T, vocab)

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Extend `idx` by `max_new_tokens` tokens: greedily at temperature 0 (deterministic,
        for tests), else sampled from softmax(logits / temperature) with `generator`."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])[:, -1]
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = torch.multinomial(probs, 1, generator=generator)
            else:
                token = logits.argmax(-1, keepdim=True)
            idx = torch.cat([idx, token], dim=1)
        return idx


class ConvNet(nn.Module):
    """A small CNN with BatchNorm, whose running statistics change in train mode."""

    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x).flatten(1))


@dataclass(frozen=True)
class MLPStackConfig:
    """Sizes of an `MLPStack`: `n_layer` feed-forward blocks of width `d_model`."""

    d_model: int = 64
    n_layer: int = 32


class MLPBlock(nn.Module):
    """LayerNorm, then a 4x-wide feed-forward layer: a transformer block without attention."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, 4 * d_model)
        self.down = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.relu(self.up(self.norm(x))))


class MLPStack(nn.Module):
    """`n_layer` MLPBlocks in a row, on rows of `d_model` features: many small units, the shape
    where per-unit framework overhead shows most."""

    def __init__(self, cfg: MLPStackConfig = MLPStackConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(MLPBlock(cfg.d_model) for _ in range(cfg.n_layer))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def random_tokens(cfg: GPTConfig, batch: int, seed: int) -> tuple[Tensor, Tensor]:
    """A seeded batch of random token windows for `cfg`: (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def frozen_embedding_gpt(cfg: GPTConfig = GPTConfig()) -> GPT:
    """A GPT whose position embedding is frozen (fine-tuning style)."""
    model = GPT(cfg)
    model.wpe.weight.requires_grad_(False)
    return model


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama-shaped decoder; `llama_7b()` gives the 7B shape (for planning)."""

    vocab_size: int = 257
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    ffn_hidden: int = 172


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    """Attention and a SwiGLU feed-forward layer, each after an RMSNorm."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.attn_norm = RMSNorm(cfg.d_model)
        self.wqkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.wo(y)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """A Llama-shaped language model (untied output head), for planning and tests."""

    def __init__(self, cfg: LlamaConfig = LlamaConfig()) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def llama_7b() -> Llama:
    """The 7B shape (d 4096, 32 layers, 32 heads, SwiGLU 11008, vocab 32000): build it on the
    meta device, e.g. `funcshard plan funcshard.testing.models:llama_7b --world-size 1024`."""
    return Llama(
        LlamaConfig(vocab_size=32000, d_model=4096, n_layer=32, n_head=32, ffn_hidden=11008)
    )
