"""The fidelity evaluation: metrics are right, and the command runs on two short episodes."""
import json

import numpy as np
import pytest
import torch

from owl_wms.config import load_config
from owl_wms.maze.evaluation import frame_metrics, layout_psnr, sharpness, sharpness_ratio, standard_error
from owl_wms.maze.simulator import MazeSim


def test_frame_metrics_known_values():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    psnr, ssim = frame_metrics(a, a)
    assert psnr > 90 and abs(ssim - 1) < 1e-6
    b = np.clip(a.astype(int) + 8, 0, 255).astype(np.uint8)
    mse = ((a.astype(float) - b) ** 2).mean()
    assert abs(frame_metrics(a, b)[0] - 10 * np.log10(255**2 / mse)) < 1e-3


def test_layout_forgives_blur_and_sharpness_sees_it():
    frame = MazeSim(3).render()
    t = torch.from_numpy(frame).permute(2, 0, 1)[None].float()
    blurred = torch.nn.functional.avg_pool2d(t, 5, stride=1, padding=2, count_include_pad=False)
    blurred = blurred[0].permute(1, 2, 0).round().clamp(0, 255).byte().numpy()
    assert sharpness_ratio(frame, frame) == 1.0 and layout_psnr(frame, frame) > 90
    assert sharpness_ratio(blurred, frame) < 0.3  # the blur the rollouts show scores low...
    assert layout_psnr(blurred, frame) > frame_metrics(blurred, frame)[0] + 5  # ...and barely counts in layout
    flat = np.full_like(frame, 128)
    assert sharpness(flat) == 0.0 and sharpness_ratio(flat, frame) == 0.0
    # layout still sees a wall where the simulator has none: the frame mirrored left to right
    assert layout_psnr(frame[:, ::-1], frame) < layout_psnr(blurred, frame) - 5
    # the Laplacian's energy, by hand, on a single bright pixel: 16 at it, 1 at its 4 neighbours
    dot = np.zeros((5, 5, 3), np.uint8)
    dot[2, 2] = 255
    assert abs(sharpness(dot) - 255**2 * (16 + 4) / 9) < 1e-3


def test_standard_error_of_per_level_figures():
    assert abs(standard_error([1.0, 2.0, 3.0, 4.0]) - np.std([1, 2, 3, 4], ddof=1) / 2) < 1e-12
    assert standard_error([5.0, 5.0]) == 0.0
    assert np.isnan(standard_error([1.0]))  # one level says nothing about another


@pytest.fixture
def fp32(monkeypatch):
    """The evaluation command in fp32: the same figures to test, in a fraction of the time on CPUs
    without fast bf16 (eval_world reads the OWL_* flags as the apps do)."""
    monkeypatch.setenv("OWL_DTYPE", "fp32")


