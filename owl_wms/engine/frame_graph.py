"""A generated frame's model call as one compiled graph (compile on, in-place bf16/int8 rings).

At batch 1 a frame is bound by the host: the per-block path enters compiled code twice per
block and runs the cache's bookkeeping, RoPE and conditioning eagerly around it. Here one call
of the model on one frame (conditioning, every block, each ring's write and read, attention,
the output layer) is one ``torch.compile(fullgraph=True, dynamic=False)`` region, and what
changes from call to call enters it as tensors, so it never recompiles:

- the frame's absolute index: RoPE angles are made from it on the device, in float64
  (angle = index x per-frame step + angle of frame 0), so large positions keep their precision;
- each ring's written and valid frame counts: the slot written (index mod capacity) and the
  slots visible (age below the valid count) follow on the device;
- the soft-forgetting bias, added to every visible slot but the frame's own;
- the conditioning: the timestep and control embeddings and every AdaLN and gate linear are
  made once a frame, for all the sampler's timesteps together (only t changes between the
  calls of a frame), by a second compiled function; the AdaLN and gate linears, which all read
  silu(conditioning), run as one matmul over their packed weights (``ConditioningPack``).

Both calls of a frame write the frame's K/V into the slot the committing call owns (as the
eager in-place ring does); only the host's bookkeeping (counts, slot tags, the int8 tallies)
tells a committed write from a scratch one. The host keeps that bookkeeping exactly as the
eager path does, so prefill, hard cuts, recomputes, snapshots and the other modes share the
one cache. On CUDA the graph is captured by torch.compile's CUDA graphs (mode
"reduce-overhead"), its inputs copied into static buffers; on the CPU it runs under Inductor's
C++ wrapper, int8 rings are decoded by ATen's kernels where Inductor's own int8 loads are slow
(``quant.scaled_decode``), and in bf16 attention is a plain matmul-softmax-matmul
(``attention.matmul_attention``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from ..attention import matmul_attention, sdpa_attention
from ..cache import QuantizedStaticCache
from ..quant import _ring_tensor, eager_division, scaled_decode

CODECS = ("bf16", "int8")  # the default modes: plain or one-pass int8 rings
# Named off the traced line: with kernel profiling (scripts.bench_frame) Inductor's C++ wrapper
# quotes each traced source line in a C++ raw string, which a ')"' in the line would end.
MERGE_HEADS = "b h t d -> b t (h d)"


def frame_graph_blocker(settings, plans, tp) -> str | None:
    """Why a pipeline with these settings and cache plans cannot run the frame graph (None: it can)."""
    if not settings.compile:
        return "compile is off"
    if not settings.frame_graph:
        return "frame_graph is off"
    if tp is not None:
        return "tensor parallelism all-reduces inside the blocks"
    if plans is None:
        return "no KV cache"
    if settings.kv.ring_mode != "inplace":
        return f"ring_mode is {settings.kv.ring_mode}, not inplace"
    if settings.kv.guard:
        return "the ring guard checks every write on the host"
    for p in plans:
        if p.owner != p.layer:
            return "layers share K/V (kv_share)"
        for codec, policy in (p.k, p.v):
            if codec not in CODECS:
                return f"{codec} storage (the graph covers {' and '.join(CODECS)})"
            if codec != "bf16" and (policy.temporal or policy.percentile not in (None, 100)):
                return f"{policy.describe()} scales depend on earlier frames or percentiles"
    return None


class ConditioningPack:
    """The model's AdaLN, gate and output-layer linears (``conditioning_linears``) as one weight
    and bias. They all read silu(conditioning): at batch 1 each is a one-row matmul whose cost
    is the call, 4 a block, so packed they cost one call. The linears' ``.data`` becomes views
    of the pack (their Parameter objects stay): memory is unchanged and in-place updates of the
    weights (a state-dict load) reach the pack. Weights moved or replaced since are packed again
    (``current``)."""

    def __init__(self, linears: list):
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self.weight, self.bias = self._pack()

    def _pointers(self) -> list[int]:
        return [p.data_ptr() for lin in self.linears for p in (lin.weight, lin.bias)]

    def _pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        weight = torch.cat([lin.weight.detach() for lin in self.linears])
        bias = torch.cat([lin.bias.detach() for lin in self.linears])
        for lin, w, b in zip(self.linears, weight.split(self.sizes), bias.split(self.sizes)):
            lin.weight.data, lin.bias.data = w, b
        self._packed = self._pointers()
        return weight, bias

    def current(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed weight and bias, packed again if a linear's weights no longer lie in them."""
        if self._pointers() != self._packed:
            self.weight, self.bias = self._pack()
        return self.weight, self.bias


