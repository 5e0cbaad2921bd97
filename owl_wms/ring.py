"""The in-place ring KV cache with its state in tensors, one row per session.

Per layer (``RingLayer``), K and V live in frame slots ``[rows, heads, C, tpf, dh/pack]`` (with
their scales in the same slots) and each row's state is a tensor on the model's device:
``written`` (frames written since the row's last reset: the absolute frame index of the next
frame, hence its RoPE position, and the history's length) and ``epoch`` (+1 at every reset).
Frame f lives in slot f mod C. Because nothing about a call is a host value, the model as
written runs over it eagerly or as one compiled graph, and rows at different positions
(sessions with their own histories) run in one batched call.

A generated frame (one frame a row) is written into its slot, and attention reads the whole
ring in place under a mask made on the device from the absolute frame each slot holds
(``frame_visible``: the one visibility rule) with the soft-forgetting bias on history keys. A
call that does not commit (the sampler's first step) writes the same slot as the committing
one; only the counter tells them apart. The slot a frame overwrites held the frame C before
it, which no query of the layer sees any more, so nothing else needs tracking. A multi-frame
call (a history after a reset) attends over its own frames in time order and writes the last
C into the ring.

The pointer layout is the same ring read in time order: each frame's call gathers the history
its layers can see and its own frame, oldest first, from the decoded ring (``time_order``; one
session, eager), so attention applies the frame rule to time-ordered keys as over the original's
slab.

Every in-place mode lives here: any codec, scales from the frame alone (amax or a percentile)
or with memory (per-head running max or EMA, smoothing: each row's last committed scale is a
tensor, followed only where the row commits), layers that read their group owner's ring
(kv_share, each under its own window), and the guard (``guard``: slot tags and frame counts
checked after every eager write; ``checksum:N``: the first N frames compared with a float32
shadow cache).
"""
from __future__ import annotations

import torch

from .attention import frame_visible
from .cache import LayerPlan, QuantizedStaticCache, RingGuardError, StaticCache, checksum_report, plan_layers
from .quant import (Codec, ScalePolicy, _int4_unpack, _quantize, _scale_and_quantize, make_codec, scaled_decode,
                    stored_scale)
from .settings import KVSettings


def ring_blocker(plans: list[LayerPlan] | None, ring_mode: str) -> str | None:
    """Why a frame's call over these cache plans cannot be one graph, nor a batch of sessions
    (None: the in-place ring reads in place under a mask made on the device)."""
    if plans is None:
        return "no KV cache"
    if ring_mode == "pointer":
        return "the pointer layout gathers each frame's history in time order, its length read on the host"
    if ring_mode != "inplace":
        return f"ring_mode is {ring_mode}, not inplace (the original's slab, rolled on the host)"
    return None


