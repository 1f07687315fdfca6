"""Selective rollout (GRESO) in grpo_plus.GRPOTrainer: dead prompts skipped with full batches, composition with
dynamic sampling, TRL's sampler when off, map-style datasets only."""

import pytest
from datasets import IterableDataset
from helpers.models import prompt_dataset, tiny_trainer
from helpers.probes import logged, record_draws, record_score_rounds
from helpers.rewards import dead_rows, odd_prompts_dead_reward

G = 4


def make_trainer(tmp_path, dataset, **overrides):
    settings = dict(per_device_train_batch_size=8, max_steps=16, selective_rollout=True)
    return tiny_trainer(tmp_path, odd_prompts_dead_reward, dataset=dataset, **{**settings, **overrides})


def test_selective_rollout_needs_a_map_style_dataset(tmp_path):
    stream = IterableDataset.from_generator(lambda: iter(prompt_dataset(8)))
    with pytest.raises(ValueError, match="selective_rollout=True needs a map-style train_dataset"):
        make_trainer(tmp_path, stream)


@pytest.mark.slow
def test_trainer_skips_dead_prompts_and_keeps_every_batch_full(tmp_path):
    dataset = prompt_dataset(8)
    dead = dead_rows(dataset)
    trainer = make_trainer(tmp_path, dataset, selective_rollout_explore_step=0.0)
    draws, rounds = record_draws(trainer), record_score_rounds(trainer)
    trainer.train()

    assert len(draws) == 16
    seen_dead: set[int] = set()
    for draw, inputs in zip(draws, rounds, strict=True):
        prompts = [row["prompt"] for row in inputs]
        assert len(draw.indices) == 2 and len(prompts) == 8, "a generation batch was not full"
        assert prompts == [dataset[i]["prompt"] for i in draw.rows(G)], "generated rows are not the drawn ones"
        assert set(draw.skipped) <= seen_dead, "skipped a row that was live or never seen"
        seen_dead |= set(draw.indices) & dead
    skipped = sum(len(d.skipped) for d in draws)
    assert skipped >= 5, "dead rows came up again and again but were hardly skipped"
    assert logged(trainer, "selective_rollout/skipped") == [float(len(d.skipped)) for d in draws]
    assert logged(trainer, "selective_rollout/generation_calls") == [1.0] * 16
    assert set(logged(trainer, "selective_rollout/precision")) == {1.0}  # dead rows here are dead forever
    informative = logged(trainer, "selective_rollout/informative_frac")
    assert sum(informative[8:]) > sum(informative[:8]), "skipping did not raise the share of informative groups"


@pytest.mark.slow
def test_composes_with_dynamic_sampling_and_saves_refill_rounds(tmp_path):
    dataset = prompt_dataset(8)
    common = dict(dynamic_sampling=True, max_sampling_rounds=4, max_steps=12, selective_rollout_explore_step=0.0)
    plain = make_trainer(tmp_path / "plain", dataset, **{**common, "selective_rollout": False})
    selective = make_trainer(tmp_path / "selective", dataset, **common)
    draws = record_draws(selective)
    plain.train()
    selective.train()
    rounds = {name: sum(logged(t, "dynamic_sampling/rounds")) for name, t in (("plain", plain), ("sel", selective))}
    assert len(draws) == rounds["sel"], "refill rounds did not draw through the selector"
    assert logged(selective, "selective_rollout/generation_calls") == logged(selective, "dynamic_sampling/rounds")
    assert sum(len(d.skipped) for d in draws) > 0
    assert rounds["sel"] < rounds["plain"], rounds
    assert logged(selective, "dynamic_sampling/trained_informative_frac") == [1.0] * 12


@pytest.mark.slow
def test_off_by_default_and_then_prompts_come_from_trls_sampler(tmp_path):
    dataset = prompt_dataset(8)
    trainer = make_trainer(tmp_path, dataset, selective_rollout=False, max_steps=4)
    assert trainer._selective_rollout is None
    batches = record_score_rounds(trainer)
    trainer.train()
    order = iter(trainer._get_train_sampler())  # TRL's RepeatSampler, same seed
    expected = [[dataset[next(order)] for _ in range(8)] for _ in range(4)]
    assert batches == expected
    assert not any(key.startswith("selective_rollout/") for entry in trainer.state.log_history for key in entry)