def test_eval_command_on_two_short_episodes(tmp_path, fp32):
    from scripts import eval_world

    eval_world.main(["--episodes", "2", "--frames", "5", "--tf-frames", "3", "--gap-range", "2", "5",
                     "--euler-steps", "3", "--script-frames", "8", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "eval.json").read_text())
    assert len(report["ar_psnr"]) == 5 and len(report["ar_ssim"]) == 5 and report["seeds"][0] >= 1_000_000
    assert report["frames"] == 5 and report["tf_frames"] == 3  # how it was scored, for compare_worlds to pair on
    assert all(np.isfinite(report[k]) for k in ("teacher_forced_psnr", "teacher_forced_ssim", "action_gap_db",
                                                  "teacher_forced_psnr_euler3", "copy_previous_psnr",
                                                  "action_response_psnr", "sim_previous_action_psnr",
                                                  "sim_foreign_action_psnr", "sim_foreign_rollout_psnr_gap_range",
                                                  "turn_following", "turn_shift_model", "turn_following_teacher_forced",
                                                  "rest_walk_psnr",
                                                  "nudged_walk_psnr"))
    assert report["rest_walk_psnr"] != report["nudged_walk_psnr"]  # the two mice are two inputs
    assert report["turn_shift_sim"] > 0.5  # the simulator's view slides under a held turn
    # every turn step is counted once, in the open or facing a near wall (2 levels x 2 turns x 16 frames)
    assert report["turn_frames_counted_open"] + report["turn_frames_counted_near_wall"] == report["turn_frames_counted"] == 64
    assert abs(report["ar_psnr_gap_range"] - report["ar_psnr_foreign_actions_gap_range"]
               - report["action_gap_db"]) < 1e-9
    # the target figures level by level: their means are the report's figures
    per_level, error = report["per_level"], report["standard_error"]
    assert set(per_level) == set(error) == {"teacher_forced_psnr", "action_gap_db"}  # 5 frames: no frame 16
    for key, values in per_level.items():
        assert len(values) == 2 and abs(np.mean(values) - report[key]) < 1e-9
        assert abs(error[key] - abs(values[0] - values[1]) / 2) < 1e-9  # two levels: half their difference
    assert (tmp_path / "psnr_curve.png").stat().st_size > 1000
    import matplotlib.image

    # 2 episodes x (simulator, teacher-forced, autoregressive), frames 1 and 5: the teacher-forced
    # row spans the rollout's 5 frames though the teacher-forced figures use 3
    sheet = matplotlib.image.imread(tmp_path / "rollouts.png")
    assert sheet.shape[:2] == (2 * 3 * 64 + 2, 2 * 64)
    assert report["sheet_rows"] == ["simulator", "teacher-forced", "autoregressive"]
    # frame 1 comes from the same real history and noise in both model rows; frame 5 does not
    tf_row, ar_row = sheet[64:128], sheet[128:192]
    assert np.array_equal(tf_row[:, :64], ar_row[:, :64]) and not np.array_equal(tf_row[:, 64:], ar_row[:, 64:])
    # turns.png: 2 episodes x 2 turns x the same rows, frames 1, 3, ... of the 16 per turn
    turns = matplotlib.image.imread(tmp_path / "turns.png")
    assert turns.shape[:2] == (4 * 3 * 64 + 3 * 2, 8 * 64)
    # one step from the simulator's frames, the shipped world turns the view the simulator's way
    assert report["turn_shift_teacher_forced"] > 0
    assert report["turn_following_teacher_forced"] == report["turn_shift_teacher_forced"] / report["turn_shift_sim"]
    # what a player sees, per frame: layout and sharpness of the rollouts and of the two scripts
    assert len(report["ar_layout_psnr"]) == len(report["ar_sharpness_ratio"]) == 5
    assert all(layout > psnr for layout, psnr in zip(report["ar_layout_psnr"], report["ar_psnr"]))
    assert report["layout_psnr_at_64"] is None  # 5 frames
    for name in ("walk_and_turn", "turn_in_place"):
        scripted = report[name]
        assert scripted["frames"] == 8 and len(scripted["sharpness_ratio"]) == 8
        assert 0 < scripted["sharpness_ratio_min"] == min(scripted["sharpness_ratio_min_per_level"]) \
            <= min(scripted["sharpness_ratio"])
        assert 0 <= scripted["frames_below_sharp_enough"] <= 16
        image = matplotlib.image.imread(tmp_path / f"{name}.png")  # 2 levels x (simulator, model), frames 1, 5
        assert image.shape[:2] == (2 * 2 * 64 + 2, 2 * 64)
    assert report["walk_and_turn_sharpness_min"] == report["walk_and_turn"]["sharpness_ratio_min"]
    # turn following level by level: each level's two turns (the figures over all levels pool every frame)
    for key in ("turn_following", "turn_following_teacher_forced"):
        shares = report["turn_following_per_level"][key]
        assert len(shares) == 2 and min(shares) <= report[key] <= max(shares)
    # and the slides they are made of: every level turns the same number of frames, so the pooled
    # slides are the levels' means
    slides = report["turn_shift_per_level"]
    for key, pooled in (("model", "turn_shift_model"), ("teacher_forced", "turn_shift_teacher_forced"),
                        ("sim", "turn_shift_sim")):
        assert len(slides[key]) == 2 and abs(np.mean(slides[key]) - report[pooled]) < 1e-9
    for level in range(2):
        assert abs(report["turn_following_per_level"]["turn_following"][level] -
                   slides["model"][level] / slides["sim"][level]) < 1e-9


