"""``torchrun --nproc-per-node 2 -m inference.game_cv --headless --pp 2``: rank 0 plans, decodes
and writes while rank 1 generates; the video is the single process's, frame for frame."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from .conftest import REPO, time_limit

SCRIPT = ([{"mouse": [4.0, 0.0], "buttons": [1] + [0] * 10}] * 5 + [{"event": "restart"}]
          + [{"mouse": [-3.0, 1.0], "buttons": [0, 1] + [0] * 9}] * 4 + [{"event": "bias", "value": -1.0}]
          + [{"mouse": [0.0, 0.0], "buttons": [1] + [0] * 10}] * 5)
ENV = {"OWL_DTYPE": "fp32", "OWL_KV_RECOMPUTE_EVERY": "4", "OWL_KV_RECOMPUTE_ANCHOR": "decoded",
       "OWL_TP_CHECK_EVERY": "3"}
SNAPSHOTS = ([{"mouse": [2.0, 0.0], "buttons": [1] + [0] * 10}] * 3 + [{"event": "snapshot"}]
             + [{"mouse": [-4.0, 1.0], "buttons": [0, 0, 0, 1] + [0] * 7}] * 5 + [{"event": "restart"}]
             + [{"mouse": [1.0, 0.0], "buttons": [0] * 11}] * 2 + [{"event": "restore"}]
             + [{"mouse": [5.0, 0.0], "buttons": [1] + [0] * 10}] * 4 + [{"event": "bias", "value": -1.0},
                                                                        {"event": "restore"}]
             + [{"mouse": [0.0, 2.0], "buttons": [0, 1] + [0] * 9}] * 3)


def render(tmp_path, name: str, *launch, threads: int, extra=(), script=SCRIPT):
    actions = tmp_path / "actions.jsonl"
    actions.write_text("".join(json.dumps(a) + "\n" for a in script))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OWL_")}, **ENV, "OWL_THREADS": str(threads)}
    out = tmp_path / f"{name}.npy"
    p = subprocess.run([sys.executable, *launch, "-m", "inference.game_cv", "--headless", "--actions", str(actions),
                        "--beside-simulator", "--out", str(tmp_path / f"{name}.mp4"), "--save-frames", str(out), *extra],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=time_limit(300))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    return np.load(out), p.stdout + p.stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The single process's frames of SCRIPT, the two- and three-rank runs' reference."""
    return render(tmp_path_factory.mktemp("one"), "one", threads=2)[0]


def test_two_stages_render_the_single_process_video_across_a_cut_a_bias_change_and_recomputes(tmp_path, one_process):
    one = one_process
    two, log = render(tmp_path, "pp", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      threads=1, extra=("--pp", "2"))
    assert one.shape[0] == 14 and np.array_equal(one, two)
    assert "wrote" in log and "(14 frames)" in log


def test_tensor_parallelism_inside_the_generating_stage_renders_the_single_process_video(tmp_path, one_process):
    """``--pp 2 --tp 2``: rank 0 decodes while ranks 1 and 2 generate, each with half the heads."""
    one = one_process
    three, log = render(tmp_path, "pptp", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                        threads=1, extra=("--pp", "2", "--tp", "2"))
    assert np.array_equal(one, three)
    assert "ranks 1-2 generate (tensor parallel" in log and "(14 frames)" in log


def test_two_stages_started_with_the_wrong_number_of_processes_say_how_many(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OWL_")}, "OWL_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "inference.game_cv", "--headless", "--pp", "2", "--tp", "2", "--frames", "2",
                        "--out", str(tmp_path / "x.mp4")], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=time_limit(120))
    assert p.returncode != 0 and "owl_wms/" not in p.stderr and "inference/" not in p.stderr, p.stderr  # torchrun's own report only
    assert p.stderr.count("error: --pp 2 --tp 2 but torchrun started 2 processes; use --nproc-per-node 3") == 2
    assert not (tmp_path / "x.mp4").exists()


