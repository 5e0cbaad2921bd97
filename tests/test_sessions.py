"""Several sessions in one batched model call (owl_wms/engine/sessions.py): each session's frames
are its frames alone, its events touch nobody else, sessions join and leave between frames, and
the headless app renders N rollouts in one run."""
import numpy as np
import pytest
import torch

from inference.causvid_pipeline import CausvidPipeline
from owl_wms.engine.sessions import Sessions, batch_rows
from owl_wms.settings import KVSettings

from .conftest import REPO, fp32_settings, random_model, run_main, tiny_config, tiny_world

WINDOW = 5
RING = {"int8": KVSettings(ring_mode="inplace", fmt_k="int8", fmt_v="int8"),
        "bf16": KVSettings(ring_mode="inplace")}


def history(cfg, seed: int, frames: int = WINDOW):
    g = torch.Generator().manual_seed(seed)
    c, s = cfg.channels, cfg.sample_size
    return (torch.randn(frames, c, s, s, generator=g), torch.randn(frames, 2, generator=g),
            (torch.rand(frames, 11, generator=g) > 0.5).float())


def actions(seed: int, frames: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, generator=g) * 3, (torch.rand(11, generator=g) > 0.7).float()) for _ in range(frames)]


def events(pipe, i: int, f: int):
    """The second session cuts to a new history at frame 5, the third turns on soft forgetting
    at frame 3, and a recompute falls due every 4 frames in each."""
    if i == 1 and f == 5:
        pipe.hard_cut(*history(pipe.cfg, seed=50))
    if i == 2 and f == 3:
        pipe.kv_cache_attention_bias = -1.0


def batched(cfg, model, settings, n, frames, with_events=True, guidance=1.0):
    batch = Sessions(model, None, tiny_world(cfg, WINDOW).with_guidance(guidance), settings, capacity=n, verbose=False)
    pipes = [batch.open(seed=10 + i, clip=None) for i in range(n)]
    for i, pipe in enumerate(pipes):
        pipe.prefill(*history(cfg, seed=i))
    scripts = [actions(100 + i, frames) for i in range(n)]
    out = [[] for _ in range(n)]
    for f in range(frames):
        for i, pipe in enumerate(pipes):
            if with_events:
                events(pipe, i, f)
        latents = batch.step({pipe: scripts[i][f] for i, pipe in enumerate(pipes)})
        for i, pipe in enumerate(pipes):
            out[i].append(latents[pipe])
    return [torch.cat(x, dim=1) for x in out], pipes


def alone(cfg, model, settings, i, frames, guidance=1.0):
    world = tiny_world(cfg, WINDOW).with_guidance(guidance)
    pipe = CausvidPipeline(model, None, world, settings.replace(seed=10 + i), verbose=False)
    pipe.prefill(*history(cfg, seed=i))
    out = []
    for f, (mouse, buttons) in enumerate(actions(100 + i, frames)):
        events(pipe, i, f)
        out.append(pipe.generate(mouse, buttons))
    return torch.cat(out, dim=1)


# A session's frames in a batch differ from its frames alone only by float rounding: the batched
# matmuls sum in another order (another kernel or thread split for more rows). A bf16 cache keeps
# that at rounding level; an int8 cache can store a value at a rounding tie one code step away,
# and the difference grows a little over the frames that read it.
TOLERANCE = {"bf16": 1e-4, "int8": 0.05}


@pytest.mark.parametrize("storage,guidance", [("bf16", 1.0), ("int8", 1.0), ("bf16", 1.5)])
def test_each_session_in_a_batch_makes_its_frames_alone(storage, guidance):
    """Three sessions, each with its own history, seed, controls and events (a hard cut, a bias
    change, recomputes), over 16 frames (three wrap-arounds of the 5-slot ring): each session's
    latents are the latents the same session makes in a pipeline of its own, with control
    guidance too (the rest call is batched like the others)."""
    cfg = tiny_config()
    model = random_model(cfg)
    settings = fp32_settings(kv=RING[storage], kv_recompute_every=4)
    frames, pipes = batched(cfg, model, settings, 3, 16, guidance=guidance)
    for i in range(3):
        assert (frames[i] - alone(cfg, model, settings, i, 16, guidance)).abs().max() <= TOLERANCE[storage]
    assert [p.cache_epoch for p in pipes] == [1, 2, 1]  # the cut was the second session's alone
    assert [p.kv_cache_attention_bias for p in pipes] == [0.0, 0.0, -1.0]


def test_one_sessions_events_leave_the_others_frames_bit_for_bit():
    """A hard cut, a bias change and recomputes in the second and third sessions change nothing
    in the first: its frames are identical bit for bit to a run of the same batch without those
    events."""
    cfg = tiny_config()
    model = random_model(cfg)
    settings = fp32_settings(kv=RING["int8"], kv_recompute_every=4)
    with_events, _ = batched(cfg, model, settings, 3, 12)
    without, _ = batched(cfg, model, settings, 3, 12, with_events=False)
    assert torch.equal(with_events[0], without[0])
    assert not torch.equal(with_events[1], without[1]) and not torch.equal(with_events[2], without[2])


