"""Partial rollouts for the long tail (grpo_plus.partial_rollouts, issue 51 part 3), on one device with grpo_plus's own
generator: each kept token's sampler log-prob is its log-prob under the weights of its recorded version (an oracle
that replays every token on a snapshot of those weights); a chunk of at least max_completion_length tokens trains as
the run without the setting, bit for bit (and a chunk that bites does not); the groups handed to TRL are complete and
TRL's batch; a run resumed from a checkpoint with rows in flight ends at the uninterrupted run's weights (and one whose
pool is not restored does not); what cannot work is refused at construction."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from helpers.models import saved_model_trainer, tiny_run_kwargs
from helpers.probes import PoolRecorder, max_weight_diff, restore_rows_without_tokens
from helpers.rewards import digit_reward
from transformers import AutoModelForCausalLM

import grpo_plus
from grpo_plus import GRPOConfig
from grpo_plus.compat.model import completion_eos_token_ids
from grpo_plus.config import ConfigError
from grpo_plus.partial_rollouts import pool
from grpo_plus.partial_rollouts.pool import PartialRollouts, trainer_blocker
from grpo_plus.run.state import SHARED_FILE

needs_loop = pytest.mark.floor("zero_waste_generation")
TEMPERATURE = 0.7  # the sampler's processed distribution is not the model's raw one: the oracle must apply it
# 2 groups of 4 per step, completions of at most 12 tokens, SGD: every step's weights differ (digit_reward varies)
RUN = dict(
    per_device_train_batch_size=8, num_generations=4, max_completion_length=12, temperature=TEMPERATURE,
    optim="sgd", learning_rate=0.5, max_steps=4, seed=3,
)  # fmt: skip


def train(model_dir, output_dir, recorded=None, resume=None, **settings):
    trainer = saved_model_trainer(model_dir, output_dir, [digit_reward], **{**RUN, **settings})
    completions = []
    original = trainer._generate_and_score_completions

    def recording(inputs):
        output = original(inputs)
        completions.append(output["completion_ids"].clone())
        return output

    trainer._generate_and_score_completions = recording
    if recorded is not None:
        recorded.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return weights, losses, completions, trainer


def sampler_logps_of(model, row, temperature: float) -> torch.Tensor:
    """The definition: each completion token's log-prob under `model`, given its prompt and the tokens before it, in
    the distribution the sampler drew from (the logits at temperature `temperature`; TRL's top_p=1, top_k=0)."""
    ids = torch.tensor([row.prompt_ids + row.tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(row.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(row.tokens)[:, None]).squeeze(1)


def peaked_copy(model_dir, folder, scale: float = 8.0):
    """`model_dir`'s model with its LM head scaled by `scale` (untied): next-token distributions peaked enough at
    TEMPERATURE that the siblings' n-gram drafts are often kept, and often refused."""
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    return folder


@needs_loop
# float32: an incremental, batched, left-padded decode against one unpadded forward: worst 4.8e-7 (1 ulp at 4); the
# peaked model's log-probs reach 8-16, where the worst over six seeds and threads 1-2 is 9.5e-7 (1 ulp there)
@pytest.mark.parametrize(("speculative", "chunk", "bound"), [(False, 3, 1e-6), (True, 6, 3e-6)])
def test_each_token_keeps_its_log_prob_under_the_weights_that_sampled_it(
    tiny_model_dir, tmp_path, monkeypatch, speculative, chunk, bound
):
    """With speculative rollouts too (a peaked model, whose drafts are kept; chunks of 6 tokens leave room to draft): a
    kept draft and the token drawn after it are each distributed as the sampler's processed distribution, and the
    speculative loop records their log-probs under it."""
    model_dir = peaked_copy(tiny_model_dir, tmp_path / "peaked") if speculative else tiny_model_dir
    recorded = PoolRecorder(monkeypatch)
    _, _, _, trainer = train(
        model_dir, tmp_path / "run", recorded, partial_rollout_tokens=chunk, speculative_rollouts=speculative
    )
    accepted = sum(entry.get("speculative/accepted", 0.0) for entry in trainer.state.log_history)
    assert (accepted > 0) == speculative, accepted  # kept drafts among the recorded tokens
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gap, wrong_gap, mixed_rows = 0.0, 0.0, 0
    for handoff in recorded.handoffs:
        for row in handoff.rows:
            versions = torch.tensor(row.versions)
            mixed_rows += len(set(row.versions)) > 1
            expected = torch.empty(len(row.tokens))
            for version in set(row.versions):
                model.load_state_dict(recorded.weights[version])
                expected[versions == version] = sampler_logps_of(model, row, TEMPERATURE)[versions == version]
            gap = max(gap, (expected - torch.tensor(row.logps)).abs().max().item())
            # the negative control: every token scored with the weights of the step that trains it
            model.load_state_dict(recorded.weights[handoff.step])
            wrong = sampler_logps_of(model, row, TEMPERATURE)
            wrong_gap = max(wrong_gap, (wrong - torch.tensor(row.logps)).abs().max().item())
    assert mixed_rows > 0, "no handed row was sampled by two versions of the weights: the test shows nothing"
    print(f"largest gap {gap:.3g}, negative control {wrong_gap:.3g}")
    assert gap < bound, gap
    assert wrong_gap > 1e-3, wrong_gap
    ages = [age for handoff in recorded.handoffs for age in handoff.token_ages()]
    assert max(ages) == 1 and min(ages) == 0  # max_staleness=1: no token trained more than one step late


@needs_loop
def test_a_chunk_as_long_as_the_completions_trains_as_without_the_setting(tiny_model_dir, tmp_path, monkeypatch):
    plain = train(tiny_model_dir, tmp_path / "plain")
    recorded = PoolRecorder(monkeypatch)
    whole = train(
        tiny_model_dir, tmp_path / "whole", recorded, partial_rollout_tokens=RUN["max_completion_length"] + 1
    )
    assert len(plain[2]) == len(whole[2]) == RUN["max_steps"]
    for ours, theirs in zip(whole[2], plain[2], strict=True):
        assert torch.equal(ours, theirs)
    assert whole[1] == plain[1]
    assert max_weight_diff(whole[0], plain[0]) == 0.0
    assert all(age == 0 for handoff in recorded.handoffs for age in handoff.token_ages())
    # the negative control: a chunk that bites hands other completions and ends elsewhere
    bitten = train(tiny_model_dir, tmp_path / "bitten", partial_rollout_tokens=3)
    assert any(not torch.equal(a, b) for a, b in zip(bitten[2], plain[2], strict=True))
    assert max_weight_diff(bitten[0], plain[0]) > 1e-3


@needs_loop
def test_the_groups_handed_to_trl_are_complete_and_trls_batch(tiny_model_dir, tmp_path, monkeypatch):
    recorded = PoolRecorder(monkeypatch)
    _, _, completions, trainer = train(tiny_model_dir, tmp_path / "run", recorded, partial_rollout_tokens=3)
    size, group, limit = RUN["per_device_train_batch_size"], RUN["num_generations"], RUN["max_completion_length"]
    eos = set(completion_eos_token_ids(trainer))
    carried = 0
    for handoff, batch in zip(recorded.handoffs, completions, strict=True):
        assert len(handoff.inputs) == len(handoff.rows) == batch.shape[0] == size
        for start in range(0, size, group):
            prompts = {str(row["prompt"]) for row in handoff.inputs[start : start + group]}
            assert len(prompts) == 1  # a group is G completions of one prompt
        for row, ids in zip(handoff.rows, batch, strict=True):
            assert row.finished and (row.tokens[-1] in eos or len(row.tokens) == limit)
            assert ids[: len(row.tokens)].tolist() == row.tokens  # TRL scored the pool's completions
        carried += any(age > 0 for age in handoff.token_ages())
    assert carried > 0, "no step trained a carried row: the chunk did not bite"
    # the logged staleness of each step: the share of its tokens sampled by older weights, their mean and largest age
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    for handoff, entry in zip(recorded.handoffs, logs, strict=True):
        ages = handoff.token_ages()
        old = [age for age in ages if age > 0]
        assert entry["partial_rollouts/stale_token_frac"] == pytest.approx(len(old) / len(ages), abs=1e-7)
        assert entry["partial_rollouts/stale_token_age_mean"] == pytest.approx(sum(old) / len(old) if old else 0.0)
        assert entry["partial_rollouts/stale_token_age_max"] == max(old, default=0)


@needs_loop
@pytest.mark.engine
def test_a_run_resumed_with_rows_in_flight_ends_at_the_uninterrupted_weights(tiny_model_dir, tmp_path, monkeypatch):
    settings = dict(partial_rollout_tokens=3, save_strategy="steps", save_steps=1)
    whole, _, whole_completions, _ = train(tiny_model_dir, tmp_path / "whole", **settings)
    checkpoint = tmp_path / "whole" / "checkpoint-1"
    saved = torch.load(checkpoint / SHARED_FILE, weights_only=True)
    in_flight = [row for g in saved["parts"]["partial_rollouts"]["groups"] for row in g["rows"]]
    assert any(not row["finished"] for row in in_flight), "the checkpoint holds no row in flight: nothing is tested"
    resumed, _, resumed_completions, _ = train(tiny_model_dir, tmp_path / "whole", resume=str(checkpoint), **settings)
    assert max_weight_diff(resumed, whole) == 0.0
    for ours, theirs in zip(resumed_completions, whole_completions[1:], strict=True):
        assert torch.equal(ours, theirs)
    # the negative control: the rows in flight restored without their tokens (each restarts from its prompt)
    restore_rows_without_tokens(monkeypatch)
    forgotten, _, _, _ = train(tiny_model_dir, tmp_path / "whole", resume=str(checkpoint), **settings)
    assert max_weight_diff(forgotten, whole) > 1e-3


class ScriptedPrompts:
    """A pool's collaborators with scripted completions: prompt "p<i>" is token 100 + i, and each of its rows emits
    token 7 until it holds `lengths[i]` tokens, the last one EOS (1); each token's "log-prob" is -(its position)."""

    EOS = 1

    def __init__(self, lengths: list[int], group: int = 2):
        self.lengths, self.group, self.read = lengths, group, 0
        self.seeds: list[list[int] | None] = []  # each chunk's request seeds

    def batch(self, index: int) -> list[dict]:
        return [{"prompt": f"p{index}"}] * self.group

    def next_batch(self) -> list[dict]:  # the PromptLookahead protocol
        self.read += 1
        return self.batch(self.read - 1)

    def resume_at(self, index: int, skip_data: bool) -> None:  # the PromptLookahead protocol: a resumed reader
        self.read = index

    def tokenize(self, prompts: list[str]) -> list[list[int]]:
        return [[100 + int(prompt[1:])] for prompt in prompts]

    def decode(self, prompt_ids: list[list[int]], max_new_tokens: int, turns=None, seeds=None):
        self.seeds.append(seeds)
        tokens, logps = [], []
        for ids in prompt_ids:
            have, target = len(ids) - 1, self.lengths[ids[0] - 100]
            new = [7] * min(max_new_tokens, target - have)
            if have + len(new) == target:
                new[-1] = self.EOS
            tokens.append(new)
            logps.append([-float(have + i) for i in range(len(new))])
        return tokens, logps


def test_the_pool_hands_the_oldest_complete_groups_and_bounds_their_age():
    """One group per step, chunks of 2 tokens, completions of at most 12: prompt 0 needs all 12, the others end after
    2. With max_staleness=2, p0 waits while the batches read ahead (p1, p2) complete and are handed first; at step 2 it
    has waited 2 steps and is decoded to the end before anything else: its tokens carry versions 0, 1 and 2. With
    max_staleness=1 it is finished at step 1 instead."""
    for max_staleness, handed_order, versions in (
        (2, ["p1", "p2", "p0"], [0] * 4 + [1] * 4 + [2] * 4),
        (1, ["p1", "p0", "p2"], [0] * 4 + [1] * 8),
    ):
        script = ScriptedPrompts([12, 2, 2, 2, 2])
        settings = pool.PartialRolloutSettings(tokens=2, max_staleness=max_staleness)
        rollouts = PartialRollouts(settings, 2, 12, [ScriptedPrompts.EOS], script, script.tokenize, script.decode)
        handoffs = [rollouts.generation_batch(script.batch(step), step, defaultdict(list)) for step in range(3)]
        assert [handoff.inputs[0]["prompt"] for handoff in handoffs] == handed_order
        long = next(h for h in handoffs if h.inputs[0]["prompt"] == "p0")
        assert all(row.versions == versions and len(row.tokens) == 12 for row in long.rows)
        assert all(row.logps == [-float(i) for i in range(12)] and row.tokens[-1] == 1 for row in long.rows)
        assert max(age for h in handoffs for age in h.token_ages()) == max_staleness
        assert all(len(h.rows) == 2 and all(row.finished for row in h.rows) for h in handoffs)
    # TRL's loop handing over another batch than the one read ahead of it
    script = ScriptedPrompts([12, 2, 2, 2])
    rollouts = PartialRollouts(pool.PartialRolloutSettings(tokens=2, max_staleness=2), 2, 12, [1], script,
                               script.tokenize, script.decode)  # fmt: skip
    rollouts.generation_batch(script.batch(0), 0, defaultdict(list))
    with pytest.raises(pool.PartialRolloutError, match="not the one read ahead"):
        rollouts.generation_batch(script.batch(3), 1, defaultdict(list))


def test_a_seeded_pool_gives_each_row_and_chunk_its_own_request_seed():
    """With a server's request seed, each chunk's request of each row is seeded `row_seed(seed, serial, tokens held)`:
    the rows of one group (one prompt, no tokens yet) get different seeds, a row's next chunk another, and a pool
    restored from a checkpoint asks for its rows' next chunks with the seeds the uninterrupted pool asks for. Without
    the seed (the negative control for what a server would draw) no seeds are sent."""
    settings = pool.PartialRolloutSettings(tokens=2, max_staleness=2, request_seed=11)
    script = ScriptedPrompts([6, 2, 2, 2], group=3)
    rollouts = PartialRollouts(settings, 3, 12, [ScriptedPrompts.EOS], script, script.tokenize, script.decode)
    rollouts.generation_batch(script.batch(0), 0, defaultdict(list))  # p0 (6 tokens) carried, p1 read ahead, handed
    first, second = script.seeds[:2]
    assert len(set(first)) == 3, "the rows of one prompt asked with one seed"
    assert first == [pool.row_seed(11, serial, 0) for serial in range(3)]
    assert second == [pool.row_seed(11, serial, 2) for serial in range(3)] + [
        pool.row_seed(11, serial, 0) for serial in range(3, 6)
    ]
    assert not set(first) & set(second) and all(0 <= seed < 2**63 for seed in first + second)
    state = rollouts.state_dict()
    assert [row["serial"] for g in state["groups"] for row in g["rows"]] == [0, 1, 2]
    script.seeds.clear()
    rollouts.generation_batch(script.batch(1), 1, defaultdict(list))
    uninterrupted = list(script.seeds)
    resumed_script = ScriptedPrompts([6, 2, 2, 2], group=3)
    resumed = PartialRollouts(settings, 3, 12, [1], resumed_script, resumed_script.tokenize, resumed_script.decode)
    resumed.load_state_dict(state)
    resumed.generation_batch(resumed_script.batch(1), 1, defaultdict(list))
    assert resumed_script.seeds == uninterrupted and uninterrupted
    unseeded = ScriptedPrompts([6, 2, 2, 2], group=3)
    PartialRollouts(pool.PartialRolloutSettings(tokens=2, max_staleness=2), 3, 12, [1], unseeded, unseeded.tokenize,
                    unseeded.decode).generation_batch(unseeded.batch(0), 0, defaultdict(list))  # fmt: skip
    assert unseeded.seeds and all(seeds is None for seeds in unseeded.seeds)


def test_the_pool_state_is_versioned_and_checked():
    settings = pool.PartialRolloutSettings(tokens=3)
    fresh = PartialRollouts(settings, 4, 8, [1], None, lambda prompts: [[5]] * len(prompts), None)
    fresh._enter([{"prompt": "a"}] * 4, step=0)
    fresh.groups[0].rows[0].tokens, fresh.groups[0].rows[0].logps, fresh.groups[0].rows[0].versions = [7], [-0.5], [0]
    state = fresh.state_dict()
    restored = PartialRollouts(settings, 4, 8, [1], None, lambda prompts: [], None)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    with pytest.raises(pool.PartialRolloutError, match="has images"):
        fresh._enter([{"prompt": "a", "image": object()}] * 4, step=0)
    with pytest.raises(pool.PartialRolloutError, match="need a 'prompt' in every row"):
        fresh._enter([{"environment": "e"}] * 4, step=0)
    with pytest.raises(ValueError, match="unknown partial-rollouts state version"):
        restored.load_state_dict({**state, "version": 99})
    # a pool saved before rows had serials (version 1) loads; its rows get serials apart from the new rows'
    version_1 = {**state, "version": 1, "groups": [
        {**g, "rows": [{k: v for k, v in r.items() if k != "serial"} for r in g["rows"]]} for g in state["groups"]
    ]}  # fmt: skip
    del version_1["entered_rows"]
    old = PartialRollouts(settings, 4, 8, [1], None, lambda prompts: [[5]] * len(prompts), None)
    old.load_state_dict(version_1)
    assert [row.serial for row in old.groups[0].rows] == [-1, -2, -3, -4] and old.entered_rows == 0
    other = PartialRollouts(settings, 2, 8, [1], None, lambda prompts: [], None)
    with pytest.raises(ValueError, match="num_generations is 2"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(partial_rollout_tokens=0), "partial_rollout_tokens must be None or an integer >= 1"),
        (dict(partial_rollout_tokens=2.5), "partial_rollout_tokens must be an integer or null/None"),
        (
            dict(partial_rollout_tokens=4, use_vllm=True, generation_kwargs={"seed": 3}),
            "with generation_kwargs seed in vLLM's colocate mode: TRL gives every row's request the same seed",
        ),
        (
            dict(partial_rollout_tokens=4, use_vllm=True, vllm_mode="server", generation_kwargs={"seed": "0"}),
            "generation_kwargs seed must be an integer",
        ),
        (dict(partial_rollout_tokens=4, zero_waste_generation=False), "set zero_waste_generation=True"),
        (
            dict(partial_rollout_tokens=4, use_vllm=True, vllm_mode="server", async_generation=True),
            "with async_generation=True",
        ),
        (dict(partial_rollout_tokens=4, dynamic_sampling=True), "with dynamic sampling"),
        (dict(partial_rollout_tokens=4, advantage_estimator="remax"), "generates a greedy baseline"),
        (
            dict(
                partial_rollout_tokens=4, use_vllm=True, generation_kwargs={"presence_penalty": 0.5, "min_tokens": 2}
            ),
            "generation_kwargs presence_penalty, min_tokens: each chunk",
        ),
        (dict(partial_rollout_tokens=4, generation_kwargs={"min_new_tokens": 2}), "generation_kwargs min_new_tokens"),
        (
            dict(partial_rollout_tokens=4, use_vllm=True, vllm_structured_outputs_regex="[0-9]+"),
            "with vllm_structured_outputs_regex",
        ),
        (
            dict(partial_rollout_tokens=4, use_vllm=True, vllm_tensor_parallel_size=2),
            "with vllm_tensor_parallel_size=2: TRL gathers a tensor-parallel group's rows",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_by_the_config(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **settings)


def test_a_seed_given_on_the_command_line_is_read_as_trl_parses_it(tmp_path, monkeypatch):
    """From a command line `generation_kwargs` arrives as a JSON string, which TRL's `__post_init__` parses after
    grpo_plus's checks: they read it parsed (a server's request seed; the colocate refusal), not as a string. (A TRL
    that takes the group size per call stood in for, as below: server mode needs it.)"""
    import grpo_plus.config
    from grpo_plus.config import PlusSettings

    monkeypatch.setattr(grpo_plus.config, "single_turn_arguments", lambda num_generations: (num_generations,))

    server = dict(use_vllm=True, vllm_mode="server", partial_rollout_tokens=4)
    config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, generation_kwargs='{"seed": 7}', **server)
    assert (
        config.generation_kwargs == {"seed": 7} and PlusSettings.from_config(config).partial_rollouts.request_seed == 7
    )
    with pytest.raises(ConfigError, match="generation_kwargs seed in vLLM's colocate mode"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, partial_rollout_tokens=4,
                   generation_kwargs='{"seed": 7}')  # fmt: skip
    # a key that only appears inside a value is no setting (read as a string, "seed" would be found in it)
    config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, partial_rollout_tokens=4,
                        generation_kwargs='{"stop": ["seed"]}')  # fmt: skip
    assert config.generation_kwargs == {"stop": ["seed"]}


def test_a_vllm_server_is_accepted_where_trl_takes_the_group_size_per_call(tmp_path, monkeypatch):
    """Server mode: each row its own request needs TRL's `num_generations` argument (1.14.2 on); without it (1.14.0,
    the oldest TRL the matrix runs) TRL would send one prompt per group and the carried rows would be lost, so the
    config refuses. Both TRLs stood in for by the argument list the config reads."""
    import grpo_plus.config

    monkeypatch.setattr(grpo_plus.config, "single_turn_arguments", lambda num_generations: (num_generations,))
    config = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, partial_rollout_tokens=4, use_vllm=True, vllm_mode="server"
    )
    assert (config.partial_rollout_tokens, config.vllm_mode) == (4, "server")
    monkeypatch.setattr(grpo_plus.config, "single_turn_arguments", lambda num_generations: ())
    with pytest.raises(ConfigError, match="TRL 1.14.2 or later takes the group size per call"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, partial_rollout_tokens=4, use_vllm=True, vllm_mode="server")


def test_colocated_vllm_is_accepted_without_grpo_plus_generator(tmp_path):
    """vLLM colocated generates the chunks itself: grpo_plus's generator (zero_waste_generation) is not needed there;
    the refusal above of zero_waste_generation=False holds without vLLM (the negative control)."""
    config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, partial_rollout_tokens=4, use_vllm=True,
                        vllm_mode="colocate", zero_waste_generation=False)  # fmt: skip
    assert config.partial_rollout_tokens == 4