def test_the_window_with_two_stages_records_the_frames_its_saved_actions_render(tmp_path):
    """Rank 0 owns the window (a replayed script with a restart: a live cut, so the frames in
    flight are dropped, never shown; then snapshots restored after a cut and a bias change); its
    recording is what a single process makes from the actions it saved."""
    script = SCRIPT + SNAPSHOTS
    actions = tmp_path / "in.jsonl"
    actions.write_text("".join(json.dumps(a) + "\n" for a in script))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OWL_")}, "OWL_DTYPE": "fp32", "OWL_THREADS": "1",
           "SDL_VIDEODRIVER": "dummy", "SDL_AUDIODRIVER": "dummy"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "inference.game_cv", "--pp", "2", "--replay", str(actions), "--scale", "1",
                        "--record", str(tmp_path / "win.mp4"), "--save-actions", str(tmp_path / "saved.jsonl")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=time_limit(300))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
    saved = [json.loads(line) for line in (tmp_path / "saved.jsonl").read_text().splitlines()]
    assert [x for x in saved if "event" in x] == [x for x in script if "event" in x]
    from inference.video import read_frames

    shown = read_frames(tmp_path / "win.mp4")
    assert shown.shape[0] == sum("mouse" in x for x in saved) >= 25  # up to a frame or two dropped at the cut
    q = subprocess.run([sys.executable, "-m", "inference.game_cv", "--headless", "--actions", str(tmp_path / "saved.jsonl"),
                        "--scale", "1", "--out", str(tmp_path / "head.mp4")], cwd=REPO,
                       env={**env, "OWL_THREADS": "2"}, capture_output=True, text=True, timeout=time_limit(300))
    assert q.returncode == 0, q.stderr
    assert np.array_equal(shown, read_frames(tmp_path / "head.mp4"))


def test_snapshots_of_a_two_stage_run_restore_the_single_process_frames(tmp_path):
    """A snapshot, then a restore after a hard cut and after a bias change, across recomputes:
    the mesh's cache and lifecycle go back with rank 0's parts."""
    one, _ = render(tmp_path, "one", threads=2, script=SNAPSHOTS)
    two, _ = render(tmp_path, "pp", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    threads=1, extra=("--pp", "2"), script=SNAPSHOTS)
    assert one.shape[0] == 17 and np.array_equal(one, two)
    assert not np.array_equal(one[3:8], one[10:15])  # the restored branch took other actions: other frames


def test_a_snapshot_with_frames_in_flight_of_a_split_mesh_or_of_a_served_session_is_refused_with_the_reason():
    from types import SimpleNamespace

    from owl_wms.engine.stages import FirstStage

    first = SimpleNamespace(ctx=SimpleNamespace(world=2), pending=[object()], ready=[], shared=False)  # what it reads
    for change, reason in ((dict(), "1 frames in flight; take them first"),
                           (dict(ctx=SimpleNamespace(world=3)), r"split the heads \(--tp 2\) are not supported"),
                           (dict(shared=True), "shares the generating rank with others")):
        vars(first).update(change)
        with pytest.raises(RuntimeError, match=reason):
            FirstStage.exchange_state(first, None)


def test_a_cache_load_the_mesh_refuses_part_way_leaves_its_cache_and_lifecycle_as_they_were():
    """A snapshot whose last cache tensor does not fit is refused after the others were copied
    in: the mesh puts back the cache and the lifecycle it had, not the half-loaded ones."""
    from types import SimpleNamespace

    import torch

    from owl_wms.engine import CausvidPipeline
    from owl_wms.engine.stages import CacheState, Mesh
    from owl_wms.settings import KVSettings

    from .conftest import fp32_settings

    settings = fp32_settings().replace(kv=KVSettings(ring_mode="inplace", fmt_k="int8", fmt_v="int8"))
    pipe = CausvidPipeline.from_checkpoint(REPO / "checkpoints" / "untrained-tiny", settings=settings, verbose=False)
    pipe.load_clip(0)
    for _ in range(3):
        pipe.generate([1.0, 0.0], [1] + [0] * 10)
    tensors, meta = pipe.cache.state_dict()
    kept = {name: t.clone() for name, t in tensors.items()}
    life = pipe.lifecycle.state()
    other = {name: (t + 1 if t.is_floating_point() else t ^ 1 if t.dtype == torch.bool else t + 1)
             for name, t in kept.items()}
    last = list(other)[-1]
    other[last] = torch.zeros(7, dtype=kept[last].dtype)  # does not fit: refused after the others went in
    mesh = SimpleNamespace(pipe=pipe, ctx=SimpleNamespace(rank=1))  # what serve_state reads
    result = Mesh.serve_state(mesh, CacheState("load", other, meta, {**life, "frame_index": 0}))
    assert result.error is not None and repr(last) in result.error, result.error
    now, _ = pipe.cache.state_dict()
    assert all(torch.equal(now[name], kept[name]) for name in kept), [n for n in kept if not torch.equal(now[n], kept[n])]
    assert pipe.lifecycle.state() == life