class RingTensor:
    """K or V of one layer: stored frames, their scales (quantized codecs) and, for a quantized
    codec, the decoded ring attention reads, kept decoded slot by slot as frames are written."""

    def __init__(self, codec: Codec, policy: ScalePolicy, shape: tuple, dtype: torch.dtype, device, tensors=None):
        self.codec, self.policy, self.dtype = codec, policy, dtype
        self.quantized = codec.qmax is not None
        self.temporal = self.quantized and policy.temporal  # scales follow the row's last committed one
        if tensors is not None:  # a view of some rows of another ring
            self.data, self.scale, self.work, self.prev, self.has_prev = tensors
            return
        rows, heads, capacity, tpf, dh = shape
        stored = (rows, heads, capacity, tpf, codec.stored_dim(dh))
        self.data = torch.zeros(stored, dtype=codec.storage_dtype(dtype), device=device)
        self.scale = self.work = self.prev = self.has_prev = None
        if self.quantized:
            self.scale = torch.zeros((rows, heads, capacity, *policy.scale_shape(tpf, dh)), dtype=dtype, device=device)
            self.work = torch.zeros((rows, heads, capacity * tpf, dh), dtype=dtype, device=device)
        if self.temporal:
            self.prev = torch.zeros((rows, heads, 1, *policy.scale_shape(tpf, dh)), device=device)
            self.has_prev = torch.zeros(rows, dtype=torch.bool, device=device)

    def rows(self, index: slice) -> "RingTensor":
        return RingTensor(self.codec, self.policy, (), self.dtype, None,
                          tuple(None if t is None else t[index]
                                for t in (self.data, self.scale, self.work, self.prev, self.has_prev)))

    def encode(self, frames: torch.Tensor, commit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Frames [b, h, n, tpf, dh] as stored (and their scales); ``commit`` [b]: the rows whose
        frames enter the history (their scales become the ones later frames follow)."""
        p = self.policy
        if not self.quantized:
            return frames.to(self.data.dtype), None
        if not p.temporal and p.percentile in (None, 100):  # amax of the frame: one pass
            scale, q, _ = _scale_and_quantize(frames, self.codec, p.dims, p.floor, self.dtype, False)
            return q, scale
        xf = frames.float()
        raw = p.reduce(xf) / self.codec.qmax
        scale = stored_scale(self._follow(raw, commit) if p.temporal else raw.clamp_min(p.floor), self.dtype)
        q, _ = _quantize(xf, scale, self.codec, False, p.clips)
        return q, scale.to(self.dtype)

    def _follow(self, raw: torch.Tensor, commit: torch.Tensor) -> torch.Tensor:
        """Scales with memory, frame by frame: per head the running max or EMA of the last scale,
        and smoothing's floor of a share of it, where the row has a last scale."""
        p, prev, valid = self.policy, self.prev, self.has_prev[:, None, None, None, None]
        out = []
        for i in range(raw.shape[2]):
            s = follow = raw[:, :, i:i + 1]
            if p.granularity == "head":
                follow = torch.maximum(follow, prev) if p.ema is None else p.ema * prev + (1 - p.ema) * follow
            if p.smooth:
                follow = torch.maximum(follow, p.smooth * prev)
            s = torch.where(valid, follow, s).clamp_min(p.floor)
            out.append(s)
            prev, valid = s, torch.ones_like(valid)
        self.prev.copy_(torch.where(commit[:, None, None, None, None], prev, self.prev))
        self.has_prev |= commit
        return torch.cat(out, dim=2)

    def restart(self) -> None:
        """A reset row follows no earlier scale."""
        if self.temporal:
            self.has_prev.zero_()

    def decode(self, q: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        if not self.quantized:
            return q
        if out is None:
            out = torch.empty((*q.shape[:-1], q.shape[-1] * self.codec.pack), dtype=self.dtype, device=q.device)
        if self.codec.pack == 2:
            _int4_unpack(q, scale, out)
        else:  # int8 and float8: a cast and one multiply (int8 by the kernel route this CPU runs fastest)
            scaled_decode([(q, scale, out)])
        return out

    def put(self, rows: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None,
            decoded: torch.Tensor | None = None):
        """Stored frames ``q`` [b, h, n, ...] into ``slots`` [b, n] of ``rows`` [b, 1]; a quantized
        ring's decoded copy takes their decoded values (``decoded`` where the caller has them) in
        the same slots: each slot is decoded once, when written, not at every read."""
        self.data[rows, :, slots] = q.transpose(1, 2)
        if scale is not None:
            self.scale[rows, :, slots] = scale.transpose(1, 2)
            decoded = self.decode(q, scale) if decoded is None else decoded
            self._slots_of_work()[rows, :, slots] = decoded.transpose(1, 2)

    def _slots_of_work(self) -> torch.Tensor:
        """The decoded ring [rows, h, C, tpf, dh] (a view of ``work``)."""
        return self.work.view(*self.data.shape[:-1], -1)

    def redecode(self) -> None:
        """The decoded copy made again from the stored frames (after they were loaded)."""
        if self.quantized:
            self.decode(self.data, self.scale, self._slots_of_work())

    def ring(self) -> torch.Tensor:
        """The whole ring as attention reads it: [rows, h, C * tpf, dh]."""
        return self.work if self.quantized else self.data.flatten(2, 3)

    def state(self) -> dict[str, torch.Tensor]:
        """What a snapshot keeps: stored frames, scales, the temporal scale state."""
        names = ("data", "scale", "prev", "has_prev")
        return {n: t for n, t in zip(names, (self.data, self.scale, self.prev, self.has_prev)) if t is not None}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale) if t is not None)

    def scale_nbytes(self) -> int:
        return 0 if self.scale is None else self.scale.numel() * self.scale.element_size()