def launched(num_processes: int = 1, distributed_type: str = "NO", zero_stage: int | None = None):
    """A trainer's accelerator as the partial-rollouts blocker reads it."""
    plugin = None if zero_stage is None else SimpleNamespace(zero_stage=zero_stage)
    return SimpleNamespace(num_processes=num_processes, distributed_type=SimpleNamespace(name=distributed_type),
                           state=SimpleNamespace(deepspeed_plugin=plugin))  # fmt: skip


def config_of(processes: int = 1, per_device_train_batch_size: int = 8, **fields):
    """A GRPOConfig as the partial-rollouts blocker reads it (TRL's generation batch: per device x processes)."""
    fields = {"use_vllm": False, "vllm_mode": "colocate", "num_generations": 4, **fields}
    return SimpleNamespace(generation_batch_size=per_device_train_batch_size * processes, **fields)


def test_trainers_that_cannot_run_it_are_refused():
    one = (launched(), config_of())
    assert trainer_blocker(*one, False, False, None) is None
    assert "no tools" in trainer_blocker(*one, True, False, None)
    assert "no rollout_func" in trainer_blocker(*one, False, True, None)
    assert "cannot run here: transformers 4" in trainer_blocker(*one, False, False, "transformers 4.56 is too old")
    # with vLLM generating the chunks, grpo_plus's generator is not needed
    assert trainer_blocker(launched(), config_of(use_vllm=True), False, False, "transformers 4.56 is too old") is None
    # several processes: DDP, each process's generation batch whole groups, no server
    ddp = launched(2, "MULTI_CPU")
    assert trainer_blocker(ddp, config_of(2), False, False, None) is None
    assert trainer_blocker(ddp, config_of(2, use_vllm=True), False, False, None) is None  # colocated engines
    assert trainer_blocker(launched(2, "DEEPSPEED", zero_stage=2), config_of(2), False, False, None) is None
    assert "DDP or DeepSpeed ZeRO-1/2 when it runs on several processes (this run: DEEPSPEED (ZeRO-3) on 2)" in (
        trainer_blocker(launched(2, "DEEPSPEED", zero_stage=3), config_of(2), False, False, None)
    )
    assert "(this run: FSDP on 4)" in trainer_blocker(launched(4, "FSDP"), config_of(4), False, False, None)
    assert "= 6 rows, groups of num_generations=4" in trainer_blocker(ddp, config_of(2, 6), False, False, None)
    assert trainer_blocker(launched(), config_of(1, 6), False, False, None) is None  # one process: TRL's own check
    server = config_of(2, use_vllm=True, vllm_mode="server")
    assert "one trainer process against a vLLM server (this run has 2)" in trainer_blocker(
        ddp, server, False, False, None
    )
    assert trainer_blocker(launched(), config_of(use_vllm=True, vllm_mode="server"), False, False, None) is None


