"""GameRFT: the original world-model DiT, with the original state-dict names (docs/architecture.md, The model)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .attention import BACKENDS, RING_KERNELS, Attention, history_bias_mask
from .config import ModelConfig
from .controls import N_BUTTONS
from .rope import make_rope


class SinCos(nn.Module):
    """[sin(x*mult*f_k) ..., cos(x*mult*f_k) ...] with f_k = theta^(-k/(half-1))."""

    def __init__(self, dim: int, theta: float = 300.0, mult: float = 1000.0):
        super().__init__()
        self.half, self.theta, self.mult = dim // 2, theta, mult

    def forward(self, x):
        # Frequencies are built in float32 on every call (no buffer), so casting the model to
        # bf16 cannot round them.
        k = torch.arange(self.half, device=x.device, dtype=torch.float32)
        freqs = torch.exp(-k * math.log(self.theta) / (self.half - 1))
        arg = (x.float() * self.mult)[..., None] * freqs
        return torch.cat([arg.sin(), arg.cos()], dim=-1)


class MLP(nn.Module):
    def __init__(self, d_in: int, d_hidden: int, d_out: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, d_hidden), nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(x)))


class TimestepEmbedding(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.sincos = SinCos(512)
        self.mlp = MLP(512, 4 * d, d)

    def forward(self, t):
        return self.mlp(self.sincos(t).to(self.mlp.fc1.weight.dtype))


class MouseEmbedding(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.angle_proj = nn.Linear(2, 256, bias=False)
        self.sincos = SinCos(256)
        self.mlp = MLP(512, 2048, d)

    def forward(self, mouse):
        m = mouse.float()
        m = m.sign() * torch.log1p(m.abs())  # symlog per axis
        angle = torch.atan2(m[..., 1], m[..., 0])
        magnitude = m.norm(dim=-1)
        dtype = self.angle_proj.weight.dtype
        a = self.angle_proj(torch.stack([angle.cos(), angle.sin()], dim=-1).to(dtype))
        return self.mlp(torch.cat([a, self.sincos(magnitude).to(dtype)], dim=-1))


class SmoothMouseEmbedding(nn.Module):
    """The mouse conditioning of worlds trained here (``mouse_embed: smooth``), not the original's.

    The original feeds the mouse's symlog magnitude through sin/cos features at multiplier 1000,
    so rates a unit apart get unrelated features and a world must learn each rate on its own.
    Here a small MLP reads the rate itself (scaled) and its symlog: nearby rates give nearby
    embeddings, and a turn's strength is a direction the network can scale."""

    def __init__(self, d: int, hidden: int = 512, scale: float = 8.0):
        super().__init__()
        self.scale = scale
        self.mlp = MLP(4, hidden, d)

    def forward(self, mouse):
        m = mouse.float()
        features = torch.cat([m / self.scale, m.sign() * torch.log1p(m.abs())], dim=-1)
        return self.mlp(features.to(self.mlp.fc1.weight.dtype))


class ButtonEmbedding(nn.Module):
    def __init__(self, d: int, n_buttons: int = N_BUTTONS):
        super().__init__()
        self.proj = MLP(n_buttons, 2048, d)

    def forward(self, buttons):
        return self.proj((buttons.to(self.proj.fc1.weight.dtype) * 2) - 1)


class ControlEmbedding(nn.Module):
    def __init__(self, d: int, n_buttons: int = N_BUTTONS, mouse_embed: str = "sincos"):
        super().__init__()
        self.mouse = SmoothMouseEmbedding(d) if mouse_embed == "smooth" else MouseEmbedding(d)
        self.button = ButtonEmbedding(d, n_buttons)

    def forward(self, mouse, buttons):
        return self.mouse(mouse) + self.button(buttons)


def per_frame(x, n_frames):
    """View tokens [b, n*tpf, d] as [b, n, tpf, d] so per-frame conditioning broadcasts."""
    return x.view(x.shape[0], n_frames, -1, x.shape[-1])


class AdaLN(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, 2 * d)

    def params(self, cond):
        """Scale and shift [b, n, 2d] of the conditioning ``cond`` [b, n, d]."""
        return self.fc(F.silu(cond))

    def modulate(self, x, params):
        a, b = params.unsqueeze(2).chunk(2, dim=-1)
        y = F.rms_norm(per_frame(x, params.shape[1]), (x.shape[-1],)) * (1 + a) + b
        return y.view_as(x)


