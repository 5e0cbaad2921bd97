"""The engine's public import path for the apps and for users:
``from inference.causvid_pipeline import CausvidPipeline`` (the code lives in owl_wms/engine/)."""
from owl_wms.controls import BUTTONS, as_controls, to_uint8
from owl_wms.engine import STATE_FORMAT, CausvidPipeline, read_state
from owl_wms.loading import SHIPPED_WORLD as DEFAULT_CHECKPOINT

__all__ = ["BUTTONS", "DEFAULT_CHECKPOINT", "STATE_FORMAT", "CausvidPipeline", "as_controls", "read_state", "to_uint8"]