@needs_loop
def test_a_tool_trainer_is_refused_at_construction(tmp_path):
    from datasets import Dataset

    from grpo_plus.app.tool_model import increment, make_tool_tokenizer, number_prompts, tool_model_config

    tokenizer = make_tool_tokenizer()
    model = AutoModelForCausalLM.from_config(tool_model_config(tokenizer), dtype=torch.float32)
    args = GRPOConfig(**tiny_run_kwargs(tmp_path, partial_rollout_tokens=3))
    with pytest.raises(ValueError, match="partial_rollout_tokens needs no tools"):
        grpo_plus.GRPOTrainer(model, [digit_reward], args, train_dataset=Dataset.from_list(number_prompts(8)),
                              processing_class=tokenizer, tools=[increment])  # fmt: skip


@needs_loop
@pytest.mark.engine
def test_verls_rollout_correction_weighs_each_carried_token_by_its_own_sampler(tiny_model_dir, tmp_path):
    """With a correction preset, each token's IS weight is exp(trainer log-prob - its sampler's): 1 to rounding on the
    steps that trained no carried token, away from 1 on those that did (their tokens came from older weights)."""
    *_, trainer = train(
        tiny_model_dir, tmp_path / "run", partial_rollout_tokens=3, rollout_correction="decoupled_token_is"
    )
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    fresh = [entry for entry in logs if entry["partial_rollouts/stale_token_frac"] == 0]
    stale = [entry for entry in logs if entry["partial_rollouts/stale_token_frac"] > 0]
    assert fresh and stale
    spread = "rollout_corr/trained_rows/rollout_is_{}"
    for entry in fresh:  # float32 log-probs of ~4 differ by an ulp or two (4.8e-7 each)
        assert abs(entry[spread.format("max")] - 1) < 2e-6 and abs(entry[spread.format("min")] - 1) < 2e-6, entry
    for entry in stale:
        assert max(entry[spread.format("max")] - 1, 1 - entry[spread.format("min")]) > 1e-2, entry


