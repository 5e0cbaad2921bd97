"""GameRFT world-model library: config, model, caches, loading, decoder."""
from .cache import StaticCache
from .config import ModelConfig, WorldConfig, load_config
from .loading import from_pretrained
from .model import GameRFT, GameRFTCore
from .settings import Settings

__all__ = ["GameRFT", "GameRFTCore", "ModelConfig", "Settings", "StaticCache", "WorldConfig",
           "from_pretrained", "load_config"]