class Gate(nn.Module):
    """The gate [b, n, d] of the conditioning is ``fc_c(silu(cond))`` (``Transformer.modulations``)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc_c = nn.Linear(d, d)

    def modulate(self, x, params):
        return (params.unsqueeze(2) * per_frame(x, params.shape[1])).view_as(x)


class DiTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d = cfg.d_model
        self.adaln1, self.adaln2 = AdaLN(d), AdaLN(d)
        self.gate1, self.gate2 = Gate(d), Gate(d)
        self.attn = Attention(d, cfg.n_heads, layer, cfg.tokens_per_frame, cfg.layer_window(layer),
                              cfg.decode_window(layer))
        self.mlp = MLP(d, 4 * d, d)

    def modulation_linears(self) -> tuple[nn.Linear, ...]:
        """The projections of the conditioning, in the order of ``forward``'s ``mods``."""
        return self.adaln1.fc, self.gate1.fc_c, self.adaln2.fc, self.gate2.fc_c

    # The block is split around the cache: the two halves are pure tensor code (what
    # torch.compile sees), the cache read/write between them stays eager.
    def pre_attention(self, x, mods, cos, sin):
        return self.attn.project(self.adaln1.modulate(x, mods[0]), cos, sin)

    def pre_attention_q(self, x, mods, cos, sin):
        return self.attn.project_q(self.adaln1.modulate(x, mods[0]), cos, sin)

    def post_attention(self, x, mods, q, k, v, mask, window: int | None, backend: str):
        x = x + self.gate1.modulate(self.attn.attend_out(q, k, v, window, backend, mask), mods[1])
        return x + self.gate2.modulate(self.mlp(self.adaln2.modulate(x, mods[2])), mods[3])

    def forward(self, x, mods, rope, kv_cache, backend, window_cap, bias: float | tuple = 0.0,
                decode_from: int | None = None):
        """``mods``: this block's AdaLN and gate parameters of the conditioning (``Transformer.modulations``)."""
        # Compiled halves serve a generated frame's calls; a history (prefill, hard cut, recompute)
        # runs eagerly, as the one-graph frame call leaves it: a graph per history length would be
        # a compile for a call made once a cut. Training's windows, one shape every step, take
        # them too (compile_halves(histories=True)).
        compiled = x.shape[1] <= self.attn.tpf or self.compiled_histories
        pre, pre_q, post = ((self._pre, self._pre_q, self._post) if compiled
                            else (self.pre_attention, self.pre_attention_q, self.post_attention))
        if kv_cache is not None and kv_cache.borrows(self.attn.layer):
            # Cross-layer sharing: this layer reads its group owner's K/V and computes only Q.
            q = pre_q(x, mods, *rope)
            k, v, mask = kv_cache.attend_window(self.attn.layer)
            if mask is not None:  # a frame over the ring, under this layer's window
                return post(x, mods, q, k, v, mask, None, "ring")
        elif kv_cache is not None and kv_cache.on_device:
            # A frame's ring mask carries each row's bias (a tensor: no host value in the call); a
            # history's keys come in time order and take the rule and the bias below.
            q, k, v = pre(x, mods, *rope)
            k, v, mask = kv_cache.attend_window(self.attn.layer, k, v)
            if mask is not None:
                return post(x, mods, q, k, v, mask, None, "ring")
        else:
            q, k, v = pre(x, mods, *rope)
            k, v, mask = self.attn.with_cache(k, v, kv_cache)
        window = self.attn.effective_window(window_cap, mods[0].shape[1], decode_from)
        if bias:  # soft forgetting: an additive mask replaces the boolean rule (zero bias: untouched)
            tpf = self.attn.tpf
            bias = tuple(map(float, bias)) if isinstance(bias, tuple) else float(bias)
            mask = history_bias_mask(q.shape[2] // tpf, k.shape[2] // tpf, tpf, window, bias, q.dtype, str(q.device))
        return post(x, mods, q, k, v, mask, window, backend)

    _pre = pre_attention
    _pre_q = pre_attention_q
    _post = post_attention
    compiled_histories = False

    def compile_halves(self, histories: bool = False, **kwargs):
        self._pre = torch.compile(self.pre_attention, **kwargs)
        self._pre_q = torch.compile(self.pre_attention_q, **kwargs)
        self._post = torch.compile(self.post_attention, **kwargs)
        self.compiled_histories = histories


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.blocks = nn.ModuleList(DiTBlock(cfg, i) for i in range(cfg.n_layers))
        self.backend, self.decode_backend = "sdpa", "sdpa"
        self.decoding = False
        # Every block's conditioning projections as one weight (fuse_modulations); None: apart.
        self.register_buffer("modulation_weight", None, persistent=False)
        self.register_buffer("modulation_bias", None, persistent=False)
        self.modulation_sizes: tuple[int, ...] = ()  # each projection's share of the fused output

    def fuse_modulations(self) -> None:
        """Store every block's AdaLN and gate projections in one weight and bias, which each
        projection's parameters then view (a weight load or update writes into it), so that
        ``modulations`` is one matmul. The same numbers as apart: each output is the same dot
        product. For inference on the CPU, where a frame's 4-per-block matmuls of one row each
        cost more in calls than in arithmetic (scripts/bench_frame.py)."""
        linears = [fc for block in self.blocks for fc in block.modulation_linears()]
        if self.modulation_weight is not None and all(
                fc.weight.untyped_storage().data_ptr() == self.modulation_weight.untyped_storage().data_ptr()
                for fc in linears):
            return  # fused already (a model another pipeline placed and fused)
        weight, bias = torch.cat([fc.weight.detach() for fc in linears]), torch.cat([fc.bias.detach() for fc in linears])
        start = 0
        for fc in linears:
            rows = slice(start, start + fc.out_features)
            fc.weight = nn.Parameter(weight[rows], requires_grad=fc.weight.requires_grad)
            fc.bias = nn.Parameter(bias[rows], requires_grad=fc.bias.requires_grad)
            start = rows.stop
        self.modulation_weight, self.modulation_bias = weight, bias
        self.modulation_sizes = tuple(fc.out_features for fc in linears)

    def modulations(self, cond) -> list[tuple[torch.Tensor, ...]]:
        """Each block's (adaln1, gate1, adaln2, gate2) parameters [b, n, *] of ``cond`` [b, n, d]."""
        cond = F.silu(cond)
        if self.modulation_weight is None:
            return [tuple(fc(cond) for fc in block.modulation_linears()) for block in self.blocks]
        parts = F.linear(cond, self.modulation_weight, self.modulation_bias).split(self.modulation_sizes, dim=-1)
        return [parts[i:i + 4] for i in range(0, len(parts), 4)]

    # The original's call sequence toggles these around prefill/decode. Decoding, a frame read
    # over a cache sees it without the frame mask (global layers: every cached frame; local
    # layers: their last local_window), and the decode backend runs.
    def enable_decoding(self):
        self.decoding = True

    def disable_decoding(self):
        self.decoding = False

    def set_backends(self, prefill: str, decode: str, ring: str = "sdpa"):
        """Attention of prefill and of decoded frames (``BACKENDS``), and the kernel of a frame
        over a ring read in place (``RING_KERNELS``)."""
        for b in (prefill, decode):
            if b not in BACKENDS:
                raise ValueError(f"attention backend {b!r} is not one of {BACKENDS}")
        if ring not in RING_KERNELS:
            raise ValueError(f"ring attention kernel {ring!r} is not one of {tuple(RING_KERNELS)}")
        self.backend, self.decode_backend = prefill, decode
        for block in self.blocks:
            block.attn.ring_kernel = ring

    def compile(self, histories: bool = False, **kwargs):
        """torch.compile each block's cache-free halves (state-dict names are unchanged), which a
        generated frame's calls take; ``histories``: calls over many frames too (training)."""
        for block in self.blocks:
            block.compile_halves(histories, **kwargs)

    def forward(self, x, cond, rope, kv_cache=None, window_cap=None, bias: float | tuple = 0.0,
                decode_from: int | None = None):
        mods = self.modulations(cond)
        if kv_cache is not None and kv_cache.in_place and cond.shape[1] == 1:
            # A frame over the ring: its mask holds the whole rule (the switch is not read, so a
            # compiled frame call does not depend on it).
            for block, m in zip(self.blocks, mods):
                x = block(x, m, rope, kv_cache, "ring", window_cap, bias)
            return x
        backend = self.decode_backend if self.decoding else self.backend
        if decode_from is None and self.decoding and kv_cache is not None:
            decode_from = 0  # a cache-free call keeps the frame mask unless told otherwise
        for block, m in zip(self.blocks, mods):
            x = block(x, m, rope, kv_cache, backend, window_cap, bias, decode_from)
        return x


class FinalLayer(nn.Module):
    def __init__(self, d: int, channels: int):
        super().__init__()
        self.norm = AdaLN(d)
        self.proj = nn.Linear(d, channels)

    def params(self, cond):
        return self.norm.params(cond)

    def modulate(self, x, params):
        return self.proj(F.silu(self.norm.modulate(x, params)))

    def forward(self, x, cond):
        return self.modulate(x, self.params(cond))


class GameRFTCore(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        d = config.d_model
        self.proj_in = nn.Linear(config.channels, d, bias=False)
        self.t_embed = TimestepEmbedding(d)
        if not config.uncond:  # an unconditional original has no control weights
            self.control_embed = ControlEmbedding(d, config.n_buttons, config.mouse_embed)
        self.transformer = Transformer(config)
        self.proj_out = FinalLayer(d, config.channels)
        self.rope = make_rope(config)

    def check_inputs(self, x, t, mouse, button):
        c, s = self.config.channels, self.config.sample_size
        if x.ndim != 5 or tuple(x.shape[2:]) != (c, s, s):
            raise ValueError(f"x has shape {tuple(x.shape)}; expected [batch, frames, {c}, {s}, {s}]")
        b, n = x.shape[:2]
        for name, val, tail in (("t", t, ()), ("mouse", mouse, (2,)), ("button", button, (self.config.n_buttons,))):
            if val is not None and tuple(val.shape) != (b, n, *tail):
                raise ValueError(f"{name} has shape {tuple(val.shape)}; expected {[b, n, *tail]} to match x")

    def forward(self, x, t, mouse=None, button=None, kv_cache=None, frame_offset: int = 0,
                window_cap: int | None = None, attn_bias: float | tuple = 0.0, decode_from: int | None = None):
        """x [b,n,c,h,w], t [b,n], mouse [b,n,2], button [b,n,11] -> velocity [b,n,c,h,w].

        With a cache, positions continue from the cache's token offset; without one they
        start at ``frame_offset``. ``window_cap`` limits every layer's look-back (frames).
        ``attn_bias`` is added to the attention logits of keys from earlier frames (the
        cached history), never to the query frame's own keys; 0 leaves attention untouched; a
        tuple gives each query frame its own.
        ``decode_from``: frames from this index on attend as decoded frames (no frame mask on
        global layers, see ModelConfig.decode_window), earlier ones under the frame mask; None:
        over a cache, the transformer's decoding switch decides for all frames, without one the
        frame mask holds.
        """
        self.check_inputs(x, t, mouse, button)
        b, n, c, h, w = x.shape
        cond = self.t_embed(t)
        if mouse is not None and button is not None and not self.config.uncond:
            cond = cond + self.control_embed(mouse, button)
        tokens = self.proj_in(rearrange(x, "b n c h w -> b (n h w) c").to(self.proj_in.weight.dtype))
        if kv_cache is not None and kv_cache.on_device:  # positions are tensors on the device
            rope = self.rope.frame_cos_sin(kv_cache.next_frame(), n)
        else:
            offset = kv_cache.get_offset(0) if kv_cache is not None else frame_offset * self.config.tokens_per_frame
            rope = self.rope.cos_sin(offset, tokens.shape[1], x.device)
        tokens = self.transformer(tokens, cond, rope, kv_cache, window_cap, attn_bias, decode_from)
        if kv_cache is not None and kv_cache.on_device:
            kv_cache.advance(n)
        out = self.proj_out(tokens, cond)
        return rearrange(out, "b (n h w) c -> b n c h w", n=n, h=h, w=w)


class GameRFT(nn.Module):
    """Wrapper with the original's ``core`` attribute (checkpoints name weights ``core.*``)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.core = GameRFTCore(config)

    def forward(self, *args, **kwargs):
        return self.core(*args, **kwargs)
