from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from owl_wms.config import DecoderConfig, ModelConfig, PipelineConfig, WorldConfig
from owl_wms.model import GameRFT
from owl_wms.settings import Settings

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO.parent / "shared" / "golden" / "gamerft_motion_tiny.safetensors"


def tiny_config(**overrides) -> ModelConfig:
    base = dict(sample_size=4, channels=8, n_layers=4, n_heads=2, d_model=128, tokens_per_frame=16,
                n_frames=32, local_window=3, global_window=None)
    base.update(overrides)
    return ModelConfig.from_mapping(base)


def tiny_world(cfg: ModelConfig, window: int = 5) -> WorldConfig:
    return WorldConfig(model=cfg, vae_scale=1.0, pipeline=PipelineConfig(window_frames=window),
                       decoder=DecoderConfig(), name="tiny")


def fp32_settings(backend: str = "sdpa", **kw) -> Settings:
    return Settings(device="cpu", dtype=torch.float32, attn_backend=backend, attn_backend_decode=backend, **kw)


def random_model(cfg: ModelConfig, seed: int = 0) -> GameRFT:
    torch.manual_seed(seed)
    model = GameRFT(cfg).float().eval()
    # Default init leaves AdaLN/gates small but non-zero; scale up so every layer matters.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    return model


@pytest.fixture(scope="session")
def golden():
    if not GOLDEN.is_file():
        pytest.skip(f"golden file {GOLDEN} is absent (it ships in ../shared beside the repo)")
    with safe_open(str(GOLDEN), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(GOLDEN))
    cfg = ModelConfig.from_mapping({
        k: (None if meta[k] == "null" else meta[k] == "True" if meta[k] in ("True", "False") else
            meta[k] if k == "rope_impl" else int(meta[k]))
        for k in ("sample_size", "channels", "n_layers", "n_heads", "d_model", "tokens_per_frame", "n_frames",
                  "local_window", "global_window", "causal", "rope_impl", "n_buttons")})
    model = GameRFT(cfg).float().eval()
    model.core.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    return {"cfg": cfg, "model": model, "t": tensors, "window": int(meta["window_frames"]),
            "alpha": float(meta["history_alpha"])}