def test_eval_scores_the_schedule_it_is_given(tmp_path, fp32, capsys):
    """--schedule and --guidance replace the checkpoint's sampler (recorded in the report); bad ones are refused.
    --start scores later frames (recorded), never earlier than the world's window."""
    from scripts import eval_world

    short = ["--episodes", "1", "--frames", "2", "--tf-frames", "2", "--gap-range", "1", "2", "--turn-frames", "2",
             "--sheet-episodes", "0", "--script-frames", "2"]
    window = load_config(eval_world.DEFAULT_CHECKPOINT / "config.yaml").pipeline.window_frames
    eval_world.main(short + ["--out", str(tmp_path / "two")])
    eval_world.main(short + ["--schedule", "1", "0.5", "0.25", "0", "--rest-frames", "0", "--start", str(window + 8),
                             "--guidance", "1.5", "--out", str(tmp_path / "three")])
    two, three = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("two", "three"))
    assert two["schedule"] == [1.0, 0.25, 0.0] and three["schedule"] == [1.0, 0.5, 0.25, 0.0]
    assert two["guidance"] == 1.0 and three["guidance"] == 1.5
    with pytest.raises(SystemExit):
        eval_world.main(short + ["--guidance", "-2", "--out", str(tmp_path / "unguided")])
    assert "--guidance -2: must be a number in [0, 8]" in capsys.readouterr().err
    assert two["start"] == window and three["start"] == window + 8  # the shipped world's window, then --start
    assert "dtype=float32" in two["settings"] and "threads" in two["machine"]  # what the figures were made with
    with pytest.raises(SystemExit):
        eval_world.main(short + ["--start", str(window - 1), "--out", str(tmp_path / "early")])
    assert f"--start {window - 1}: must be at least the world's window, {window} frames" in capsys.readouterr().err
    # --rest-frames 0 skips the at-rest diagnostic (it used to report NaN); a negative count is refused
    assert "rest_walk_psnr" in two and "rest_walk_psnr" not in three
    with pytest.raises(SystemExit):
        eval_world.main(short + ["--rest-frames", "-1", "--out", str(tmp_path / "neg")])
    with pytest.raises(SystemExit):
        eval_world.main(short + ["--script-frames", "0", "--out", str(tmp_path / "none")])
    assert two["teacher_forced_psnr"] != three["teacher_forced_psnr"]
    with pytest.raises(ValueError, match="schedule"):
        eval_world.main(short + ["--schedule", "1", "0.5", "--out", str(tmp_path / "bad")])
    # levels training draws from (a check for over-fitting) are scored when asked, and said not to be held out
    capsys.readouterr()
    eval_world.main(short + ["--seed-offset", "-1000000", "--rest-frames", "0", "--out", str(tmp_path / "train")])
    train = json.loads((tmp_path / "train" / "eval.json").read_text())
    assert two["held_out"] and two["seeds"] == [1_000_000]
    assert not train["held_out"] and train["seeds"] == [0]
    assert "(levels 0-0: not held out)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        eval_world.main(short + ["--seed-offset", "-1000005", "--out", str(tmp_path / "below")])
    assert "--seed-offset -1000005: the first level would be -5; level seeds start at 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        eval_world.main(short + ["--episodes", "0", "--out", str(tmp_path / "none")])
    assert "--episodes 0: must be >= 1" in capsys.readouterr().err


def test_rollout_sheet_puts_the_real_frames_above_the_predictions():
    from owl_wms.maze.evaluation import rollout_sheet

    real = np.zeros((6, 4, 4, 3), np.uint8)
    pred = np.full((6, 4, 4, 3), 100, np.uint8)
    pred[2, 0, 0] = 7
    sheet = rollout_sheet([(real, pred), (real, pred)], every=2, gap=1)
    assert sheet.shape == (4 * 4 + 1, 3 * 4, 3)  # columns: frames 1, 3, 5
    assert (sheet[:4] == 0).all() and sheet[4, 4, 0] == 7 and (sheet[8] == 255).all()
    with pytest.raises(ValueError, match="differ in shape"):
        rollout_sheet([(real, pred[:5])], every=2)


def test_action_response_isolates_the_actions():
    """Same actions and noise give the same frame; the prediction is not committed to the cache."""
    from inference.causvid_pipeline import CausvidPipeline
    from owl_wms.maze.data import HELD_OUT_SEED
    from owl_wms.maze.evaluation import Episode, action_response, copy_previous

    pipe = CausvidPipeline.from_checkpoint(clip=None, verbose=False)
    a, b = Episode(pipe, HELD_OUT_SEED, 3), Episode(pipe, HELD_OUT_SEED + 1, 3)
    assert all(p > 90 for p in action_response(pipe, a, a, 3))
    assert pipe.frame_index == 3  # only the three observed real frames entered the history
    assert all(np.isfinite(p) for p in action_response(pipe, a, b, 3))
    real = [a.future(k)[0] for k in range(3)]
    assert copy_previous(a, 3)[1] == frame_metrics(real[0], real[1])