def test_sessions_join_and_leave_between_frames_and_snapshots_stay_their_own():
    """A session that joins later starts from its own history; one that leaves frees its row for
    the next; a session's snapshot restores its own state only; a step may make frames for some
    sessions and not others (the idle ones keep their history)."""
    cfg = tiny_config()
    model = random_model(cfg)
    settings = fp32_settings(kv=RING["int8"])
    batch = Sessions(model, None, tiny_world(cfg, WINDOW), settings, capacity=3, verbose=False)
    a = batch.open(seed=1, clip=None)
    a.prefill(*history(cfg, seed=0))
    script = actions(7, 12)
    first = [batch.step({a: script[f]})[a] for f in range(3)]
    state = a.get_state()
    b = batch.open(seed=2, clip=None)
    b.prefill(*history(cfg, seed=1))
    for f in range(3, 6):
        batch.step({a: script[f], b: script[f]})
    batch.step({b: script[6]})  # a idles a step
    batch.close(b)
    c = batch.open(seed=3, clip=None)  # takes b's row
    assert batch.rows[c] == 1 and len(batch) == 2
    c.prefill(*history(cfg, seed=2))
    batch.step({a: script[6], c: script[0]})
    a.load_state(state)  # back to after frame 2: the same frames again, whatever c does meanwhile
    again = [batch.step({a: script[f], c: script[f]})[a] for f in range(3, 6)]
    reference = CausvidPipeline(model, None, tiny_world(cfg, WINDOW), settings.replace(seed=1), verbose=False)
    reference.prefill(*history(cfg, seed=0))
    expected = [reference.generate(*script[f]) for f in range(6)]
    for got, want in zip(first + again, expected):
        assert (got - want).abs().max() <= TOLERANCE["int8"]
    with pytest.raises(RuntimeError, match="all 3 sessions are open"):
        batch.open(clip=None), batch.open(clip=None)


def test_a_batch_needs_the_ring_and_says_why():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="need the in-place ring cache .* ring_mode is roll"):
        Sessions(random_model(cfg), None, tiny_world(cfg, WINDOW), fp32_settings(kv=KVSettings(fmt_k="int8",
                                                                                               fmt_v="int8")))


def test_calls_are_padded_to_powers_of_two():
    assert [batch_rows(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_compiled_sessions_build_one_graph_per_padded_size_as_they_join_and_leave():
    """Compiled, the batched call makes one graph per padded size (1, 2, 4), then none as
    sessions come and go, cut and change their bias."""
    import torch._dynamo.config
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    cfg = tiny_config(n_layers=2)  # a global and a local layer: three graphs compiled cold
    batch = Sessions(random_model(cfg), None, tiny_world(cfg, WINDOW), fp32_settings(kv=RING["int8"], compile=True),
                     capacity=4, verbose=False)
    open_ = []

    def churn():
        for n in (1, 2, 3, 4, 2, 1):
            while len(open_) < n:
                open_.append(batch.open(seed=len(open_), clip=None))
                open_[-1].prefill(*history(cfg, seed=len(open_)))
            while len(open_) > n:
                batch.close(open_.pop())
            open_[0].kv_cache_attention_bias = -0.5 * n
            for _ in range(WINDOW + 1):  # a wrap-around at every size
                batch.step({p: (torch.ones(2), torch.zeros(11)) for p in open_})
        open_[0].hard_cut(*history(cfg, seed=9))

    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        churn()
        graphs = counters["stats"]["unique_graphs"]
        churn()
    assert counters["stats"]["unique_graphs"] == graphs


def test_headless_renders_n_rollouts_in_one_run_each_its_own_seed(tmp_path):
    """``--sessions 3``: run_0.mp4 .. run_2.mp4 and f_0.npy .. f_2.npy; session i's frames are
    those of a run alone with seed + i (fp32, a bf16 ring: within one level of the uint8 frames)."""
    tiny = REPO / "checkpoints" / "untrained-tiny"
    env = {"OWL_DTYPE": "fp32", "OWL_RING_MODE": "inplace"}
    common = ["--headless", "--checkpoint", str(tiny), "--frames", "6", "--scale", "1", "--seed", "4"]
    r = run_main("inference.game_cv", [*common, "--sessions", "3", "--actions", "walk_turn,turn,forward",
                                       "--out", str(tmp_path / "run.mp4"), "--save-frames", str(tmp_path / "f.npy")],
                 env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "f_0.npy", "f_1.npy", "f_2.npy", "run_0.mp4", "run_1.mp4", "run_2.mp4"]
    for i, script in enumerate(("walk_turn", "turn", "forward")):
        one = tmp_path / f"alone{i}.npy"
        r = run_main("inference.game_cv", [*common, "--seed", str(4 + i), "--actions", script, "--out",
                                           str(tmp_path / f"alone{i}.mp4"), "--save-frames", str(one)], env)
        assert r.returncode == 0, r.stderr[-2000:]
        batch, single = np.load(tmp_path / f"f_{i}.npy").astype(int), np.load(one).astype(int)
        assert batch.shape == single.shape == (6, 64, 64, 3) and np.abs(batch - single).max() <= 1


@pytest.mark.parametrize("argv, message", [
    (["--sessions", "2"], r"--sessions 2 renders headless rollouts .*; add --headless"),
    (["--headless", "--sessions", "2", "--tp", "2"], r"drop --tp"),
    (["--headless", "--sessions", "0"], r"--sessions 0: must be a whole number in \[1, 64\]"),
    (["--headless", "--sessions", "3", "--actions", "turn,forward"], r"--actions gives 2 scripts for --sessions 3"),
])
def test_sessions_flags_are_checked(argv, message, tmp_path):
    import re

    r = run_main("inference.game_cv", ["--checkpoint", str(REPO / "checkpoints" / "untrained-tiny"), "--frames", "2",
                                       "--out", str(tmp_path / "x.mp4"), *argv], {"OWL_RING_MODE": "inplace"})
    text = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in text and re.search(message, text), text[-1500:]
    assert list(tmp_path.iterdir()) == []