class RingLayer:
    """One owner layer's ring: K and V in ``capacity`` frame slots; frame f lives in slot f mod C.
    ``tags`` (the guard): the absolute frame each slot holds, written with the same index."""

    def __init__(self, plan: LayerPlan, rows: int, heads: int, tpf: int, head_dim: int, dtype, device, views=None,
                 tags: bool = False):
        self.plan, self.capacity, self.window, self.tpf = plan, plan.capacity, plan.window, tpf
        if views is not None:
            self.k, self.v, self.tags = views
            return
        shape = (rows, heads, plan.capacity, tpf, head_dim)
        self.k = RingTensor(make_codec(plan.k[0]), plan.k[1], shape, dtype, device)
        self.v = RingTensor(make_codec(plan.v[0]), plan.v[1], shape, dtype, device)
        self.tags = torch.full((rows, plan.capacity), -1, dtype=torch.int64, device=device) if tags else None

    def rows(self, index: slice) -> "RingLayer":
        return RingLayer(self.plan, 0, 0, self.tpf, 0, None, None,
                         (self.k.rows(index), self.v.rows(index), None if self.tags is None else self.tags[index]))

    def write(self, k: torch.Tensor, v: torch.Tensor, written: torch.Tensor, commit: torch.Tensor):
        """This call's K/V [b, h, n*tpf, dh] into the slots of frames written[b] + 0..n-1 (the
        last C of them); returns what attention reads of this call's frames: (keys, values) as
        stored and decoded, in time order."""
        b, heads, tokens, dh = k.shape
        n = tokens // self.tpf
        stored = [ring.encode(x.view(b, heads, n, self.tpf, dh), commit) for ring, x in zip((self.k, self.v), (k, v))]
        m = min(n, self.capacity)
        frames = written[:, None] + (n - m) + torch.arange(m, device=k.device)
        slots = torch.remainder(frames, self.capacity)
        rows = torch.arange(b, device=k.device)[:, None]
        # a history's frames are decoded once: attention reads them, the ring keeps the last C
        decoded = [None, None] if n == 1 else [ring.decode(q, scale) for ring, (q, scale) in zip((self.k, self.v), stored)]
        for ring, (q, scale), d in zip((self.k, self.v), stored, decoded):
            ring.put(rows, slots, q[:, :, n - m:], None if scale is None else scale[:, :, n - m:],
                     None if d is None else d[:, :, n - m:])
        if self.tags is not None:
            self.tags[rows, slots] = frames
        return None if n == 1 else [d.flatten(2, 3) for d in decoded]

    def ring(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.ring(), self.v.ring()

    def tokens(self, frames: torch.Tensor) -> torch.Tensor:
        """Indices into ``ring()``'s token axis of absolute ``frames`` (in their order)."""
        slots = torch.remainder(frames, self.capacity)
        return (slots[:, None] * self.tpf + torch.arange(self.tpf, device=frames.device)).flatten()

    def mask(self, written: torch.Tensor, bias: torch.Tensor, slots: torch.Tensor, window: int) -> torch.Tensor:
        """Additive mask [b, 1, 1, C*tpf] of a frame at index written[b] over the ring after its
        write, for a layer that sees ``window`` frames: the frame rule on the absolute frame each
        slot holds (slots never written hold frames below 0), the bias on history keys, 0 on the
        frame's own."""
        age = torch.remainder(written[:, None] - slots, self.capacity)  # [b, C]; 0: this frame
        key = written[:, None] - age
        visible = frame_visible(written[:, None], key, window) & (key >= 0)
        history = torch.where(age == 0, torch.zeros_like(bias)[:, None], bias[:, None])
        add = torch.where(visible, history, torch.full_like(history, float("-inf")))
        return add.repeat_interleave(self.tpf, dim=1)[:, None, None]

    def check_tags(self, top: int, layer: int) -> None:
        """The guard: row 0's slots hold the frames below ``top`` they should (f in slot f mod C)."""
        c = self.capacity
        slots = torch.arange(c, device=self.tags.device)
        expect = top - 1 - torch.remainder(top - 1 - slots, c)
        valid = expect >= max(0, top - c)
        bad = (self.tags[0] != expect) & valid
        if bool(bad.any()):
            slot = int(bad.nonzero()[0, 0])
            raise RingGuardError(f"layer {layer}: slot {slot} holds frame {int(self.tags[0, slot])}, expected frame "
                                 f"{int(expect[slot])} (its tokens' frame): the ring's slots moved apart")


def capturing(device: torch.device) -> bool:
    """A CUDA graph is being captured on ``device``'s current stream (no host read may happen)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class RingCache:
    """The tensor-state ring of every layer, ``rows`` sessions deep. Each row's state is one
    tensor: ``written`` [rows], the frames written since the row's reset. Every call writes every
    owner layer, so it is at once the next frame's absolute index (its RoPE position) and the
    history's length (layer l holds the last min(written, C_l) frames). ``commit`` [rows] says which
    rows' calls enter the history (the sampler's last step: the others leave ``written`` as it was,
    so the next call overwrites the same slots), ``bias`` [rows] their soft-forgetting bias,
    ``epoch`` [rows] counts resets. ``rows(i, j)`` is a view of rows i..j-1 (storage and state), so
    one session's history is written alone while a batched call reads and writes them all. A
    borrowing layer (kv_share) reads its owner's ring under its own window. ``guard`` (one row):
    1 checks every eager write, N > 1 also compares the first N frames with a float32 shadow.
    ``time_order`` (the pointer layout, one row): a frame's call reads the visible frames gathered
    oldest first (``tail_only``: only those its group's widest layer sees; ``scratch``: into buffers
    kept from call to call) instead of the ring in place."""

    on_device = True  # the model reads positions (and, read in place, masks) from tensors (model.py)

    def __init__(self, config, plans: list[LayerPlan], rows: int = 1, device="cpu", dtype=torch.bfloat16,
                 guard: int = 0, time_order: bool = False, tail_only: bool = True, scratch: bool = True,
                 layers: list | None = None, state: tuple | None = None):
        self.config, self.plans, self.dtype, self.device = config, plans, dtype, torch.device(device)
        self.tpf, self.guard = config.tokens_per_frame, guard
        self.time_order, self.tail_only, self.scratch = time_order, tail_only, scratch
        self.in_place = not time_order  # the model reads the whole ring under the frame's mask
        self._group_window = {p.owner: max(q.window for q in plans if q.owner == p.owner) for p in plans}
        self._gathered: dict[tuple, torch.Tensor] = {}  # scratch: (layer, K or V, frames) -> buffer
        self._views: dict[tuple, RingCache] = {}
        self._masks: dict[tuple, torch.Tensor] = {}  # eager: one mask per (capacity, window) a call
        self._own: dict[int, list | None] = {}  # owner -> a history call's own K/V, for its borrowers
        self._lends = {p.owner for p in plans if p.owner != p.layer}
        if layers is not None:
            self.layers = layers
            self.written, self.commit, self.bias, self.epoch, self.slots = state
        else:
            if (guard or time_order) and rows != 1:
                raise ValueError("the ring guard and the pointer layout serve one session: one row")
            self.layers = [None] * len(plans)
            for p in plans:
                if p.owner == p.layer:
                    self.layers[p.layer] = RingLayer(p, rows, config.n_heads, self.tpf, config.head_dim, dtype,
                                                     self.device, tags=bool(guard))
            for p in plans:
                self.layers[p.layer] = self.layers[p.owner]
            self.written = torch.zeros(rows, dtype=torch.int64, device=self.device)
            self.commit = torch.zeros(rows, dtype=torch.bool, device=self.device)
            self.bias = torch.zeros(rows, dtype=torch.float32, device=self.device)
            self.epoch = torch.zeros(rows, dtype=torch.int64, device=self.device)
            self.slots = {p.capacity: torch.arange(p.capacity, device=self.device) for p in plans}
        self.owners = [layer for p, layer in zip(plans, self.layers) if p.owner == p.layer]
        self._start_guard()

    def _start_guard(self):
        self._frames_seen = 0  # the guard's own count of row 0's committed frames
        self.shadow = StaticCache(self.config, self.max_frames, 1, self.device, torch.float32) if self.guard > 1 else None
        self.checksum_log: list[tuple[int, int, float, float]] = []  # (frame, layer, max |diff|, max |K/V|)
        self._checksum_start = None

    @property
    def n_rows(self) -> int:
        return self.written.shape[0]

    @property
    def max_frames(self) -> int:
        return max(p.capacity for p in self.plans)

    def rows(self, first: int, end: int) -> "RingCache":
        """Rows first..end-1 as a cache of their own (views: writes land here). The same object
        for the same rows, so a compiled model sees one cache per batch size."""
        view = self._views.get((first, end))
        if view is None:
            index = slice(first, end)
            layers = {id(layer): layer.rows(index) for layer in self.owners}
            view = self._views[(first, end)] = RingCache(
                self.config, self.plans, dtype=self.dtype, device=self.device,
                layers=[layers[id(layer)] for layer in self.layers],
                state=(self.written[index], self.commit[index], self.bias[index], self.epoch[index], self.slots))
        return view

    # -- what the model reads ------------------------------------------------------------------------
    def borrows(self, layer: int) -> bool:
        return self.plans[layer].owner != layer

    def next_frame(self) -> torch.Tensor:
        """[rows] absolute index of each row's next frame: its RoPE position."""
        return self.written

    def attend_window(self, layer: int, k=None, v=None):
        """This call's K/V [b, h, n*tpf, dh] into layer ``layer``'s ring (a borrowing layer passes
        none and reads its owner's). One frame a row: the whole ring with its additive mask
        [b, 1, 1, C*tpf] (the rows' ``bias`` inside). A history (after a reset): its own frames in
        time order and None (the model applies the frame rule and the call's bias)."""
        plan, ring = self.plans[layer], self.layers[layer]
        if k is None:  # a borrower: its owner wrote this call's frames
            own = self._own.get(plan.owner)
            return (own[0], own[1], None) if own is not None else (*ring.ring(), self._mask(ring, plan.window))
        if k.shape[2] > self.tpf and layer == 0 and bool(self.written.any()):  # eager: histories only
            raise ValueError("a multi-frame call over the ring writes a new history: reset the rows first "
                             "(a hard cut or a recompute does)")
        own = ring.write(k, v, self.written, self.commit)
        if own is None and self.time_order:
            own = self._gather(layer, ring)
        if layer in self._lends:
            self._own[layer] = own
        if self.guard and not torch.compiler.is_compiling():
            self._check(layer, ring, k, v, own)
        if own is not None:
            return own[0], own[1], None
        return (*ring.ring(), self._mask(ring, plan.window))

    def _gather(self, layer: int, ring: RingLayer) -> list[torch.Tensor]:
        """The pointer layout's read of one frame's call: the history frames the layer's group can
        see (all stored ones without ``tail_only``) and the call's own, oldest first."""
        most = min(ring.capacity - 1, self._group_window[layer] - 1 if self.tail_only else ring.capacity)
        if capturing(self.device):
            # No host read while a CUDA graph is captured: a captured frame is a steady-state one, its
            # ring full, so it sees the most frames, counted back from the device-side write position.
            m, first = most, self.written[0] - most
        else:
            written = int(self.written[0])
            m = min(written, most)
            first = written - m
        tokens = ring.tokens(first + torch.arange(m + 1, device=self.device))
        out = []
        for name, x in zip("kv", ring.ring()):
            if not self.scratch:
                out.append(torch.index_select(x, 2, tokens))
                continue
            key = (layer, name, m)
            buf = self._gathered.get(key)
            if buf is None:
                buf = self._gathered[key] = x.new_empty((*x.shape[:2], tokens.numel(), x.shape[3]))
            out.append(torch.index_select(x, 2, tokens, out=buf))
        return out

    def _mask(self, ring: RingLayer, window: int) -> torch.Tensor:
        key = (ring.capacity, window)
        mask = None if torch.compiler.is_compiling() else self._masks.get(key)
        if mask is None:
            mask = ring.mask(self.written, self.bias, self.slots[ring.capacity], window)
            if not torch.compiler.is_compiling():
                self._masks[key] = mask
        return mask.to(ring.k.dtype)

    def advance(self, n: int):
        """After a call of ``n`` frames: committed rows' histories grow by them."""
        if self.guard and not torch.compiler.is_compiling():
            self._frames_seen += n * bool(self.commit[0])
        self.written.add_(self.commit.to(self.written.dtype) * n)
        self._masks.clear()
        if self.guard and not torch.compiler.is_compiling():
            self._check_offset()

    def _check_offset(self) -> None:
        """The guard: row 0's position is the count of frames it committed, kept apart."""
        if int(self.written[0]) != self._frames_seen:
            raise RingGuardError(f"offset {int(self.written[0]) * self.tpf} is not the {self._frames_seen * self.tpf} "
                                 "tokens written")

    # -- the guard -------------------------------------------------------------------------------------
    def _check(self, layer: int, ring: RingLayer, k, v, own) -> None:
        """After a write: the slots hold their frames; with a shadow, what attention reads matches it."""
        n, commit = k.shape[2] // self.tpf, bool(self.commit[0])
        self._check_offset()
        top = int(self.written[0]) + n  # frames in the ring after this write, a pending one included
        ring.check_tags(top, layer)
        if self.shadow is None:
            return
        frame = top if commit else top - n  # as the host-side cache counts: its frames after the write
        if self._checksum_start is None:
            self._checksum_start = frame
        if frame >= self.guard - 1 + self._checksum_start:
            self.shadow = None  # done: the shadow costs a full float32 cache
            return
        if commit:
            self.shadow.update(k.float(), v.float(), layer)
        ref = self.shadow.get(layer) if commit else self.shadow.get(layer, k.float(), v.float())
        if own is not None:  # time order: the call's own frames are the shadow's last
            keys, values = own
        else:  # ring order: the visible slots, oldest first
            pick = ring.tokens(torch.arange(top - min(top, self.plans[layer].window), top, device=k.device))
            keys, values = (x[:, :, pick] for x in ring.ring())
        ref_k, ref_v = (r[:, :, -keys.shape[2]:] for r in ref)
        diff = max((keys.float() - ref_k).abs().max().item(), (values.float() - ref_v).abs().max().item())
        size = max(ref_k.abs().max().item(), ref_v.abs().max().item())
        self.checksum_log.append((frame, layer, diff, size))

    def guard_report(self, final: bool = False) -> str | None:
        """One line once the checksum window is over, or (``final``: the run ends) over the frames
        checked so far (None without checksum, or before)."""
        if self.guard < 2 or not self.checksum_log or (self.shadow is not None and not final):
            return None
        return checksum_report(self.checksum_log, self.plans, len(self.owners))

    # -- what the engine drives --------------------------------------------------------------------
    def enable_cache_updates(self):
        self.commit.fill_(True)

    def disable_cache_updates(self):
        self.commit.fill_(False)

    def set_commit(self, commit) -> None:
        self.commit.copy_(torch.as_tensor(commit, dtype=torch.bool).expand_as(self.commit))

    def set_bias(self, bias) -> None:
        self.bias.copy_(torch.as_tensor(bias, dtype=torch.float32).expand_as(self.bias))

    @torch.no_grad()
    def reset(self, batch_size: int | None = None):
        """Empty every row of this view (storage is kept: masks hide what it holds); a new epoch."""
        if batch_size is not None and batch_size != self.n_rows:
            raise ValueError(f"this ring holds {self.n_rows} rows; reset a view of the rows (rows(i, j)) instead")
        self.written.zero_()
        self.epoch.add_(1)
        for layer in self.owners:
            layer.k.restart()
            layer.v.restart()
            if layer.tags is not None:
                layer.tags.fill_(-1)
        self._masks.clear()
        self._own.clear()
        if self.guard:
            self._start_guard()
        return self

    def get_offset(self, layer: int = 0) -> int:
        """Tokens written to row 0 (the single-session pipeline's position; a host read)."""
        return int(self.written[0]) * self.tpf

    def n_frames(self, layer: int = 0) -> int:
        return min(int(self.written[0]), self.layers[layer].capacity)

    def nbytes(self) -> int:
        return sum(ring.nbytes() for layer in self.owners for ring in (layer.k, layer.v))

    def scale_nbytes(self) -> int:
        return sum(ring.scale_nbytes() for layer in self.owners for ring in (layer.k, layer.v))

    @property
    def shape(self):
        return tuple(self.layers[0].k.data.shape)

    def state_dict(self) -> tuple[dict, dict]:
        """(tensors, metadata) of this view's rows: storage, scales, scale state and counters."""
        tensors = {}
        for i, layer in enumerate(self.layers):
            if self.plans[i].owner != i:
                continue
            for name, ring in (("k", layer.k), ("v", layer.v)):
                tensors.update({f"{name}.{part}.{i}": t for part, t in ring.state().items()})
            if layer.tags is not None:
                tensors[f"tags.{i}"] = layer.tags
        tensors["written"], tensors["epoch"] = self.written, self.epoch
        return tensors, {"kind": "ring", "rows": self.n_rows}

    @torch.no_grad()
    def load_state_dict(self, tensors: dict, meta: dict):
        from .cache import load_tensor

        if meta.get("kind") != "ring" or meta.get("rows") != self.n_rows:
            raise ValueError(f"cache snapshot holds a {meta.get('kind', 'host-side')} cache of "
                             f"{meta.get('rows', meta.get('batch_size'))} rows; this is a ring of {self.n_rows} rows "
                             "(saved with other settings)")
        for name, dst in self.state_dict()[0].items():
            load_tensor(dst, tensors, name)
        for layer in self.owners:
            for ring in (layer.k, layer.v):
                ring.redecode()
        self._masks.clear()
        self._own.clear()
        if self.guard:
            self._start_guard()
            self.shadow = None  # a restored ring has no shadow of what it holds
            self._frames_seen = int(self.written[0])


def build_cache(config, settings, window_frames: int, rows: int = 1, plans: list[LayerPlan] | None = None):
    """The cache the settings ask for: None (kv_cache "none"), the plain bf16 roll ``StaticCache``
    (the original's), the ring (in place: ``rows`` sessions; pointer: one, read in time order), or
    the host-side ``QuantizedStaticCache`` of the original's rolled slab; ``plans``: the per-layer
    plan, if already made."""
    if settings.kv_cache == "none":
        return None
    kv = settings.kv
    if kv == KVSettings():
        return StaticCache(config, window_frames, rows, settings.device, settings.dtype)
    plans = plans or plan_layers(config, kv, window_frames)
    if kv.ring_mode in ("inplace", "pointer"):
        return RingCache(config, plans, rows, settings.device, settings.dtype, guard=kv.guard,
                         time_order=kv.ring_mode == "pointer", tail_only=kv.tail_only, scratch=kv.ring_scratch)
    return QuantizedStaticCache(config, plans, kv.ring_mode, rows, settings.device, settings.dtype,
                                tail_only=kv.tail_only, guard=kv.guard, fused_kernels=settings.compile)