def test_an_episode_scored_from_a_later_frame_is_the_same_level_further_on():
    """``start``: the same level's frames, scored from a later one, after a longer history of
    which the pipeline loads its window; no earlier than the window."""
    from inference.causvid_pipeline import CausvidPipeline
    from owl_wms.maze.data import HELD_OUT_SEED
    from owl_wms.maze.evaluation import Episode, replay

    pipe = CausvidPipeline.from_checkpoint(clip=None, verbose=False)
    usual, later = Episode(pipe, HELD_OUT_SEED, 8), Episode(pipe, HELD_OUT_SEED, 3, start=pipe.window + 5)
    assert usual.start == pipe.window and later.start == pipe.window + 5 == later.clip.history_frames
    for k in range(3):
        assert np.array_equal(later.future(k)[0], usual.future(k + 5)[0])
        assert torch.equal(later.future(k)[1], usual.future(k + 5)[1])
    assert np.array_equal(replay(later, later.start).render(), later.frames[later.start - 1])
    with pytest.raises(ValueError, match=f"start at frame {pipe.window} or later"):
        Episode(pipe, HELD_OUT_SEED, 3, start=pipe.window - 1)


def test_simulator_responses_branch_from_the_real_states():
    """The replay reaches the episode's real frames; the episode's own actions as the 'foreign'
    ones reproduce every real frame (infinite PSNR), another episode's do not."""
    from inference.causvid_pipeline import CausvidPipeline
    from owl_wms.maze.data import HELD_OUT_SEED
    from owl_wms.maze.evaluation import Episode, replay, simulator_responses

    pipe = CausvidPipeline.from_checkpoint(clip=None, verbose=False)
    a, b = Episode(pipe, HELD_OUT_SEED, 6), Episode(pipe, HELD_OUT_SEED + 1, 6)
    assert np.array_equal(replay(a, a.start + 6).render(), a.frames[a.start + 5])
    own = simulator_responses(a, a, 6, (2, 6))
    assert all(np.isinf(x) for x in own["foreign_action"]) and np.isinf(own["foreign_rollout"])
    other = simulator_responses(a, b, 6, (2, 6))
    values = other["foreign_action"] + other["previous_action"] + [other["foreign_rollout"]]
    assert len(other["previous_action"]) == 6 and all(np.isfinite(x) and x < 60 for x in values)


def test_horizontal_shift_finds_a_known_slide_and_the_simulators_turn_direction():
    from owl_wms.maze.evaluation import horizontal_shift
    from owl_wms.maze.simulator import MazeSim, SimConfig

    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, size=(32, 80, 3), dtype=np.uint8)
    for s in (-5, 0, 3):
        moved = np.roll(a, -s, axis=1)  # content moves left by s
        assert horizontal_shift(a[:, 10:70], moved[:, 10:70]) == s
    forward = [1] + [0] * 10
    for dx, sign in ((8.0, 1), (-8.0, -1)):
        sim = MazeSim(3, SimConfig(width=64, height=64))
        before = sim.render()
        after = sim.step([dx, 0.0], forward)
        assert sign * horizontal_shift(before, after) >= 2  # turning right slides the view left


