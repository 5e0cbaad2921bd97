"""What a process loads once and its sessions share: a world's config, model and decoder from a
checkpoint, and the start-up line that says what runs."""
from __future__ import annotations

from ..cache import describe_plan
from ..config import WorldConfig, load_world
from ..loading import SHIPPED_WORLD, build_model, load_weights, read_weights, weights_path
from ..settings import KVSettings, Settings
from ..vae import load_decoder


def load_parts(checkpoint=None, ckpt_path=None, weights: str | None = None, decoder: bool = True):
    """(world, model, decoder or None, a description of the weights) of a checkpoint folder (with
    config.yaml), a config file or a config already read by ``load_world`` (default: the shipped
    world). ``weights``: "ema" or "online" of a trainer checkpoint holding both (default: EMA)."""
    world = checkpoint if isinstance(checkpoint, WorldConfig) else load_world(
        SHIPPED_WORLD if checkpoint is None else checkpoint)
    if ckpt_path is None and world.path is None:
        raise ValueError("this config was not read from a file, so no weights lie beside it; pass ckpt_path")
    ckpt_path = weights_path(ckpt_path, world.path)
    loaded = read_weights(ckpt_path, weights)
    model = load_weights(build_model(world.model), loaded.tensors, str(ckpt_path))
    return world, model, load_decoder(world) if decoder else None, loaded.describe()


def load_pipeline(cls, checkpoint=None, ckpt_path=None, settings: Settings | None = None, clip=0,
                  ground_truth: bool = False, verbose: bool = True, tp=None, weights: str | None = None, pp=None):
    """A ``cls`` (CausvidPipeline) of a checkpoint (``load_parts``), from clip ``clip`` (None: no
    history yet). Under tensor parallelism only rank 0 loads the decoder and a clip."""
    leader = (tp is None or tp.is_leader) and (pp is None or pp.is_leader)
    world, model, decoder, described = load_parts(checkpoint, ckpt_path, weights, leader)
    pipe = cls(model, decoder, world, settings, ground_truth=ground_truth, verbose=verbose, tp=tp, weights=described,
               pp=pp)
    if clip is not None and leader:
        pipe.load_clip(clip)
    return pipe


def startup_text(pipe, n_params: int) -> str:
    """The start-up line: world, model, sampler and settings (and the TP split, the cache plan
    and the compile path). ``n_params``: the whole model's, before any sharding."""
    label = "" if pipe.world.trained else " UNTRAINED (random weights: frames show noise)"
    local = sum(p.numel() for p in pipe.runner.model.parameters())
    per_rank = f" (rank 0 holds {local / 1e6:.1f}M)" if pipe.tp is not None else ""
    weights = f" weights={pipe.weights}" if pipe.weights else ""
    cfg, s, runner = pipe.world.model, pipe.settings, pipe.runner
    text = (f"[owl] world={pipe.world.name}{label} params={n_params / 1e6:.1f}M{per_rank}{weights} "
            f"rope={cfg.rope_impl} window={pipe.window} alpha={pipe.alpha} "
            f"schedule={'>'.join(f'{t:g}' for t in pipe.schedule)}"
            f"{f' guidance={pipe.guidance:g}' if pipe.guidance != 1 else ''} | {s.describe()}")
    for part in (pipe.tp, pipe.stages):
        if part is not None:
            text += "\n" + part.describe()
    if runner.kv_plan is not None and s.kv != KVSettings():
        text += f"\n[owl] kv plan: {describe_plan(runner.kv_plan)}"
    if runner.describe():
        text += "\n" + runner.describe()
    if s.compile and s.device == "cpu" and "flex" in (s.attn_backend, s.attn_backend_decode):
        text += ("\n[owl] compile: FlexAttention stays eager on CPU (inductor's CPU lowering fails for these "
                 "shapes); the rest of every block is compiled")
    return text
