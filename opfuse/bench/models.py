"""Standard architectures written with torch.nn (no downloads), for the demo, the tests and
the benchmarks: ResNet-50, MobileNetV2, BERT-base encoder, GPT-2 small decoder, ConvNeXt-T,
ViT-B/16 and an MLP. Shapes and layer choices follow the published models; weights are
random (seeded) with BatchNorm statistics that are not the identity."""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


# -- convolutional ----------------------------------------------------------------------------
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + identity)


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        layers, inplanes = [], 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            seq = []
            for i in range(blocks):
                seq.append(Bottleneck(inplanes, planes, stride if i == 0 else 1))
                inplanes = planes * 4
            layers.append(nn.Sequential(*seq))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(2048, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = inp * expand
        self.use_res = stride == 1 and inp == out
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(inp, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(),
            nn.Conv2d(hidden, out, 1, bias=False),
            nn.BatchNorm2d(out),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        cfg = [
            (1, 16, 1, 1),
            (6, 24, 2, 2),
            (6, 32, 3, 2),
            (6, 64, 4, 2),
            (6, 96, 3, 1),
            (6, 160, 3, 2),
            (6, 320, 1, 1),
        ]
        layers: list[nn.Module] = [
            nn.Conv2d(3, 32, 3, 2, 1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU6(),
        ]
        inp = 32
        for t, c, n, s in cfg:
            for i in range(n):
                layers.append(InvertedResidual(inp, c, s if i == 0 else 1, t))
                inp = c
        layers += [nn.Conv2d(inp, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


def _divisible(v: float, d: int = 8) -> int:
    """torchvision's _make_divisible: channels rounded to a multiple of d, never below 90%."""
    new = max(d, int(v + d / 2) // d * d)
    return new + d if new < 0.9 * v else new


class SqueezeExcite(nn.Module):
    """Global average -> 1x1 conv -> ReLU -> 1x1 conv -> hardsigmoid, scaling the input."""

    def __init__(self, c: int) -> None:
        super().__init__()
        squeeze = _divisible(c // 4)
        self.fc1, self.fc2 = nn.Conv2d(c, squeeze, 1), nn.Conv2d(squeeze, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1))))
        return x * F.hardsigmoid(s)


class InvertedResidualV3(nn.Module):
    """MobileNetV3's block: expand, depthwise (3x3 or 5x5), squeeze-and-excite, project."""

    def __init__(self, inp: int, k: int, hidden: int, out: int, se: bool, hs: bool, s: int):
        super().__init__()
        self.use_res = s == 1 and inp == out
        act: type[nn.Module] = nn.Hardswish if hs else nn.ReLU
        layers: list[nn.Module] = []
        if hidden != inp:
            layers += [nn.Conv2d(inp, hidden, 1, bias=False), nn.BatchNorm2d(hidden, 1e-3), act()]
        layers += [
            nn.Conv2d(hidden, hidden, k, s, (k - 1) // 2, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden, 1e-3),
            act(),
        ]
        layers += [SqueezeExcite(hidden)] if se else []
        layers += [nn.Conv2d(hidden, out, 1, bias=False), nn.BatchNorm2d(out, 1e-3)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x) if self.use_res else self.block(x)


class MobileNetV3Large(nn.Module):
    """torchvision's mobilenet_v3_large, written out (no torchvision dependency)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        # (input, kernel, expanded, output, squeeze-excite, hardswish, stride)
        cfg = [
            (16, 3, 16, 16, False, False, 1),
            (16, 3, 64, 24, False, False, 2),
            (24, 3, 72, 24, False, False, 1),
            (24, 5, 72, 40, True, False, 2),
            (40, 5, 120, 40, True, False, 1),
            (40, 5, 120, 40, True, False, 1),
            (40, 3, 240, 80, False, True, 2),
            (80, 3, 200, 80, False, True, 1),
            (80, 3, 184, 80, False, True, 1),
            (80, 3, 184, 80, False, True, 1),
            (80, 3, 480, 112, True, True, 1),
            (112, 3, 672, 112, True, True, 1),
            (112, 5, 672, 160, True, True, 2),
            (160, 5, 960, 160, True, True, 1),
            (160, 5, 960, 160, True, True, 1),
        ]
        layers: list[nn.Module] = [
            nn.Conv2d(3, 16, 3, 2, 1, bias=False),
            nn.BatchNorm2d(16, 1e-3),
            nn.Hardswish(),
        ]
        layers += [InvertedResidualV3(*c) for c in cfg]
        layers += [nn.Conv2d(160, 960, 1, bias=False), nn.BatchNorm2d(960, 1e-3), nn.Hardswish()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(960, 1280), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(1280, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over channels of an NCHW tensor, as ConvNeXt writes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6 * 1e5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXtT(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        dims, depths = (96, 192, 384, 768), (3, 3, 9, 3)
        self.downsample = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6))]
            + [
                nn.Sequential(
                    LayerNorm2d(dims[i], eps=1e-6), nn.Conv2d(dims[i], dims[i + 1], 2, stride=2)
                )
                for i in range(3)
            ]
        )
        self.stages = nn.ModuleList(
            nn.Sequential(*[ConvNeXtBlock(dims[i]) for _ in range(depths[i])]) for i in range(4)
        )
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for down, stage in zip(self.downsample, self.stages):
            x = stage(down(x))
        return self.head(self.norm(x.mean((2, 3))))


# -- transformers ----------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // h))
        if mask is not None:
            scores = scores + mask
        if self.causal:
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(causal, float("-inf"))
        out = scores.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class BertLayer(nn.Module):
    def __init__(self, dim: int = 768, heads: int = 12, hidden: int = 3072) -> None:
        super().__init__()
        self.attn = Attention(dim, heads)
        self.norm1 = nn.LayerNorm(dim, eps=1e-12)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.dropout(self.attn(x, mask)))
        return self.norm2(x + self.dropout(self.fc2(F.gelu(self.fc1(x)))))


class BertEncoder(nn.Module):
    """BERT-base: embeddings and 12 post-norm layers."""

    def __init__(self, layers: int = 12, dim: int = 768, vocab: int = 30522) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(512, dim)
        self.token_type = nn.Embedding(2, dim)
        self.norm = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(dim) for _ in range(layers))

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        pos = torch.arange(s, device=ids.device)
        x = self.norm(self.word(ids) + self.position(pos) + self.token_type(torch.zeros_like(ids)))
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, mask)
        return x


class GPT2Block(nn.Module):
    def __init__(self, dim: int = 768, heads: int = 12) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal=True)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2 small: 12 pre-norm causal layers, LM head tied to the token embedding."""

    def __init__(self, layers: int = 12, dim: int = 768, vocab: int = 50257) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(1024, dim)
        self.blocks = nn.ModuleList(GPT2Block(dim) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x) @ self.wte.weight.t()


class GPT2Decoder(GPT2):
    """GPT-2 with a key/value cache, for generation: `forward(ids, *past)` returns the
    next-token logits of the last position and the cache grown by `ids` (a key and a value
    tensor per layer, [batch, heads, length, head dim]). Same weights as `GPT2`."""

    def forward(self, ids: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        b, s = ids.shape
        start = past[0].shape[2] if past else 0
        pos = torch.arange(start, start + s, device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        cache: list[torch.Tensor] = []
        for i, blk in enumerate(self.blocks):
            assert isinstance(blk, GPT2Block)
            attn = blk.attn
            h, d = attn.heads, x.shape[-1]
            q, k, v = attn.qkv(blk.ln1(x)).view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
            if past:
                k = torch.cat([past[2 * i], k], dim=2)
                v = torch.cat([past[2 * i + 1], v], dim=2)
            cache += [k, v]
            # a prompt attends causally; one new token attends to everything before it
            # (a branch, not is_causal=s > 1: under symbolic sizes that is no bool)
            if not past and s > 1:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v)
            x = x + attn.proj(out.transpose(1, 2).reshape(b, s, d))
            x = x + blk.proj(F.gelu(blk.fc(blk.ln2(x)), approximate="tanh"))
        logits = self.ln_f(x[:, -1:]) @ self.wte.weight.t()
        return (logits, *cache)


def generate(step: Any, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding with `step` (a GPT2Decoder or a compiled one): the prompt, then one
    token at a time on the growing cache."""
    out = step(prompt)
    tokens = [prompt]
    for i in range(new_tokens):
        nxt = out[0][:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
        if i + 1 < new_tokens:
            out = step(nxt, *out[1:])
    return torch.cat(tokens, dim=1)


class ViTBlock(nn.Module):
    def __init__(self, dim: int = 768, heads: int = 12) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViTB16(nn.Module):
    def __init__(self, classes: int = 1000, dim: int = 768, layers: int = 12) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 16, stride=16)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, 197, dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x)[:, 0])


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (1024, 4096, 4096, 1000)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))
        self.norms = nn.ModuleList(nn.LayerNorm(b) for b in sizes[1:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, norm in zip(self.layers[:-1], self.norms):
            x = F.gelu(norm(lin(x)))
        return self.layers[-1](x).softmax(-1)


class ResidualMLPBlock(nn.Module):
    """Pre-norm Transformer MLP block with a softmax head: LayerNorm(x + r), GELU MLP,
    residual add."""

    def __init__(self, dim: int = 768, hidden: int = 3072, classes: int = 1000) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = x + residual
        y = self.fc2(self.act(self.fc1(self.norm(h)))) + h
        return torch.softmax(self.head(y) * 0.5, dim=-1)


def realistic(model: nn.Module, seed: int = 0) -> nn.Module:
    """Eval mode, with BatchNorm statistics that are not the identity (what a trained
    model has): folding then really changes the weights."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
            assert m.running_var is not None
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.75)
    return model.eval()


def zoo() -> dict[str, tuple[type[nn.Module], Any]]:
    """name -> (model class, inputs(batch) factory)."""

    def image(b: int, size: int = 224) -> tuple[torch.Tensor, ...]:
        return (torch.randn(b, 3, size, size, generator=torch.Generator().manual_seed(0)),)

    def tokens(b: int, vocab: int = 30522, s: int = 128) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(0))
        return (ids, torch.ones(b, s, dtype=torch.long))

    return {
        "resnet50": (ResNet50, image),
        "mobilenet_v2": (MobileNetV2, image),
        "mobilenet_v3": (MobileNetV3Large, image),
        "bert_base": (BertEncoder, tokens),
        "gpt2_small": (GPT2, lambda b: (tokens(b, 50257)[0],)),
        "convnext_t": (ConvNeXtT, image),
        "vit_b16": (ViTB16, image),
        "mlp": (MLP, lambda b: (torch.randn(b, 1024, generator=torch.Generator().manual_seed(0)),)),
    }


def build(name: str, batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    cls, inputs = zoo()[name]
    torch.manual_seed(seed)
    return realistic(cls(), seed), inputs(batch)


def demo_model() -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    m = ResidualMLPBlock().eval()
    return m, (torch.randn(256, 768), torch.randn(256, 768))