def test_compare_worlds_sets_each_world_against_the_first(tmp_path, capsys):
    from scripts import compare_worlds

    def report(shift: float) -> dict:
        scripted = {"sharpness_ratio": [0.2 + shift, 0.4 + shift], "sharpness_ratio_min": 0.2 + shift}
        return {"teacher_forced_psnr": 25 + shift, "copy_previous_psnr": 24.5, "ar_psnr_at_16": 18 + shift,
                "layout_psnr_at_64": 16 + shift, "turn_following_teacher_forced": 0.25 + shift,
                "turn_following": 0.6 + shift, "action_gap_db": 1.5 + shift,
                "per_level": {"action_gap_db": [-1 + shift, 3 + shift]},
                "standard_error": {"teacher_forced_psnr": 1.2, "action_gap_db": 0.9},
                "walk_and_turn": scripted, "turn_in_place": scripted}

    old, new, mixed = report(0.0), report(0.1), {**report(0.1), "action_gap_db": 1.0}
    del old["layout_psnr_at_64"]  # an older report: the row says so
    for name, r in (("old", old), ("new", new), ("mixed", mixed)):
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    compare_worlds.main([str(tmp_path / f"{n}.json") for n in ("old", "new", "mixed")] + ["--names", "old", "new", "mixed"])
    out = capsys.readouterr().out
    assert "| teacher-forced PSNR (dB) | 25.00 ± 1.20 | 25.10 ± 1.20 | 25.10 ± 1.20 |  |" in out
    assert "| teacher-forced minus repeating (dB) | 0.50 | 0.60 | 0.60 | >= 2 |" in out
    assert "| layout score at frame 64 (dB) | not measured | 16.10 | 16.10 | >= 20 |" in out
    # a figure the first world lacks can't be beaten; one worse figure is named
    assert "new is not better than old on: layout score at frame 64 (dB)" in out
    assert "mixed is not better than old on: layout score at frame 64 (dB); action gap, frames 5-32 (dB)" in out
    compare_worlds.main([str(tmp_path / "new.json"), str(tmp_path / "new.json")])
    assert "new beats new" not in capsys.readouterr().out  # equal is not better
    # unnamed columns: eval_world's NAME/eval.json gives NAME, a kept NAME_eval.json gives NAME
    (tmp_path / "w64").mkdir()
    (tmp_path / "w64" / "eval.json").write_text(json.dumps(old))
    (tmp_path / "flat_eval.json").write_text(json.dumps(new))
    compare_worlds.main([str(tmp_path / "w64" / "eval.json"), str(tmp_path / "flat_eval.json")])
    out = capsys.readouterr().out
    assert out.startswith("| figure | w64 | flat | target |")
    assert "flat is not better than w64 on: layout score at frame 64 (dB)" in out
    assert "level by level" not in out  # reports without their levels' seeds are not paired
    with pytest.raises(SystemExit):
        compare_worlds.main([str(tmp_path / "missing.json")])
    assert "report" in capsys.readouterr().err


def test_compare_worlds_pairs_reports_level_by_level(tmp_path, capsys):
    from scripts import compare_worlds

    def report(seeds, tf, gap, turn=(0.3, 0.3, 0.3, 0.3), **more) -> dict:
        scripted = {"sharpness_ratio": [0.2], "sharpness_ratio_min": 0.2, "frames": 64,
                    "sharpness_ratio_min_per_level": [0.2] * len(seeds)}
        return {"seeds": seeds, "policy": "explore", "start": 64, "gap_range": [5, 32], "settings": "fp32",
                "teacher_forced_psnr": sum(tf) / len(tf), "copy_previous_psnr": 24.0, "ar_psnr_at_16": 18,
                "turn_following_teacher_forced": 0.3, "turn_following": 0.6, "action_gap_db": sum(gap) / len(gap),
                "per_level": {"teacher_forced_psnr": tf, "action_gap_db": gap},
                "turn_shift_per_level": {"model": [0.5, 0.6, 0.7, None], "teacher_forced": list(turn),
                                         "sim": [1.0] * len(seeds)},
                "walk_and_turn": scripted, "turn_in_place": scripted, **more}

    # levels far apart, the same small lift on each: the standard error over levels hides it, the paired one not
    base = report([1, 2, 3, 4], [20.0, 25.0, 30.0, 22.0], [0.0, 1.0, 2.0, 1.0])
    lifted = report([1, 2, 3, 4], [20.1, 25.1, 30.2, 22.2], [1.0, 0.0, 2.0, 1.0], turn=(0.4, 0.5, 0.6, 0.5),
                    settings="bf16")
    elsewhere = report([5, 6, 7, 8], [30.0] * 4, [5.0] * 4)
    later = {**lifted, "start": 96}  # the same levels scored from another frame
    older = {k: v for k, v in lifted.items() if k != "start"}  # made before reports kept their first frame
    unlisted_levels = {k: v for k, v in lifted.items() if k != "seeds"}  # made before they listed their levels
    # a longer report sharing three of base's levels is paired over those; its gap took other frames
    wider = report([2, 3, 4, 9], [25.5, 30.5, 22.5, 10.0], [1.0, 2.0, 1.0, 9.0], gap_range=[5, 16])
    paths = []
    for name, r in (("base", base), ("lifted", lifted), ("elsewhere", elsewhere), ("later", later),
                    ("older", older), ("wider", wider), ("nolevels", unlisted_levels)):
        (tmp_path / f"{name}_eval.json").write_text(json.dumps(r))
        paths.append(str(tmp_path / f"{name}_eval.json"))
    compare_worlds.main(paths)
    out = capsys.readouterr().out
    assert "level by level (± one standard error of the differences; *: past the two-sided 95% point" in out
    assert "| difference against base | lifted (4 levels) | wider (3 levels) |" in out
    # diffs 0.1, 0.1, 0.2, 0.2: mean 0.15, error 0.029, past 3.18 errors; wider's 0.5 on each of 3
    assert "| teacher-forced PSNR (dB) | +0.15 ± 0.03 * | +0.50 ± 0.00 * |" in out
    # no mark within the t point; wider's gap was scored over other frames, so is not set against base's
    assert "| action gap, frames 5-32 (dB) | +0.00 ± 0.41 | not measured |" in out
    assert "| AR PSNR at frame 16 (dB) | 18.00 |" in out and "| AR PSNR at frame 16 (dB) | not" not in out  # not kept
    assert "| walk and turn: least sharp frame (sharpness ratio) | +0.00 ± 0.00 | +0.00 ± 0.00 |" in out
    assert "| turn following, one step from the simulator's frames | +0.20 ± 0.04 * | +0.00 ± 0.00 |" in out
    # a level without a share is left out: lifted pairs on levels 1-3, wider only on 2 and 3 (too few)
    assert "| turn following, rollout | +0.00 ± 0.00 | not measured |" in out
    assert ("Not set against base level by level: elsewhere (0 shared levels (pairing takes 3)); "
            "later (start 96, not 64); older (no start recorded); nolevels (0 shared levels (pairing takes 3))") in out
    assert "Scored with other settings than base (dtype, threads, kernels: a small difference may be theirs): " \
           "lifted, later, older, nolevels" in out
    # reports that are not eval_world's, or name a level twice, are refused in one line
    for name, bad, words in (("list", [1, 2], "holds a JSON list, not eval_world's report object"),
                             ("seeds", {**base, "seeds": 5}, "'seeds' is 5; expected a list of level seeds"),
                             ("twice", {**base, "seeds": [1, 1, 2, 3]}, "names a level twice")):
        (tmp_path / f"{name}.json").write_text(json.dumps(bad))
        with pytest.raises(SystemExit):
            compare_worlds.main([paths[0], str(tmp_path / f"{name}.json")])
        assert words in capsys.readouterr().err
    # a first report that does not list its levels says why there is no second table
    unlisted = {k: v for k, v in base.items() if k != "seeds"}
    (tmp_path / "unlisted_eval.json").write_text(json.dumps(unlisted))
    compare_worlds.main([str(tmp_path / "unlisted_eval.json"), paths[1]])
    assert "No level-by-level table: unlisted's report does not list its levels" in capsys.readouterr().out


