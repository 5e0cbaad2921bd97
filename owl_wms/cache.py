"""KV caches. ``StaticCache``: one preallocated slab per layer, rolled on update (the
original's layout, kept for parity and as the reference for every other layout).

Contract used by attention (docs/architecture.md, The KV cache): ``should_update``,
``enable_cache_updates()``, ``disable_cache_updates()``, ``update(k, v, layer)``,
``get(layer, new_k=None, new_v=None)``, ``get_offset(layer)``, ``reset(batch_size)``,
``truncate(frames)``, ``shape``, ``to(...)``. K is stored after RoPE.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig
from .layouts import FrameStore, make_layout
from .quant import Quantizer, ScalePolicy, make_codec
from .settings import KVSettings, SettingsError, late_layer_count


class CacheUpdates:
    """The write switch attention reads (``should_update``): on for prefill and the last step."""
    should_update = False
    on_device = False  # positions, counters and masks are host values (ring.RingCache: tensors)
    in_place = False  # keys come in time order (the ring read in place: in any order, under a mask)

    def enable_cache_updates(self):
        self.should_update = True

    def disable_cache_updates(self):
        self.should_update = False


def load_tensor(dst: torch.Tensor, tensors: dict, name: str):
    """Copy snapshot tensor ``name`` into ``dst``, or say which tensor does not fit and why."""
    src = tensors.get(name)
    if src is None:
        raise ValueError(f"cache snapshot has no tensor {name!r}: it was saved from a different cache plan")
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"cache snapshot tensor {name!r} is {src.dtype} {tuple(src.shape)}; this cache holds "
                         f"{dst.dtype} {tuple(dst.shape)} (saved with other settings or another model)")
    dst.copy_(src)


class StaticCache(CacheUpdates):
    def __init__(self, config: ModelConfig, max_length: int, batch_size: int = 1,
                 device="cpu", dtype=torch.bfloat16):
        if max_length < 1:
            raise ValueError(f"StaticCache max_length={max_length} must be a positive number of frames")
        self.config = config
        self.tpf = config.tokens_per_frame
        self.max_frames = max_length
        self.capacity = max_length * self.tpf
        self.device, self.dtype = torch.device(device), dtype
        self.should_update = False
        self.reset(batch_size)

    # -- lifecycle ---------------------------------------------------------------------------
    def reset(self, batch_size: int = 1):
        c = self.config
        self.batch_size = batch_size
        shape = (batch_size, c.n_heads, self.capacity, c.head_dim)
        self.k = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(c.n_layers)]
        self.v = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(c.n_layers)]
        self.offsets = [0] * c.n_layers  # tokens ever written: the RoPE position of the next token
        self.lengths = [0] * c.n_layers  # valid tokens in the slab, oldest first
        return self

    def to(self, device=None, dtype=None):
        self.device = torch.device(device) if device is not None else self.device
        self.dtype = dtype or self.dtype
        self.k = [t.to(self.device, self.dtype) for t in self.k]
        self.v = [t.to(self.device, self.dtype) for t in self.v]
        return self

    @property
    def shape(self):
        return tuple(self.k[0].shape)

    def nbytes(self) -> int:
        """Bytes held by the cache (bf16 data; no scales)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def scale_nbytes(self) -> int:
        return 0

    def get_offset(self, layer: int = 0) -> int:
        return self.offsets[layer]

    def state_dict(self) -> tuple[dict, dict]:
        """(tensors, metadata) of everything the cache holds (a pipeline snapshot saves them)."""
        tensors = {f"{n}.{i}": t for n, ts in (("k", self.k), ("v", self.v)) for i, t in enumerate(ts)}
        return tensors, {"batch_size": self.batch_size, "offsets": list(self.offsets), "lengths": list(self.lengths)}

    @torch.no_grad()
    def load_state_dict(self, tensors: dict, meta: dict):
        self.reset(meta["batch_size"])
        for n, ts in (("k", self.k), ("v", self.v)):
            for i, t in enumerate(ts):
                load_tensor(t, tensors, f"{n}.{i}")
        self.offsets, self.lengths = list(meta["offsets"]), list(meta["lengths"])

    def n_frames(self, layer: int = 0) -> int:
        return self.lengths[layer] // self.tpf

    # -- data ----------------------------------------------------------------------------------
    def _check(self, new_k, new_v):
        b, h, n, d = new_k.shape
        expect = (self.batch_size, self.config.n_heads, d, self.config.head_dim)
        if (b, h, d) != (expect[0], expect[1], expect[3]) or new_v.shape != new_k.shape:
            raise ValueError(f"cache write of k{tuple(new_k.shape)} v{tuple(new_v.shape)} does not match the "
                             f"cache (batch {expect[0]}, heads {expect[1]}, head dim {expect[3]})")
        if n % self.tpf or n > self.capacity:
            raise ValueError(f"cache write of {n} tokens: must be whole frames ({self.tpf} tokens each) "
                             f"and at most the cache's {self.max_frames} frames")
        return n

    @torch.no_grad()
    def update(self, new_k, new_v, layer: int):
        n = self._check(new_k, new_v)
        length = self.lengths[layer]
        if length + n > self.capacity:
            shift = length + n - self.capacity
            # The original's roll: copies the whole slab every frame once full.
            self.k[layer] = torch.roll(self.k[layer], -shift, dims=2)
            self.v[layer] = torch.roll(self.v[layer], -shift, dims=2)
            length -= shift
        self.k[layer][:, :, length:length + n] = new_k
        self.v[layer][:, :, length:length + n] = new_v
        self.lengths[layer] = length + n
        self.offsets[layer] += n

    def borrows(self, layer: int) -> bool:
        return False

    def attend_window(self, layer: int, k, v):
        """What attention reads for this call's K/V: (keys, values, mask or None)."""
        if self.should_update:
            self.update(k, v, layer)
            return (*self.get(layer), None)
        return (*self.get(layer, new_k=k, new_v=v), None)

    def get(self, layer: int, new_k=None, new_v=None):
        """Chronological K/V; with new_k/new_v, the window as if they were appended (no mutation)."""
        length = self.lengths[layer]
        k, v = self.k[layer][:, :, :length], self.v[layer][:, :, :length]
        if new_k is None:
            return k, v
        n = self._check(new_k, new_v)
        keep = min(length, self.capacity - n)
        return (torch.cat([k[:, :, length - keep:], new_k], dim=2),
                torch.cat([v[:, :, length - keep:], new_v], dim=2))

    @torch.no_grad()
    def truncate(self, frames: int):
        """Forget the oldest ``frames`` frames of every layer (positions keep counting)."""
        drop = frames * self.tpf
        for i in range(self.config.n_layers):
            keep = max(self.lengths[i] - drop, 0)
            self.k[i][:, :, :keep] = self.k[i][:, :, self.lengths[i] - keep:self.lengths[i]].clone()
            self.v[i][:, :, :keep] = self.v[i][:, :, self.lengths[i] - keep:self.lengths[i]].clone()
            self.lengths[i] = keep


