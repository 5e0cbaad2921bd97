"""What a world needs to learn turning from the mouse: episodes that turn in the open with a short
memory, a smooth mouse conditioning, windows drawn towards such turns, and an evaluation that
reports turns in the open apart from turns at a wall."""
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from owl_wms.config import ConfigError, ModelConfig
from owl_wms.maze.data import OPEN_WALL, ExplorerPolicy, turn_wall_statistics
from owl_wms.model import GameRFT, MouseEmbedding, SmoothMouseEmbedding
from owl_wms.maze.simulator import MazeSim, SimConfig
from owl_wms.maze.training.world import LatentEpisodes


def test_turns_policy_turns_in_the_open_and_forgets_its_last_turn():
    """turns: at least 15% of frames turn hard in the open and the mouse's lag-1 autocorrelation
    is at most 0.8; still (the shipped world's) turns only at walls, with a long memory."""
    turns = turn_wall_statistics("turns", levels=3, frames=256, corridor=2)
    still = turn_wall_statistics("still", levels=3, frames=256, corridor=2)
    assert turns["turning_open_share"] >= 0.15 > 0.01 > still["turning_open_share"]
    assert turns["mouse_x_autocorrelation"] <= 0.8 < 0.9 < still["mouse_x_autocorrelation"]
    assert turns["at_rest_share"] > 0  # the hand still lets go of the mouse at times


def test_turns_policy_draws_rates_of_every_strength_walking_and_standing():
    policy, sim = ExplorerPolicy(4, "turns"), MazeSim(4, SimConfig(corridor=2))
    rates, walking = [], []
    for _ in range(400):
        mouse, buttons = policy.act(sim)
        rates.append(policy.rate)
        walking.append(buttons[0])
        sim.step(mouse, buttons)
    rates, walking = np.abs(rates), np.array(walking)
    turning = rates > 0
    assert 0.3 < turning.mean() < 0.9
    assert rates[turning].min() < 3 and rates[turning].max() > 9 and rates.max() <= 12  # weak to hard
    assert turning[walking == 0].any() and turning[walking == 1].any()  # in place and on the move


def test_smooth_mouse_embedding_is_an_option_for_our_worlds_only():
    base = dict(sample_size=4, channels=8, n_layers=1, n_heads=2, d_model=64, tokens_per_frame=16,
                rope_impl="motion", local_window=4)
    original = GameRFT(ModelConfig(**base).validate())
    smooth = GameRFT(ModelConfig(**base, mouse_embed="smooth").validate())
    assert isinstance(original.core.control_embed.mouse, MouseEmbedding)  # absent key: the original's
    assert isinstance(smooth.core.control_embed.mouse, SmoothMouseEmbedding)
    with pytest.raises(ConfigError, match=r"model.mouse_embed='linear'.*'sincos', 'smooth'"):
        ModelConfig(**base, mouse_embed="linear").validate()


def test_smooth_mouse_embedding_maps_nearby_rates_to_nearby_embeddings():
    """Rates 4.0 and 4.1 are a small step of the smooth embedding and a large one of the
    original's sin/cos features (multiplier 1000), at initialisation, relative to 4 -> 8."""
    torch.manual_seed(0)
    rates = torch.tensor([[4.0, 0.0], [4.1, 0.0], [8.0, 0.0]])

    def relative_step(embed):
        e = embed(rates).detach()
        return float((e[1] - e[0]).norm() / (e[2] - e[0]).norm())

    assert relative_step(SmoothMouseEmbedding(64)) < 0.1 < 0.5 < relative_step(MouseEmbedding(64))


def write_latent_episode(path, mouse_x, wall, frames=None):
    n = len(mouse_x)
    mouse = torch.zeros(n, 2)
    mouse[:, 0] = torch.tensor(mouse_x, dtype=torch.float32)
    tensors = {"latents": torch.randn(n, 4, 2, 2) if frames is None else frames, "mouse": mouse,
               "buttons": torch.zeros(n, 11)}
    if wall is not None:
        tensors["wall_ahead"] = torch.tensor(wall, dtype=torch.float32)
    save_file(tensors, str(path))


