"""Fault injection for tests that run the apps in child processes (torchrun ranks, A/B workers).

A test puts this folder first on PYTHONPATH and names a fault in TEST_FAULT; Python imports this
module at start-up in every child, which breaks the engine on purpose:
- TP faults act on rank 1 only: "settings" (another noise seed), "calls" (a stray model call at
  frame 2), "raise" (an exception before frame 3), "envelope" (this rank loses track of a step);
- "nan_scale@NAME": the A/B worker of variant NAME reads values back through a broken (0/0) scale.
"""
import os
import sys

FAULT = os.environ.get("TEST_FAULT", "")


def _tp_fault(fault: str):
    from owl_wms.engine.pipeline import CausvidPipeline
    from owl_wms.engine.planner import FramePlanner
    from owl_wms.engine.tensor_parallel import TensorParallelSteps

    if fault == "settings":
        os.environ["OWL_SEED"] = str(int(os.environ.get("OWL_SEED", "0")) + 1)
        return
    execute, finish, run = CausvidPipeline.execute, FramePlanner.finish, TensorParallelSteps.run

    def broken_execute(self, plan):
        if fault == "raise" and plan.generates and self.lifecycle.frame_index == 3:
            raise RuntimeError("injected fault before frame 3's first model call")
        return execute(self, plan)

    def broken_finish(self, plan, latent, calls):
        if fault == "calls" and plan.generates and self.lifecycle.frame_index == 2:
            calls += 1  # a stray model call
        return finish(self, plan, latent, calls)

    def broken_run(self, plan):
        if fault == "envelope" and plan is None and self.pipe.lifecycle.call_id == 2:
            self.pipe.lifecycle.call_id += 1
        return run(self, plan)

    CausvidPipeline.execute, FramePlanner.finish, TensorParallelSteps.run = broken_execute, broken_finish, broken_run


def _nan_scale():
    from owl_wms.engine.runner import ModelRunner

    new_cache = ModelRunner.new_cache

    def broken_cache(self, *args, **kwargs):
        cache = new_cache(self, *args, **kwargs)
        read = cache.attend_window
        cache.attend_window = lambda layer, k=None, v=None: (lambda r: (r[0], r[1] * float("nan"), r[2]))(
            read(layer, k, v))
        return cache

    ModelRunner.new_cache = broken_cache


if FAULT.startswith("nan_scale@"):
    variant = FAULT.split("@", 1)[1]
    if any(arg.endswith(os.path.join(variant, "spec.json")) for arg in sys.argv):
        _nan_scale()
elif FAULT and os.environ.get("RANK") == "1":
    _tp_fault(FAULT)