# -- the quantized family --------------------------------------------------------------------
class RingGuardError(RuntimeError):
    """A cache invariant failed (the ring_guard setting): offsets, write pointer or scale alignment."""


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    owner: int  # the layer whose K/V this one reads (itself unless it borrows: kv_share)
    window: int  # frames a decoded query of this layer sees, itself included (ModelConfig.decode_window)
    capacity: int  # frames stored by an owner
    k: tuple[str, ScalePolicy]  # (codec, scale policy)
    v: tuple[str, ScalePolicy]

    def describe(self) -> str:
        def one(codec, policy):
            return codec if codec == "bf16" else f"{codec}/{policy.describe()}"
        own = f"reads L{self.owner}" if self.owner != self.layer else f"K={one(*self.k)} V={one(*self.v)}"
        return f"{own} window={self.window} slots={self.capacity}"


def plan_layers(config: ModelConfig, kv: KVSettings, window_frames: int) -> list[LayerPlan]:
    """Per-layer codecs, scales, windows, capacities and sharing groups from the settings."""
    n, layout = config.n_layers, kv.ring_mode
    late = late_layer_count(kv.late_layers, n)
    if late is not None and late > n:
        raise SettingsError(f"kv_late_layers={late} exceeds the model's {n} layers; give at most {n}",
                            ("kv_late_layers",))
    if kv.share > n:
        raise SettingsError(f"kv_share={kv.share} exceeds the model's {n} layers; give at most {n}", ("kv_share",))
    # A decoded frame reads the cache without the frame mask: global layers see all W frames
    # whatever global_window says (the original), local layers their last local_window.
    windows = [min(config.decode_window(i) or window_frames, window_frames) for i in range(n)]
    first_quantized = n - (late or n)
    plans = []
    for i in range(n):
        owner = i - i % kv.share
        group = range(owner, min(owner + kv.share, n))
        # Roll and pointer keep the original's W frames per layer; inplace stores what the group sees.
        capacity = max(windows[j] for j in group) if layout == "inplace" else window_frames
        quant = i >= first_quantized
        pol_k = ScalePolicy(kv.scale_k, None, kv.ema, kv.smooth)
        pol_v = ScalePolicy(kv.scale_v, kv.v_percentile, kv.ema, kv.smooth)
        plans.append(LayerPlan(i, owner, windows[i], capacity, (kv.fmt_k if quant else "bf16", pol_k),
                               (kv.fmt_v if quant else "bf16", pol_v)))
    return plans


