"""One rank of a tensor-parallel two-step decode of a golden file (test_tp starts two under torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.tp_golden_worker GOLDEN OUT [RING_MODE]

Rank 0 drives the pipeline with the golden history, noise and controls and writes every x0 to OUT.
"""
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from inference.causvid_pipeline import CausvidPipeline
from inference.flags import resolve_settings
from owl_wms.parallel import ParallelContext
from tests.conftest import fp32_settings, golden_decode, load_golden, tiny_world


def main(golden_path: str, out: str, ring_mode: str = "") -> None:
    tp = ParallelContext.launch(2, "cpu", timeout_s=60, check_every=1)
    golden = load_golden(Path(golden_path))
    kv = resolve_settings({}, {"OWL_RING_MODE": ring_mode} if ring_mode else {}).kv
    pipe = CausvidPipeline(golden["model"], None, tiny_world(golden["cfg"], golden["window"]), fp32_settings(kv=kv),
                           verbose=False, tp=tp)
    if tp.is_leader:
        x0 = golden_decode(pipe, golden["t"])
        pipe.close()
        save_file({"x0": torch.cat(x0, dim=1).contiguous()}, out)
    else:
        pipe.tp.follow()
    tp.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
