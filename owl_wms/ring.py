"""The in-place ring KV cache with its state in tensors, one row per session.

Per layer (``RingLayer``), K and V live in frame slots ``[rows, heads, C, tpf, dh/pack]`` (with
their scales in the same slots) and each row's state is a tensor on the model's device:
``written`` (frames written since the row's last reset: the absolute frame index of the next
frame, hence its RoPE position, and the history's length) and ``epoch`` (+1 at every reset). Frame f lives in slot f mod C. Because nothing about a call is a host value, the
model as written runs over it eagerly or as one compiled graph, and rows at different positions
(sessions with their own histories) run in one batched call.

A generated frame (one frame a row) is written into its slot, and attention reads the whole
ring in place under a mask made on the device from the absolute frame each slot holds
(``frame_visible``: the one visibility rule) with the soft-forgetting bias on history keys. A
call that does not commit (the sampler's first step) writes the same slot as the committing
one; only the counter tells them apart. The slot a frame overwrites held the frame C before
it, which no query of the layer sees any more, so nothing else needs tracking. A multi-frame
call (a history after a reset) attends over its own frames in time order and writes the last
C into the ring.
"""
from __future__ import annotations

import torch

from .attention import frame_visible
from .cache import LayerPlan
from .quant import Codec, ScalePolicy, _int4_unpack, _scale_and_quantize, make_codec, scaled_decode


def ring_blocker(plans: list[LayerPlan] | None, ring_mode: str, guard: int) -> str | None:
    """Why these cache plans need the host-side caches of cache.py (None: the ring takes them)."""
    if plans is None:
        return "no KV cache"
    if ring_mode != "inplace":
        return f"ring_mode is {ring_mode}, not inplace"
    if guard:
        return "the ring guard checks every write on the host"
    for p in plans:
        if p.owner != p.layer:
            return "layers share K/V (kv_share)"
        for codec, policy in (p.k, p.v):
            if codec != "bf16" and (policy.temporal or policy.percentile not in (None, 100)):
                return f"{policy.describe()} scales depend on earlier frames or percentiles"
    return None


