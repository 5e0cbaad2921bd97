"""The engine: ``CausvidPipeline`` (pipeline.py) runs the world model frame by frame over a KV
cache; its collaborators are the cache lifecycle, the tensor-parallel lockstep, the cache-free
baseline, snapshots and the profiler."""
from .lifecycle import Lifecycle, LifecycleError, Phase, StepPlan
from .pipeline import CausvidPipeline
from .snapshot import STATE_FORMAT, read_state

__all__ = ["STATE_FORMAT", "CausvidPipeline", "Lifecycle", "LifecycleError", "Phase", "StepPlan", "read_state"]