@needs_loop
@pytest.mark.engine  # a benchmark's smoke run
def test_the_benchmark_smoke_runs_every_side(tmp_path, benchmark_in_this_process):
    """benchmarks/partial_rollouts.py cannot rot: its --smoke run trains the three sides and reports the generation
    seconds of each step (the partial side's chunks timed: its generation is not zero) and the staleness metrics."""
    import json

    import partial_rollouts

    output = tmp_path / "partial.json"
    partial_rollouts.main(["--smoke", "--json", str(output)])
    report = json.loads(output.read_text())
    (run,) = report["runs"]
    for side in partial_rollouts.SIDES:
        assert len(run[side]["generation_seconds"]) == len(run[side]["step_seconds"]) == 3
        assert all(seconds > 0 for seconds in run[side]["generation_seconds"]), side
    assert run["partial"]["staleness"]["partial_rollouts/stale_token_frac"][0] == 0  # step 0 carries nothing
    assert set(report["summary"]["0"]) >= {"generation_ratio_vs_trl", "generation_ratio_vs_ours"}
    learning = report["learning"]  # each step's reward over the seeds, per side, and the partial side against each
    assert learning["sides"]["ours"]["reward_mean"] == run["ours"]["rewards"]  # one seed: the mean is the run
    assert set(learning["partial_against"]) == {"trl", "ours"}
    with pytest.raises(SystemExit):  # the partial side is the benchmark's subject: it cannot be left out
        partial_rollouts.main(["--smoke", "--sides", "trl,ours"])


@needs_loop
@pytest.mark.engine
def test_a_steps_later_chunks_continue_from_the_caches_its_earlier_chunks_kept(tiny_model_dir, tmp_path, monkeypatch):
    """Within a step the weights are the same: a row's next chunk starts from the keys/values its last chunk kept
    (grpo_plus.zero_waste.multi_turn's TurnCache) instead of prefilling its prompt and tokens again. Counted: the token
    positions through the model; the negative control keeps no cache."""
    counted = []
    record = pool.Chunk.record
    monkeypatch.setattr(
        pool.Chunk, "record", lambda self, stats: (counted.append(stats.positions), record(self, stats))
    )
    train(tiny_model_dir, tmp_path / "kept", partial_rollout_tokens=3)
    kept, counted[:] = sum(counted), []
    monkeypatch.setattr(pool, "TurnCache", lambda: None)
    train(tiny_model_dir, tmp_path / "prefilled", partial_rollout_tokens=3)
    prefilled = sum(counted)
    print(f"positions: kept caches {kept}, prefilled again {prefilled}")
    assert kept < 0.6 * prefilled, (kept, prefilled)