class FrameGraph:
    """One generated frame's model call as one compiled graph over the pipeline's in-place ring."""

    def __init__(self, core, device: torch.device, dtype: torch.dtype):
        self.core, self.device, self.dtype = core, device, dtype
        cfg = core.config
        self.tpf, self.uncond = cfg.tokens_per_frame, cfg.uncond
        # angle(frame) = frame * step + base: RoPE angles are affine in the frame index
        base = core.rope.angles(0, self.tpf)
        self.rope_base = base.to(device)
        self.rope_step = (core.rope.angles(self.tpf, self.tpf) - base).to(device)
        self.frame = torch.zeros((), dtype=torch.int64, device=device)
        self.bias = torch.zeros((), dtype=torch.float32, device=device)
        self.counts = None  # [layers, 2] int64: each ring's (written, valid) frames, made with the cache
        self.slots = {}  # capacity -> arange(capacity) on the device
        self.pack = ConditioningPack(core.conditioning_linears())
        # SDPA's CPU kernel is slow on a frame's queries in bf16 (see matmul_attention)
        self.attention = matmul_attention if device.type == "cpu" and dtype != torch.float32 else sdpa_attention
        # On the CPU a C++ wrapper makes each graph's kernel and library calls without a Python
        # line each: in a host-bound frame that Python was the largest fixed cost.
        wrapper = {"cpp_wrapper": True} if device.type == "cpu" else {}
        options = {**wrapper, **eager_division()}  # in-graph quantization rounds as the eager codec does
        if device.type == "cuda":
            options["triton.cudagraphs"] = True  # replayed as a CUDA graph (mode "reduce-overhead")
        self.call = torch.compile(self._call, fullgraph=True, dynamic=False, options=options)
        self.conditions = torch.compile(self._conditioning, fullgraph=True, dynamic=False, options=wrapper)
        self.calls = 0
        self._timesteps: dict[tuple, torch.Tensor] = {}

    # -- the graphs ------------------------------------------------------------------------------
    def _conditioning(self, t, mouse, buttons, weight, bias):
        core = self.core
        cond = core.t_embed(t)  # [k, 1, d]: the k timesteps of the frame's calls
        if not self.uncond:
            cond = cond + core.control_embed(mouse, buttons)
        params = F.linear(F.silu(cond), weight, bias).split(self.pack.sizes, dim=-1)  # the pack's order
        blocks, final = [params[i:i + 4] for i in range(0, len(params) - 1, 4)], params[-1]
        return [([tuple(p[i:i + 1] for p in block) for block in blocks], final[i:i + 1]) for i in range(t.shape[0])]

    def _call(self, x, conditioning, frame, counts, bias, rings: list, tallies: list):
        core, tpf = self.core, self.tpf
        b, n, c, h, w = x.shape
        blocks, final = conditioning
        tokens = core.proj_in(rearrange(x, "b n c h w -> b (n h w) c").to(core.proj_in.weight.dtype))
        angles = frame.to(torch.float64) * self.rope_step + self.rope_base
        cos, sin = angles.cos().float(), angles.sin().float()
        new_tallies = []
        for i, block in enumerate(core.transformer.blocks):
            adaln1, gate1, adaln2, gate2 = blocks[i]
            q, k, v = block.attn.project(block.adaln1.modulate(tokens, adaln1), cos, sin)
            written, valid = counts[i, 0], counts[i, 1]
            (k_buf, k_scale, k_work, k_spec), (v_buf, v_scale, v_work, v_spec) = rings[i]
            capacity = k_buf.shape[2]
            slot = torch.remainder(written, capacity).view(1)
            keys, tk, k_decode = self._ring(k, k_buf, k_scale, k_work, k_spec, slot, tallies[i][0])
            values, tv, v_decode = self._ring(v, v_buf, v_scale, v_work, v_spec, slot, tallies[i][1])
            scaled_decode([d for d in (k_decode, v_decode) if d is not None])  # K and V in one call
            new_tallies.append((tk, tv))
            # the frame's own slot has age 0; a slot is visible while its age is below the
            # frames present after this write (the valid ones and this one, at most the ring)
            age = torch.remainder(written - self.slots[capacity], capacity)
            present = torch.clamp(valid + 1, max=capacity)
            add = torch.where(age < present, torch.where(age == 0, torch.zeros_like(bias), bias),
                              torch.full_like(bias, float("-inf")))
            y = self.attention(q, keys, values, add.repeat_interleave(tpf)[None], 1.0 / math.sqrt(q.shape[-1]))
            tokens = tokens + block.gate1.modulate(block.attn.out(rearrange(y, MERGE_HEADS)), gate1)
            tokens = tokens + block.gate2.modulate(block.mlp(block.adaln2.modulate(tokens, adaln2)), gate2)
        out = core.proj_out.modulate(tokens, final)
        return rearrange(out, "b (n h w) c -> b n c h w", n=n, h=h, w=w), new_tallies

    def _ring(self, x, buf, scale, work, spec, slot, tally):
        """This frame's K or V [b, h, tpf, dh] into ring slot ``slot``; the ring as attention will
        read it [b, h, capacity * tpf, dh], the tally, and for a quantized ring what decodes it
        into ``work`` (the caller decodes K and V together)."""
        b, heads, _, dh = x.shape
        frame = x.view(b, heads, 1, self.tpf, dh)
        if spec is None:  # plain ring: attention reads the storage itself
            buf.index_copy_(2, slot, frame)
            return buf.flatten(2, 3), tally, None
        codec, dims, floor = spec
        tally = _ring_tensor(frame, buf, scale, slot, None, tally, codec, dims, floor)
        return work, tally, (buf, scale, work.view(*buf.shape[:-1], -1))

    # -- one call --------------------------------------------------------------------------------
    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor the graph reads, put on the device without waiting for it: from pinned
        memory, asynchronously on CUDA (nothing syncs between a frame's two calls)."""
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def conditioning(self, schedule, mouse, buttons) -> list:
        """Per call of a frame (the sampler's timesteps ``schedule[:-1]``), what its blocks and
        output layer take from the conditioning; ``mouse`` [1, 1, 2], ``buttons`` [1, 1, 11]."""
        t = self._timesteps.get(tuple(schedule))
        if t is None:
            t = torch.tensor(schedule[:-1], dtype=self.dtype).view(-1, 1)
            t = self._timesteps[tuple(schedule)] = t.to(self.device)
        return self.conditions(t, mouse, buttons, *self.pack.current())

    def __call__(self, cache: QuantizedStaticCache, x, conditioning, bias: float, commit: bool) -> torch.Tensor:
        """Velocity [1, 1, c, h, w] of one frame ``x`` under ``conditioning`` (this call's entry of
        ``self.conditioning``); writes the frame into each ring's next slot, and with ``commit``
        makes it part of the history."""
        rings, tallies, counts = [], [], []
        for layer, store in cache.stores.items():
            entry, tally = [], []
            for name, q in zip("kv", cache.quant[layer]):
                if q.quantized:
                    work = cache.work_buffers(store.capacity)[0 if name == "k" else 1]
                    entry.append((store.bufs[name], store.bufs[f"{name}_scale"], work,
                                  (q.codec, q.policy.dims, q.policy.floor)))
                    tally.append(q.tally_tensor(self.device))
                else:
                    entry.append((store.bufs[name], None, None, None))
                    tally.append(None)
            rings.append(entry)
            tallies.append(tally)
            counts.append((store.written, store.length))
            if store.capacity not in self.slots:
                self.slots[store.capacity] = torch.arange(store.capacity, device=self.device)
        if self.counts is None or self.counts.shape[0] != len(counts):
            self.counts = torch.zeros(len(counts), 2, dtype=torch.int64, device=self.device)
        self.counts.copy_(self._upload(torch.tensor(counts, dtype=torch.int64)), non_blocking=True)
        if self.device.type == "cuda":  # CUDA graphs replay over fixed addresses: the mutated buffers are static
            from torch._dynamo import mark_static_address

            for buf in (self.counts, self.frame, self.bias, *(b for entry in rings for ring in entry
                                                              for b in ring[:3] if b is not None)):
                mark_static_address(buf)
        self.frame.fill_(cache.stores[0].written)
        self.bias.fill_(float(bias))
        velocity, new_tallies = self.call(x, conditioning, self.frame, self.counts, self.bias, rings, tallies)
        self.calls += 1
        for layer, layer_tallies in zip(cache.stores, new_tallies):
            cache.ring_frame_written(layer, commit, layer_tallies)
        return velocity