def test_compare_worlds_pairs_turns_over_the_simulators_mean_slide(tmp_path, capsys):
    from scripts import compare_worlds

    def report(model, sim, seeds=(1, 2, 3, 4)) -> dict:
        return {"seeds": list(seeds), "policy": "explore", "start": 64, "turn_dx": 6.0, "turn_frames": 16,
                "turn_following": sum(model) / sum(sim) if sum(sim) else None, "turn_following_teacher_forced": 0.3,
                "turn_shift_per_level": {"model": model, "teacher_forced": [0.3] * 4, "sim": sim}}

    # level 1's view barely slides in the simulator: as shares, its 0.2 more columns a frame would be
    # +2.0 there and swamp the others; over the simulator's mean slide (1.55) each counts 0.2 / 1.55
    sim = [0.1, 2.0, 2.0, 2.1]
    base, lifted = report([0.1, 1.0, 1.0, 1.0], sim), report([0.3, 1.2, 1.1, 1.3], sim)
    still = report([0.0] * 4, [0.0] * 4)  # a world whose simulator never turned: nothing to scale by
    paths = []
    for name, r in (("base", base), ("lifted", lifted), ("still", still)):
        (tmp_path / f"{name}_eval.json").write_text(json.dumps(r))
        paths.append(str(tmp_path / f"{name}_eval.json"))
    compare_worlds.main(paths)
    out = capsys.readouterr().out
    # the mean difference is the difference of the two pooled shares: (3.9 - 3.1) / 6.2 = 0.13
    assert abs(lifted["turn_following"] - base["turn_following"] - 0.8 / 6.2) < 1e-12
    assert "| turn following, rollout | +0.13 ± 0.03 * | not measured |" in out
    assert "| turn following, one step from the simulator's frames | +0.00 ± 0.00 | not measured |" in out
