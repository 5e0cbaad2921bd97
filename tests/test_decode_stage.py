"""The decoder on a thread beside the generator (owl_wms/engine/decode_stage.py): the same
frames in the same order as decoding in line, in float32 and bf16, across hard cuts, bias
changes and recomputes that re-encode decoded frames while the thread decodes; back-pressure;
frames dropped by a discard are counted and never come out; a failing decode is raised."""
import threading

import numpy as np
import pytest
import torch

from owl_wms.engine import CausvidPipeline
from owl_wms.engine.decode_stage import DecodeStage
from owl_wms.settings import KVSettings

from .conftest import REPO, fp32_settings

TINY = REPO / "checkpoints" / "untrained-tiny"


def script(frames: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(2, generator=g) * 3, (torch.rand(11, generator=g) > 0.7).float()) for _ in range(frames)]


def pipeline(dtype):
    settings = fp32_settings(kv_recompute_every=3, kv_recompute_anchor="decoded").replace(
        dtype=dtype, kv=KVSettings(ring_mode="inplace", fmt_k="int8", fmt_v="int8"))
    pipe = CausvidPipeline.from_checkpoint(TINY, settings=settings, verbose=False)
    pipe.load_clip(0)
    return pipe


def events(pipe, f: int):
    if f == 4:
        pipe.kv_cache_attention_bias = -0.5
    if f == 7:
        pipe.restart_from_buffer()  # a hard cut: the frames before it are still the script's


def in_line(dtype, frames):
    pipe = pipeline(dtype)
    out = []
    for f, controls in enumerate(script(frames)):
        events(pipe, f)
        out.append(pipe.decode(pipe.generate(*controls)).numpy())
    return out


def beside(dtype, frames, depth):
    pipe = pipeline(dtype)
    stage = DecodeStage(lambda latent: pipe.decode(latent).numpy(), threads=1, depth=depth)
    out = []
    try:
        for f, controls in enumerate(script(frames)):
            events(pipe, f)
            stage.submit(pipe.generate(*controls), tag=f)
            out += list(stage.ready())
        out += list(stage.drain())
    finally:
        stage.close()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_frames_decoded_beside_the_generator_are_the_frames_decoded_in_line(dtype):
    frames = 12
    expected = in_line(dtype, frames)
    for depth in (1, 3):
        got = beside(dtype, frames, depth)
        assert [tag for tag, _ in got] == list(range(frames))  # every frame, in order
        for f, (_, frame) in enumerate(got):
            assert np.array_equal(frame, expected[f]), f"frame {f} differs (depth {depth})"
    assert len({e.tobytes() for e in expected}) == frames  # the frames move: the comparison means something


def test_submit_waits_while_the_queue_is_full_and_never_holds_more():
    release = threading.Event()
    started = []

    def slow(x):
        started.append(x)
        release.wait(5)
        return x * 2

    stage = DecodeStage(slow, threads=None, depth=2)
    stage.submit(torch.tensor(0))  # taken by the thread, which waits in slow()
    while not started:
        threading.Event().wait(0.01)
    stage.submit(torch.tensor(1))
    stage.submit(torch.tensor(2))  # the queue of 2 is full now
    blocked = threading.Thread(target=stage.submit, args=(torch.tensor(3),))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "a fourth frame was taken while one decoded and two waited"
    assert stage.waiting.qsize() == 2
    release.set()
    blocked.join(5)
    assert not blocked.is_alive()
    assert [int(f) for _, f in stage.drain()] == [0, 2, 4, 6]
    stage.close()
    assert not stage.thread.is_alive()


def test_frames_in_flight_at_a_discard_never_come_out_and_are_counted():
    gate = threading.Event()
    stage = DecodeStage(lambda x: (gate.wait(5), x)[1], threads=None, depth=4)
    for i in range(3):
        stage.submit(torch.tensor(i), tag=("old", i))
    stage.discard()  # a hard cut while playing: the old world's frames are stale
    stage.submit(torch.tensor(9), tag=("new", 0))
    gate.set()
    assert [tag for tag, _ in stage.drain()] == [("new", 0)]
    assert stage.discarded == 3
    stage.close()


def test_a_failing_decode_is_raised_to_the_caller_with_its_cause():
    def broken(x):
        raise ValueError("decoder input has shape (1,); expected [batch, 16, h, w]")

    stage = DecodeStage(broken, threads=None)
    stage.submit(torch.zeros(1))
    with pytest.raises(RuntimeError, match=r"decoding a frame failed: decoder input has shape") as info:
        stage.next()
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(RuntimeError, match="decoding a frame failed"):
        stage.submit(torch.zeros(1))  # the stage stays failed: no frame is silently skipped
    stage.close()
    stage.close()  # twice is harmless


def test_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="decode depth 0 must be at least 1"):
        DecodeStage(lambda x: x, depth=0)