def describe_plan(plans: list[LayerPlan]) -> str:
    """Consecutive layers with the same plan collapse into one group: 'L0-3: ...; L4: ...'."""
    groups = []
    for p in plans:
        text = p.describe()
        if groups and groups[-1][2] == text:
            groups[-1][1] = p.layer
        else:
            groups.append([p.layer, p.layer, text])
    return "; ".join(f"L{a}" + (f"-{b}" if b != a else "") + f": {t}" for a, b, t in groups)


class QuantizedStaticCache(CacheUpdates):
    """The StaticCache contract over any codec x scale policy on the original's rolled slab, plus
    sharing and guards (the pointer and in-place layouts are the tensor-state ring, ring.py).

    Per owner layer, a ``FrameStore`` holds K and V ``[b, h, C, tpf, dh/pack]`` and their
    scales in the same frame slots, rolled together. It returns the window of the bf16 roll cache
    up to quantization: a query of layer i sees its last ``window`` frames, itself included, and
    a read-only call passes its own K/V through the codec exactly as a write would, so every
    layout of one codec returns the same window bit for bit.
    """

    def __init__(self, config: ModelConfig, plans: list[LayerPlan], layout: str = "roll", batch_size: int = 1,
                 device="cpu", dtype=torch.bfloat16, tail_only: bool = True,
                 guard: int = 0, fused_kernels: bool = False):
        self.config, self.plans = config, plans
        self.fused_kernels = fused_kernels  # compiled encode/decode kernels (the compile setting)
        self.tpf = config.tokens_per_frame
        self.max_frames = max(p.capacity for p in plans)
        self.layout = make_layout(layout)
        self.tail_only, self.guard = tail_only, guard
        self.device, self.dtype = torch.device(device), dtype
        self.should_update = False
        self.checksum_log: list[tuple[int, int, float, float]] = []  # (frame, layer, max |diff|, max |K/V|) vs a float32 shadow
        self.reset(batch_size)

    # -- lifecycle ---------------------------------------------------------------------------
    def reset(self, batch_size: int = 1):
        c = self.config
        self.batch_size = batch_size
        self.stores: dict[int, FrameStore] = {}
        self.quant: dict[int, tuple[Quantizer, Quantizer]] = {}
        for p in self.plans:
            if p.owner != p.layer:
                continue
            kq, vq = (Quantizer(make_codec(codec), policy, self.fused_kernels) for codec, policy in (p.k, p.v))
            shapes, dtypes = {}, {}
            for name, q in (("k", kq), ("v", vq)):
                shapes[name] = (batch_size, c.n_heads, p.capacity, self.tpf, q.codec.stored_dim(c.head_dim))
                dtypes[name] = q.codec.storage_dtype(self.dtype)
                if q.quantized:
                    shapes[f"{name}_scale"] = (batch_size, c.n_heads, p.capacity,
                                               *q.policy.scale_shape(self.tpf, c.head_dim))
                    dtypes[f"{name}_scale"] = self.dtype
            self.stores[p.layer] = FrameStore(p.capacity, shapes, dtypes, self.device)
            self.quant[p.layer] = (kq, vq)
        self._shared: dict[int, tuple] = {}  # owner -> (k, v) of its latest call
        self._work_bufs: dict[tuple, tuple] = {}
        # Tail-only reads: an owner reads what the widest reader of its group can see.
        self._group_window = {i: max(q.window for q in self.plans if q.owner == i) for i in self.stores}
        self._lends = {i: any(q.owner == i and q.layer != i for q in self.plans) for i in self.stores}
        self._tokens_seen = {i: 0 for i in self.stores}  # guard: independent tally of written tokens
        self.shadow = StaticCache(c, self.max_frames, batch_size, self.device, torch.float32) if self.guard > 1 else None
        self.checksum_log = []
        self._checksum_start = None  # first frame written after the prefill
        return self

    def to(self, device=None, dtype=None):
        if dtype is not None and dtype != self.dtype:
            raise ValueError("a quantized cache keeps its compute dtype; build a new one (reset) for another dtype")
        self.device = torch.device(device) if device is not None else self.device
        for s in self.stores.values():
            s.to(self.device)
        return self

    @property
    def shape(self):
        return tuple(self.stores[0].bufs["k"].shape)

    def nbytes(self) -> int:
        """Bytes held by the cache: data and scales."""
        return sum(s.nbytes() for s in self.stores.values())

    def scale_nbytes(self) -> int:
        return sum(s.nbytes(("k_scale", "v_scale")) for s in self.stores.values())

    def borrows(self, layer: int) -> bool:
        return self.plans[layer].owner != layer

    def get_offset(self, layer: int = 0) -> int:
        return self.stores[self.plans[layer].owner].written * self.tpf

    def state_dict(self) -> tuple[dict, dict]:
        """(tensors, metadata): every store's buffers and slot tags, and the temporal scale
        state; working buffers and the checksum shadow are diagnostics and are not saved."""
        tensors, stores = {}, {}
        for i, store in self.stores.items():
            tensors.update({f"{i}.{n}": b for n, b in store.bufs.items()})
            tensors.update({f"{i}.tag.{n}": t for n, t in store.tags.items()})
            for name, q in zip("kv", self.quant[i]):
                if q.prev is not None:
                    tensors[f"{i}.{name}.prev"] = q.prev
            stores[str(i)] = {"length": store.length, "written": store.written, "tokens_seen": self._tokens_seen[i]}
        return tensors, {"batch_size": self.batch_size, "layout": self.layout.name, "stores": stores}

    @torch.no_grad()
    def load_state_dict(self, tensors: dict, meta: dict):
        if meta.get("layout") != self.layout.name or set(meta["stores"]) != {str(i) for i in self.stores}:
            raise ValueError(f"cache snapshot was saved from a {meta.get('layout')} cache with layers "
                             f"{sorted(meta['stores'])}; this cache is {self.layout.name} with layers "
                             f"{sorted(self.stores)} (use the settings it was saved with)")
        self.reset(meta["batch_size"])
        self.shadow = None
        for i, store in self.stores.items():
            for n, b in store.bufs.items():
                load_tensor(b, tensors, f"{i}.{n}")
            for n, t in store.tags.items():
                load_tensor(t, tensors, f"{i}.tag.{n}")
            m = meta["stores"][str(i)]
            store.length, store.written, self._tokens_seen[i] = m["length"], m["written"], m["tokens_seen"]
            for name, q in zip("kv", self.quant[i]):
                prev = tensors.get(f"{i}.{name}.prev")
                q.prev = None if prev is None else prev.clone()

    def n_frames(self, layer: int = 0) -> int:
        return self.stores[self.plans[layer].owner].length

    def quant_stats(self) -> dict:
        """Saturated / non-finite counts of everything quantized so far (reading them syncs)."""
        total = {"values": 0, "saturated": 0, "nonfinite": 0}
        for kq, vq in self.quant.values():
            for q in (kq, vq):
                if q.quantized:
                    for key, val in q.stats().items():
                        total[key] += val
        return total

    # -- encode / decode ---------------------------------------------------------------------
    def _frames(self, t):
        b, h, n, d = t.shape
        return t.view(b, h, n // self.tpf, self.tpf, d)

    def encode(self, layer, k, v, commit):
        """A call's K/V [b, h, n*tpf, dh] as stored: {name: data or scales} of whole frames."""
        kq, vq = self.quant[layer]
        items = {}
        for name, q, x in (("k", kq, k), ("v", vq, v)):
            data, scale = q.encode(self._frames(x), commit, self.dtype)
            items[name] = data
            if scale is not None:
                items[f"{name}_scale"] = scale
        return items

    def decode(self, layer, items, out=None, at: int = 0):
        """K, V [b, h, frames*tpf, dh] from stored frames; with ``out`` (a K and a V buffer),
        decoded in place into their frames ``at`` onwards (and the whole buffers returned)."""
        kq, vq = self.quant[layer]
        result = []
        for i, (name, q) in enumerate((("k", kq), ("v", vq))):
            data = items[name]
            if out is None:
                x = q.decode(data, items.get(f"{name}_scale"), self.dtype)
                b, h, f, t, d = x.shape
                result.append(x.reshape(b, h, f * t, d))
                continue
            b, h, f, t, _ = data.shape
            q.decode(data, items.get(f"{name}_scale"), self.dtype, out=out[i].view(b, h, -1, t, out[i].shape[-1])[:, :, at:at + f])
            result.append(out[i])
        return result

    def work_buffers(self, frames: int):
        """Reused K and V buffers for a window of ``frames`` frames: attention consumes one layer's
        window before the next layer (or a borrower right after its owner) asks for it again, so
        the hot path decodes into memory it already has instead of allocating every call."""
        c = self.config
        shape = (self.batch_size, c.n_heads, frames * self.tpf, c.head_dim)
        bufs = self._work_bufs.get(shape)
        if bufs is None:
            bufs = self._work_bufs[shape] = tuple(torch.empty(shape, dtype=self.dtype, device=self.device)
                                                 for _ in range(2))
        return bufs

    def _check(self, layer, new_k, new_v):
        c = self.config
        b, h, n, d = new_k.shape
        if (b, h, d) != (self.batch_size, c.n_heads, c.head_dim) or new_v.shape != new_k.shape:
            raise ValueError(f"cache write of k{tuple(new_k.shape)} v{tuple(new_v.shape)} does not match the "
                             f"cache (batch {self.batch_size}, heads {c.n_heads}, head dim {c.head_dim})")
        if n % self.tpf:
            raise ValueError(f"cache write of {n} tokens: must be whole frames ({self.tpf} tokens each)")
        if self.borrows(layer):
            raise ValueError(f"layer {layer} reads layer {self.plans[layer].owner}'s K/V (kv_share); "
                             "it has no cache of its own")
        return n // self.tpf

    def _history(self, layer, new_frames):
        """How many stored frames a call with ``new_frames`` new frames reads (tail-only rule)."""
        store = self.stores[layer]
        if not self.tail_only:
            return min(store.length, store.capacity - min(new_frames, store.capacity))
        return min(store.length, self._group_window[layer] - 1, store.capacity - min(new_frames, store.capacity))

    # -- contract ------------------------------------------------------------------------------
    @torch.no_grad()
    def update(self, new_k, new_v, layer: int):
        n = self._check(layer, new_k, new_v)
        self._write(layer, self.encode(layer, new_k, new_v, commit=True), n, new_k, new_v)

    def _write(self, layer, items, n, raw_k, raw_v):
        store = self.stores[layer]
        before = store.written
        self.layout.write(store, items, n)
        if self.shadow is not None:
            self.shadow.update(raw_k.float(), raw_v.float(), layer)
        if self.guard:
            self._tokens_seen[layer] += n * self.tpf
            self._guard(layer, before)

    def get(self, layer: int, new_k=None, new_v=None):
        """Chronological, dequantized K/V a query of this layer sees; with new_k/new_v, as if
        they were appended (nothing is written)."""
        layer = self.plans[layer].owner
        if new_k is None:
            store = self.stores[layer]
            frames = store.length if not self.tail_only else min(store.length, self._group_window[layer])
            return self.decode(layer, self.layout.read(store, frames))
        n = self._check(layer, new_k, new_v)
        hist = self.decode(layer, self.layout.read(self.stores[layer], self._history(layer, n)))
        new = self.decode(layer, self.encode(layer, new_k, new_v, commit=False))
        return torch.cat([hist[0], new[0]], dim=2), torch.cat([hist[1], new[1]], dim=2)

    def attend_window(self, layer: int, k=None, v=None):
        """(keys, values, None) for this layer's attention: time-ordered K/V ending with this call's
        frames, each passed through the codec as a write would; the call's K/V are written when
        updates are on. A borrowing layer (kv_share) passes none and reads its owner's."""
        p = self.plans[layer]
        if p.owner != layer:
            keys, values = self._shared[p.owner]
            return keys, values, None
        n = self._check(layer, k, v)
        store = self.stores[layer]
        items = self.encode(layer, k, v, commit=self.should_update)
        m = self._history(layer, n)
        work = self.work_buffers(m + n)  # history then this call's frames, decoded side by side
        self.decode(layer, self.layout.read(store, m), work)
        keys, values = self.decode(layer, items, work, at=m)
        if self.should_update:
            self._write(layer, items, n, k, v)
        if self.shadow is not None:
            self._checksum(layer, keys, values, k, v)
        if self._lends[layer]:
            self._shared[layer] = (keys, values)
        return keys, values, None

    @torch.no_grad()
    def truncate(self, frames: int):
        """Forget the oldest ``frames`` frames of every layer (positions keep counting)."""
        for store in self.stores.values():
            self.layout.forget(store, frames)
        if self.shadow is not None:
            self.shadow.truncate(frames)

    # -- guards (OWL_RING_GUARD) ---------------------------------------------------------------
    def _guard(self, layer: int, written_before: int):
        store = self.stores[layer]
        offset = self.get_offset(layer)
        if offset < written_before * self.tpf or offset != self._tokens_seen[layer]:
            raise RingGuardError(f"layer {layer}: offset {offset} is not the {self._tokens_seen[layer]} tokens written")
        first = store.written - store.length
        expect = torch.full((store.capacity,), -1, dtype=torch.int64)
        for f in range(first, store.written):
            expect[self.layout.slot_of(store, f)] = f
        for name, tags in store.tags.items():
            valid = expect >= 0
            if not torch.equal(tags[valid], expect[valid]):
                bad = int((tags != expect)[valid].nonzero()[0, 0])
                raise RingGuardError(f"layer {layer}: slot {bad} of {name!r} holds frame {int(tags[bad])}, expected "
                                     f"frame {int(expect[bad])} (its tokens' frame): {name} moved apart from the data")

    def guard_report(self, final: bool = False) -> str | None:
        """One line once the checksum window is over, or (``final``: the run ends) over the frames
        checked so far (None without checksum, or before)."""
        if self.guard < 2 or not self.checksum_log or (self.shadow is not None and not final):
            return None
        return checksum_report(self.checksum_log, self.plans, len(self.stores))

    def _checksum(self, layer, keys, values, k, v):
        """Compare the assembled window with the float32 shadow's for the first N frames."""
        frame = self.stores[layer].written
        if self._checksum_start is None:
            self._checksum_start = frame
        if frame >= self.guard - 1 + self._checksum_start:
            self.shadow = None  # done: the shadow costs a full float32 cache
            return
        ref_k, ref_v = self.shadow.get(layer) if self.should_update else self.shadow.get(layer, k.float(), v.float())
        n = keys.shape[2]
        ref_k, ref_v = ref_k[:, :, -n:], ref_v[:, :, -n:]
        diff = max((keys.float() - ref_k).abs().max().item(), (values.float() - ref_v).abs().max().item())
        size = max(ref_k.abs().max().item(), ref_v.abs().max().item())
        self.checksum_log.append((frame, layer, diff, size))


# The largest error of one stored value, as a share of the value range its scale covers.
ROUNDING = {"bf16": 2.0**-8, "int8": 1 / 254, "fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3, "int4": 1 / 14}


def checksum_report(log: list[tuple[int, int, float, float]], plans: list[LayerPlan], layers: int) -> str:
    """The guard's checksum line: the largest difference from the float32 shadow over the frames
    of ``log`` (frame, layer, max |diff|, max |K/V|), against the plans' codecs' rounding."""
    frames = {f for f, *_ in log}
    frame, layer, diff, size = max(log, key=lambda r: r[2] / max(r[3], 1e-30))
    share = diff / max(size, 1e-30)
    # Without clipping scales, a value is off by at most its codec's rounding (relative to the
    # largest |K/V| it is scaled by) plus the bf16 read-out.
    codecs = [*(p.k for p in plans), *(p.v for p in plans)]
    codec = max((c for c, _ in codecs), key=lambda c: ROUNDING[c])
    bound = ROUNDING[codec] + ROUNDING["bf16"]
    if any(policy.clips for c, policy in codecs if c != "bf16"):
        verdict = "scales that clip (percentile, EMA) allow larger errors: no rounding bound to check"
    elif share <= bound:
        verdict = f"within {codec}'s rounding (at most {bound:.2%})"
    else:
        verdict = f"ABOVE {codec}'s rounding ({bound:.2%}): the cache is corrupted"
    return (f"[owl] ring guard checksum: {len(frames)} frames x {layers} layers, max |K/V - float32 shadow| "
            f"= {diff:.3g} = {share:.2%} of the largest |K/V| (frame {frame}, layer {layer}): {verdict}; "
            "invariants held")
