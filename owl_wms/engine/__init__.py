"""The engine: ``CausvidPipeline`` (pipeline.py) runs one session of the world model frame by
frame over a KV cache, ``Sessions`` (sessions.py) runs many in one batched call, and
``ModelRunner`` (runner.py) owns the model, the decoder and how a model call runs; a session's
``FramePlanner`` (planner.py) makes its step plans. Their collaborators are the cache lifecycle,
the tensor-parallel lockstep, the cache-free baseline, snapshots and the profiler."""
from .lifecycle import Lifecycle, LifecycleError, Phase, StepPlan
from .pipeline import CausvidPipeline
from .runner import ModelRunner
from .sessions import Sessions
from .snapshot import STATE_FORMAT, read_state

__all__ = ["STATE_FORMAT", "CausvidPipeline", "Lifecycle", "LifecycleError", "ModelRunner", "Phase", "Sessions",
           "StepPlan", "read_state"]