class RingTensor:
    """K or V of one layer: stored frames, their scales (quantized codecs) and, for a quantized
    codec, the decoded ring attention reads, kept decoded slot by slot as frames are written."""

    def __init__(self, codec: Codec, policy: ScalePolicy, shape: tuple, dtype: torch.dtype, device, tensors=None):
        self.codec, self.policy, self.dtype = codec, policy, dtype
        self.quantized = codec.qmax is not None
        if tensors is not None:  # a view of some rows of another ring
            self.data, self.scale, self.work = tensors
            return
        rows, heads, capacity, tpf, dh = shape
        stored = (rows, heads, capacity, tpf, codec.stored_dim(dh))
        self.data = torch.zeros(stored, dtype=codec.storage_dtype(dtype), device=device)
        self.scale = self.work = None
        if self.quantized:
            self.scale = torch.zeros((rows, heads, capacity, *policy.scale_shape(tpf, dh)), dtype=dtype, device=device)
            self.work = torch.zeros((rows, heads, capacity * tpf, dh), dtype=dtype, device=device)

    def rows(self, index: slice) -> "RingTensor":
        return RingTensor(self.codec, self.policy, (), self.dtype, None,
                          tuple(None if t is None else t[index] for t in (self.data, self.scale, self.work)))

    def encode(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Frames [b, h, n, tpf, dh] as stored (and their scales)."""
        if not self.quantized:
            return frames.to(self.data.dtype), None
        scale, q, _ = _scale_and_quantize(frames, self.codec, self.policy.dims, self.policy.floor, self.dtype, False)
        return q, scale

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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale) if t is not None)

    def scale_nbytes(self) -> int:
        return 0 if self.scale is None else self.scale.numel() * self.scale.element_size()


class RingLayer:
    """One layer's ring: K and V in ``capacity`` frame slots; frame f lives in slot f mod C."""

    def __init__(self, plan: LayerPlan, rows: int, heads: int, tpf: int, head_dim: int, dtype, device, views=None):
        self.plan, self.capacity, self.window, self.tpf = plan, plan.capacity, plan.window, tpf
        if views is not None:
            self.k, self.v = views
            return
        shape = (rows, heads, plan.capacity, tpf, head_dim)
        self.k = RingTensor(make_codec(plan.k[0]), plan.k[1], shape, dtype, device)
        self.v = RingTensor(make_codec(plan.v[0]), plan.v[1], shape, dtype, device)

    def rows(self, index: slice) -> "RingLayer":
        return RingLayer(self.plan, 0, 0, self.tpf, 0, None, None, (self.k.rows(index), self.v.rows(index)))

    def write(self, k: torch.Tensor, v: torch.Tensor, written: torch.Tensor):
        """This call's K/V [b, h, n*tpf, dh] into the slots of frames written[b] + 0..n-1 (the
        last C of them); returns what attention reads of this call's frames: (keys, values) as
        stored and decoded, in time order."""
        b, heads, tokens, dh = k.shape
        n = tokens // self.tpf
        stored = [ring.encode(x.view(b, heads, n, self.tpf, dh)) for ring, x in zip((self.k, self.v), (k, v))]
        m = min(n, self.capacity)
        slots = torch.remainder(written[:, None] + (n - m) + torch.arange(m, device=k.device), self.capacity)
        rows = torch.arange(b, device=k.device)[:, None]
        # a history's frames are decoded once: attention reads them, the ring keeps the last C
        decoded = [None, None] if n == 1 else [ring.decode(q, scale) for ring, (q, scale) in zip((self.k, self.v), stored)]
        for ring, (q, scale), d in zip((self.k, self.v), stored, decoded):
            ring.put(rows, slots, q[:, :, n - m:], None if scale is None else scale[:, :, n - m:],
                     None if d is None else d[:, :, n - m:])
        return None if n == 1 else [d.flatten(2, 3) for d in decoded]

    def ring(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.ring(), self.v.ring()

    def mask(self, written: torch.Tensor, bias: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Additive mask [b, 1, 1, C*tpf] of a frame at index written[b] over the ring after its
        write: the frame rule on the absolute frame each slot holds (slots never written hold
        frames below 0), the bias on history keys, 0 on the frame's own."""
        age = torch.remainder(written[:, None] - slots, self.capacity)  # [b, C]; 0: this frame
        key = written[:, None] - age
        visible = frame_visible(written[:, None], key, self.window) & (key >= 0)
        history = torch.where(age == 0, torch.zeros_like(bias)[:, None], bias[:, None])
        add = torch.where(visible, history, torch.full_like(history, float("-inf")))
        return add.repeat_interleave(self.tpf, dim=1)[:, None, None]


class RingCache:
    """The tensor-state ring of every layer, ``rows`` sessions deep. Each row's state is one
    tensor: ``written`` [rows], the frames written since the row's reset. Every call writes every
    layer, so it is at once the next frame's absolute index (its RoPE position) and the history's
    length (layer l holds the last min(written, C_l) frames). ``commit`` [rows] says which rows'
    calls enter the history (the sampler's last step: the others leave ``written`` as it was, so
    the next call overwrites the same slots), ``bias`` [rows] their soft-forgetting bias, ``epoch``
    [rows] counts resets. ``rows(i, j)`` is a view of rows i..j-1 (storage and state), so one
    session's history is written alone while a batched call reads and writes them all."""

    on_device = True  # the model reads positions and masks from tensors (model.py)

    def __init__(self, config, plans: list[LayerPlan], rows: int = 1, device="cpu", dtype=torch.bfloat16,
                 layers: list | None = None, state: tuple | None = None):
        self.config, self.plans, self.dtype, self.device = config, plans, dtype, torch.device(device)
        self.tpf = config.tokens_per_frame
        self._views: dict[tuple, RingCache] = {}
        self._masks: dict[tuple, torch.Tensor] = {}  # eager: one mask per (capacity, window) a call
        if layers is not None:
            self.layers = layers
            self.written, self.commit, self.bias, self.epoch, self.slots = state
            return
        self.layers = [RingLayer(p, rows, config.n_heads, self.tpf, config.head_dim, dtype, self.device) for p in plans]
        self.written = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.commit = torch.zeros(rows, dtype=torch.bool, device=self.device)
        self.bias = torch.zeros(rows, dtype=torch.float32, device=self.device)
        self.epoch = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.slots = {p.capacity: torch.arange(p.capacity, device=self.device) for p in plans}

    @property
    def n_rows(self) -> int:
        return self.written.shape[0]

    def rows(self, first: int, end: int) -> "RingCache":
        """Rows first..end-1 as a cache of their own (views: writes land here). The same object
        for the same rows, so a compiled model sees one cache per batch size."""
        view = self._views.get((first, end))
        if view is None:
            index = slice(first, end)
            view = self._views[(first, end)] = RingCache(
                self.config, self.plans, dtype=self.dtype, device=self.device,
                layers=[layer.rows(index) for layer in self.layers],
                state=(self.written[index], self.commit[index], self.bias[index], self.epoch[index], self.slots))
        return view

    # -- what the model reads ------------------------------------------------------------------------
    def borrows(self, layer: int) -> bool:
        return False

    def ring_view(self, layer: int):
        """A history call's keys are in time order (a frame's call carries its own mask)."""
        return None

    def next_frame(self) -> torch.Tensor:
        """[rows] absolute index of each row's next frame: its RoPE position."""
        return self.written

    def attend_window(self, layer: int, k, v):
        """This call's K/V [b, h, n*tpf, dh] into layer ``layer``'s ring. One frame a row: the
        whole ring with its additive mask [b, 1, 1, C*tpf] (the rows' ``bias`` inside). A history
        (after a reset): its own frames in time order and None (the model applies the frame rule
        and the call's bias)."""
        ring = self.layers[layer]
        if k.shape[2] > self.tpf and layer == 0 and bool(self.written.any()):  # eager: histories only
            raise ValueError("a multi-frame call over the ring writes a new history: reset the rows first "
                             "(a hard cut or a recompute does)")
        own = ring.write(k, v, self.written)
        if own is not None:
            return own[0], own[1], None
        key = (ring.capacity, ring.window)
        mask = None if torch.compiler.is_compiling() else self._masks.get(key)
        if mask is None:
            mask = ring.mask(self.written, self.bias, self.slots[ring.capacity])
            if not torch.compiler.is_compiling():
                self._masks[key] = mask
        keys, values = ring.ring()
        return keys, values, mask.to(keys.dtype)

    def advance(self, n: int):
        """After a call of ``n`` frames: committed rows' histories grow by them."""
        self.written.add_(self.commit.to(self.written.dtype) * n)
        self._masks.clear()

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
        self._masks.clear()
        return self

    def get_offset(self, layer: int = 0) -> int:
        """Tokens written to row 0 (the single-session pipeline's position; a host read)."""
        return int(self.written[0]) * self.tpf

    def n_frames(self, layer: int = 0) -> int:
        return min(int(self.written[0]), self.layers[layer].capacity)

    def nbytes(self) -> int:
        return sum(ring.nbytes() for layer in self.layers for ring in (layer.k, layer.v))

    def scale_nbytes(self) -> int:
        return sum(ring.scale_nbytes() for layer in self.layers for ring in (layer.k, layer.v))

    @property
    def shape(self):
        return tuple(self.layers[0].k.data.shape)

    def state_dict(self) -> tuple[dict, dict]:
        """(tensors, metadata) of this view's rows: storage, scales and counters."""
        tensors = {}
        for i, layer in enumerate(self.layers):
            for name, ring in (("k", layer.k), ("v", layer.v)):
                tensors[f"{name}.{i}"] = ring.data
                if ring.scale is not None:
                    tensors[f"{name}_scale.{i}"] = ring.scale
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
        for layer in self.layers:
            for ring in (layer.k, layer.v):
                ring.redecode()
        self._masks.clear()