def test_windows_are_drawn_towards_turns_in_the_open(tmp_path):
    """Episode 0 turns hard in the open in its second half only; episode 1 turns hard facing a
    wall. With a weight, windows over the open turns come up far more often; weight 0 draws
    uniformly, as before the option existed."""
    n, w = 40, 8
    write_latent_episode(tmp_path / "ep_000000.safetensors", [0.0] * 20 + [8.0] * 20, [5.0] * n)
    write_latent_episode(tmp_path / "ep_000001.safetensors", [8.0] * n, [0.5] * n)
    uniform = LatentEpisodes(tmp_path, 1.0, w)
    weighted = LatentEpisodes(tmp_path, 1.0, w, open_turn_weight=20.0)
    assert weighted.window_weights.shape == (2 * (n - w + 1),)
    gen = torch.Generator().manual_seed(1)
    starts = [weighted.starts[i] for i in torch.multinomial(weighted.window_weights, 400, True, generator=gen).tolist()]
    assert sum(1 for e, s in starts if e == 0 and s + w > 20) / len(starts) > 0.7  # uniform: 0.30
    # batch() draws exactly those windows
    x, _, _ = weighted.batch(400, torch.Generator().manual_seed(1))
    assert torch.equal(x, torch.stack([weighted.latents[e][s:s + w] for e, s in starts]))
    # weight 0: the draws of the sampler before weights existed (episode, then start, one generator)
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x, _, _ = uniform.batch(5, gen_a)
    expected = []
    for e in torch.randint(0, 2, (5,), generator=gen_b).tolist():
        s = int(torch.randint(0, n - w + 1, (1,), generator=gen_b))
        expected.append(uniform.latents[e][s:s + w])
    assert torch.equal(x, torch.stack(expected))


def test_weighted_windows_need_the_wall_record_and_say_so(tmp_path):
    write_latent_episode(tmp_path / "ep_000000.safetensors", [0.0] * 12, None)
    LatentEpisodes(tmp_path, 1.0, 8)  # uniform windows need no wall record
    with pytest.raises(ValueError, match="wall_ahead.*ep_000000.safetensors.*scripts.generate_data"):
        LatentEpisodes(tmp_path, 1.0, 8, open_turn_weight=2.0)
    with pytest.raises(ValueError, match="open_turn_weight -1"):
        LatentEpisodes(tmp_path, 1.0, 8, open_turn_weight=-1.0)


def test_turn_following_is_reported_in_the_open_and_at_a_near_wall():
    from owl_wms.maze.evaluation import turn_following_summary

    runs = [{"model": [1.0, 2.0, 0.0], "sim": [2.0, 2.0, 4.0], "forced": [2.0, 1.0, 2.0], "open": [True, True, False]},
            {"model": [3.0], "sim": [2.0], "forced": [2.0], "open": [True]}]
    s = turn_following_summary(runs)
    assert s["turn_frames_counted"] == 4 and s["turn_frames_counted_open"] == 3 and s["turn_frames_counted_near_wall"] == 1
    assert s["turn_following_open"] == pytest.approx(2.0 / 2.0)  # model (1+2+3)/3 over sim 2
    assert s["turn_following_teacher_forced_open"] == pytest.approx((5 / 3) / 2.0)
    assert s["turn_following_near_wall"] == pytest.approx(0.0) and s["turn_shift_sim_near_wall"] == 4.0
    assert s["turn_following"] == pytest.approx((6 / 4) / (10 / 4))
    none_near = turn_following_summary(runs[1:])
    assert none_near["turn_following_near_wall"] is None and none_near["turn_frames_counted_near_wall"] == 0


def test_the_open_and_hard_turn_thresholds_are_the_statistics_ones():
    """Training's window weights, the evaluation's split and policy_stats call the same frames open
    and the same turns hard."""
    import inspect

    from owl_wms.maze.data import HARD_TURN

    params = inspect.signature(turn_wall_statistics).parameters
    assert params["near"].default == OPEN_WALL and params["big"].default == HARD_TURN
