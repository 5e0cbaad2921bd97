"""Two pipeline stages over torch.distributed (owl_wms/engine/stages.py), as gloo processes on
the CPU: rank 0 plans and decodes, rank 1 generates. The frames are the single process's bit for
bit in float32 across a bias change, a hard cut and recomputes from decoded frames; and each of
six faults ends both ranks within seconds with a message naming its cause, never a hang."""
import multiprocessing
import queue as queues
import socket
import time

import numpy as np
import pytest

from .conftest import REPO, time_limit
from .stage_ranks import alone, rank_main, sessions_alone, sessions_rank_main

TINY = str(REPO / "checkpoints" / "untrained-tiny")


# Ranks fork from one server process that imported torch and the engine once: spawning each
# rank would import them again (seconds of CPU a rank, dozens of ranks here). The server has run
# no torch op, so no thread pool is forked.
RANKS = multiprocessing.get_context("forkserver")
RANKS.set_forkserver_preload(["torch", "torch.distributed", "owl_wms.engine", "owl_wms.engine.sessions",
                              "owl_wms.parallel", "tests.stage_ranks"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, limit_s: float = 30, world: int = 2) -> dict:
    """Every rank's report {rank: (outcome, message, data)}; fails if one is still running after
    the time limit (a hang). ``world`` 3: a two-rank tensor-parallel mesh beside rank 0."""
    reports = RANKS.Queue()
    port = free_port()
    target = sessions_rank_main if scenario.startswith("sessions") else rank_main
    procs = [RANKS.Process(target=target, args=(r, port, TINY, scenario, reports, world)) for r in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    out = {}
    try:
        while len(out) < world:
            left = time_limit(limit_s) - (time.monotonic() - start)
            if left <= 0:
                raise AssertionError(f"{scenario}: a rank still runs after {time_limit(limit_s):.0f} s (a hang); "
                                     f"reports so far: {out}")
            try:
                rank, outcome, message, data = reports.get(timeout=min(left, 1.0))
                out[rank] = (outcome, message, data)
            except queues.Empty:
                pass
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return out


@pytest.fixture(scope="module")
def expected():
    return alone(TINY)


def test_two_stages_give_the_frames_of_one_process_bit_for_bit(expected):
    out = run_ranks("frames")
    assert out[0][0] == "ok" and out[1][0] == "ok", out
    shown = out[0][2]["shown"]
    assert [n for n, _ in shown] == list(range(len(expected)))
    for n, frame in shown:
        assert np.array_equal(frame, expected[n]), f"frame {n} differs"
    assert out[1][2] == len(expected)  # frames the mesh made
    assert len({e.tobytes() for e in expected}) == len(expected)


def test_a_tensor_parallel_mesh_gives_the_frames_of_one_process_bit_for_bit(expected):
    out = run_ranks("frames", limit_s=60, world=3)
    assert all(out[r][0] == "ok" for r in range(3)), out
    shown = out[0][2]["shown"]
    assert [n for n, _ in shown] == list(range(len(expected)))
    for n, frame in shown:
        assert np.array_equal(frame, expected[n]), f"frame {n} differs"
    assert out[1][2] == out[2][2] == len(expected)  # both mesh ranks made every frame


def test_a_call_count_mismatch_in_a_tensor_parallel_mesh_ends_every_rank_with_the_cause():
    out = run_ranks("extra_call", limit_s=60, world=3)
    for rank in range(3):
        outcome, message = out[rank][:2]
        assert outcome == "error" and "made 3 model calls" in message and "expected 2" in message, out


def test_a_cache_reset_on_one_mesh_rank_trips_the_state_digest_before_the_next_step_on_every_rank():
    out = run_ranks("reset_follower", limit_s=60, world=3)
    for rank in range(3):
        outcome, message = out[rank][:2]
        assert outcome == "error" and "state digest: rank 2's cache holds" in message \
            and "a cache reset or write on one rank only" in message, out


def test_two_stages_of_several_sessions_make_the_latents_of_one_process_bit_for_bit():
    """The server's shape: sessions join, leave, restart and recompute; rank 1 makes each step in
    one batched call over the rows of its ring."""
    want = sessions_alone(TINY)
    out = run_ranks("sessions")
    assert out[0][0] == "ok" and out[1][0] == "ok", out
    got = out[0][2]
    assert set(got) == set(want) and len(want) == 18
    for key in want:
        assert np.array_equal(got[key], want[key].numpy()), f"session {key[0]} step {key[1]} differs"
    assert out[1][2] == len(want)  # frames the mesh made


def test_a_tensor_parallel_mesh_of_several_sessions_makes_the_latents_of_one_process_bit_for_bit():
    """``inference.serve --pp 2 --tp 2``: ranks 1 and 2 split the heads of every batched step."""
    want = sessions_alone(TINY)
    out = run_ranks("sessions", limit_s=60, world=3)
    assert all(out[r][0] == "ok" for r in range(3)), out
    got = out[0][2]
    assert set(got) == set(want)
    for key in want:
        assert np.array_equal(got[key], want[key].numpy()), f"session {key[0]} step {key[1]} differs"
    assert out[1][2] == out[2][2] == len(want)  # both mesh ranks made every frame


def test_a_session_row_reset_on_one_mesh_rank_trips_the_state_digest_on_every_rank():
    out = run_ranks("sessions_reset_follower", limit_s=60, world=3)
    for rank in (1, 2):
        assert out[rank][0] == "error" and "state digest: rank 2's cache holds" in out[rank][1], out
    assert out[0][0] == "error" and "rank 1 stopped" in out[0][1] and "state digest" in out[0][1], out


def test_a_step_that_fails_on_one_mesh_rank_after_its_model_calls_ends_every_rank_with_the_cause():
    """The mesh votes after each step too: no rank answers rank 0 or waits in a lifecycle check
    for ranks that have stopped."""
    out = run_ranks("sessions_follower_fails", limit_s=60, world=3)
    for rank in range(3):
        assert out[rank][0] == "error" and "rank 2: injected: this rank's step failed" in out[rank][1], out
    # rank 0 hears it as the answer to that step, never later (the step's frames were never sent)
    assert "rank 1 stopped" in out[0][1] and "sessions.step(controls)" in out[0][2] and "shut_down" not in out[0][2], out


def test_a_sessions_call_count_mismatch_ends_both_ranks_with_the_cause():
    out = run_ranks("sessions_extra_call")
    assert out[1][0] == "error" and "rank 1 made 3 model calls" in out[0][1] + out[1][1], out
    assert out[0][0] == "error" and "expected 2" in out[0][1], out


def test_the_mesh_waits_for_rank_0s_next_step_as_long_as_rank_0_likes(expected):
    """A paused game or an idle server sends nothing for longer than tp_timeout_s; only a
    result rank 0 waits for has that deadline."""
    out = run_ranks("idle")
    assert out[0][0] == "ok" and out[1][0] == "ok", out
    shown = out[0][2]["shown"]
    assert [n for n, _ in shown] == list(range(len(expected)))
    assert all(np.array_equal(frame, expected[n]) for n, frame in shown)


def test_a_tensor_parallel_mesh_waits_for_rank_0s_next_step_as_long_as_rank_0_likes(expected):
    """The mesh's other ranks wait for their leader's next step as patiently as the leader waits
    for rank 0's (a collective would give up after tp_timeout_s)."""
    out = run_ranks("idle", limit_s=60, world=3)
    assert all(out[r][0] == "ok" for r in range(3)), out
    shown = out[0][2]["shown"]
    assert [n for n, _ in shown] == list(range(len(expected)))
    assert all(np.array_equal(frame, expected[n]) for n, frame in shown)


def test_break_it_1_ranks_started_with_different_plans_fail_at_start_up():
    out = run_ranks("plan_mismatch")
    for rank in (0, 1):
        outcome, message, _ = out[rank]
        assert outcome == "error" and "started with different settings" in message, out
        assert "settings.kv_recompute_every=4" in message or "kv_recompute_every='4'" in message, message


def test_break_it_2_a_generator_call_count_mismatch_fails_fast():
    out = run_ranks("extra_call")
    assert out[1][0] == "error" and "made 3 model calls" in out[1][1] and "expected 2" in out[1][1], out
    assert out[0][0] == "error" and "rank 1 stopped" in out[0][1] and "made 3 model calls" in out[0][1], out


def test_break_it_3_a_recompute_without_its_context_frames_fails_before_the_header_is_sent():
    out = run_ranks("recompute_without_frames")
    assert out[0][0] == "error" and "the recompute envelope" in out[0][1] and "carries no context frames" in out[0][1]
    assert out[1][0] == "error" and "rank 0" in out[1][1] and "carries no context frames" in out[1][1], out
    assert "rank 1 stopped because" in out[1][1]  # the mesh heard it from rank 0: it never got the envelope


def test_break_it_4_a_cache_reset_on_one_side_trips_the_state_digest():
    out = run_ranks("reset_one_side")
    assert out[0][0] == "error" and "state digest" in out[0][1] and "a cache reset or write on one side" in out[0][1]
    assert out[1][0] == "error" and "state digest" in out[1][1], out


def test_break_it_5_a_start_frame_drift_on_one_side_trips_the_periodic_all_gather():
    out = run_ranks("drift")
    for rank in (0, 1):
        outcome, message, _ = out[rank]
        assert outcome == "error" and "periodic lifecycle check" in message and "since_anchor" in message, out


def test_break_it_6_a_result_delayed_past_a_hard_cut_is_dropped_by_epoch_and_never_shown():
    out = run_ranks("late_result")
    expected = alone(TINY, bias=False)  # one process: a restart at frame 7, no bias change
    assert out[0][0] == "ok" and out[1][0] == "ok", out
    report = out[0][2]
    shown, dropped, cut_at = report["shown"], report["dropped"], report["cut_at"]
    numbers = [n for n, _ in shown]
    assert dropped >= 1 and len(numbers) == len(expected) - dropped
    assert numbers == sorted(numbers) and 6 not in numbers  # the late frame (the last before the cut) never came out
    assert numbers[:cut_at] == list(range(cut_at))
    # the frames on both sides of the cut are that process's
    assert all(n >= 7 for n, _ in shown[cut_at:])
    for n, frame in shown:
        assert np.array_equal(frame, expected[n]), f"frame {n} differs"


def test_an_unknown_envelope_version_or_a_reset_without_frames_is_refused_before_anything_runs():
    from types import SimpleNamespace

    from owl_wms.engine.lifecycle import Lifecycle
    from owl_wms.engine.stages import Envelope, Mesh, StageError, check_plan

    life = Lifecycle(n_steps=2)
    mesh = SimpleNamespace(pipe=SimpleNamespace(lifecycle=life))  # what Mesh.check reads
    plan = Lifecycle(n_steps=2).cut(np.zeros((2, 4, 2, 2), np.float32), None, None)
    with pytest.raises(StageError, match=r"envelope version 2 \(Envelope\); this build speaks 1"):
        Mesh.check(mesh, Envelope(plan, version=2))
    with pytest.raises(StageError, match=r"envelope version None \(dict\)"):
        Mesh.check(mesh, {"plan": plan})
    plan.history = None
    with pytest.raises(StageError, match="carries no context frames; the mesh rebuilds its cache only from"):
        Mesh.check(mesh, Envelope(plan))
    with pytest.raises(StageError, match="the cut envelope .* carries no context frames"):
        check_plan(plan, life)
    assert life.call_id == 0  # nothing ran


def test_the_sessions_mesh_refuses_a_bad_row_or_version_before_anything_runs():
    from types import SimpleNamespace

    from owl_wms.engine.session_stages import SessionsMesh, StepEnvelope
    from owl_wms.engine.stages import Envelope, StageError

    mesh = SimpleNamespace(sessions=SimpleNamespace(capacity=2), pipes={})  # what the checks read
    mesh.pipe_at = lambda row: SessionsMesh.pipe_at(mesh, row)
    for row in (2, -1, None, "0"):
        with pytest.raises(StageError, match=r"envelope for session row .*; this mesh has rows 0..1"):
            SessionsMesh.plans_of(mesh, Envelope(plan=None, session=row))
        with pytest.raises(StageError, match=r"envelope for session row .*; this mesh has rows 0..1"):
            SessionsMesh.plans_of(mesh, StepEnvelope({row: None}))
    with pytest.raises(StageError, match="step envelope version 2; this build speaks 1"):
        SessionsMesh.plans_of(mesh, StepEnvelope({}, version=2))
    assert mesh.pipes == {}  # no session was opened
