"""Routing replay (issue 53): grpo_plus's generator records each completion token's experts; every training-side
forward routes the token to them with the current router's combine weights; `routing/route_flips` and
`routing/router_flips` say what differed. Tiny Qwen3-MoE, OLMoE, Mixtral and gpt-oss (4 experts, top 2)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import make_tokenizer, save_tiny_model, tiny_config, tiny_run_kwargs, tiny_trainer
from helpers.probes import max_weight_diff
from helpers.rewards import half_dead_reward
from peft import LoraConfig
from test_resume import assert_same_trajectory
from test_resume import train as resumable_run
from transformers import AutoModelForCausalLM

import grpo_plus
from grpo_plus.app.testing import MOE_FAMILIES
from grpo_plus.compat.moe import moe_layers
from grpo_plus.compat.versions import version_gap
from grpo_plus.routing import replay as routing_replay
from grpo_plus.routing.replay import NO_ROUTE, ROUTES_KEY, RouteReplay, RouteTally, completion_plan
from grpo_plus.run.state import GenerationBuffer
from grpo_plus.settings import ConfigError
from grpo_plus.zero_waste import generation

# transformers 5's routers (logits, weights, experts) and experts module: below it routing replay is refused
pytestmark = pytest.mark.floor("moe_experts")
PROMPTS = ["1+2=", "3+4=", "12+5=", "7+7="] * 4
# float32 log-probs of the same completion, decoded with a KV cache against one forward over the whole sequence:
# worst gap measured 4.8e-7 (one ulp of a log-prob in [4, 8)), every family; 2 ulps
LOGP_BOUND = 1e-6
# the replayed forward against the oracle (float32; gradient checkpointing on one side): worst measured logits 2.2e-8,
# gradients 2.0e-7 of the largest entry (gpt-oss); a 0.1% change of the combine weights moves logits by 1.1e-5
ORACLE_LOGITS_BOUND, ORACLE_GRAD_BOUND = 1e-7, 5e-7


def lora() -> LoraConfig:  # a fresh one per trainer (PEFT writes into the config it is handed)
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def moe_model(family: str, dtype=torch.float32):
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, len(tokenizer)), dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


def sample(model, tokenizer, monkeypatch, seed: int = 0):
    """grpo_plus's generator on PROMPTS with the experts recorded: (prompt batch, sequences, recorded routes, the
    sampler's log-prob of each sampled token (NaN where the row had finished))."""
    sampled = {}
    next_tokens = generation._next_tokens

    def spy(input_ids, logits, live, *args, **kwargs):
        output, unfinished = next_tokens(input_ids, logits, live, *args, **kwargs)
        logps = torch.log_softmax(logits.float(), dim=-1).gather(1, output[live, -1:]).squeeze(1)
        sampled[input_ids.shape[1]] = (live.clone(), logps)
        return output, unfinished

    monkeypatch.setattr(generation, "_next_tokens", spy)
    torch.manual_seed(seed)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    sequences, stats = generation.generate(
        model, record_routes=True, input_ids=batch.input_ids, attention_mask=batch.attention_mask, do_sample=True,
        max_new_tokens=16, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    monkeypatch.undo()
    assert stats.fallback is None, stats.fallback
    prompt_width = batch.input_ids.shape[1]
    logps = torch.full((sequences.shape[0], sequences.shape[1] - prompt_width), float("nan"))
    for width, (live, values) in sampled.items():
        logps[live, width - prompt_width] = values
    return batch, sequences, stats.routes, logps


def trained_logps(model, batch, sequences, routes, replay: bool):
    """The training forward over cat(prompt, completion) routed by the plan: (log-probs of the completion, tally)."""
    prompt_width = batch.input_ids.shape[1]
    completion = sequences[:, prompt_width:]
    mask = torch.cat([batch.attention_mask, torch.ones_like(completion)], dim=1)
    tally = RouteTally()
    with RouteReplay(replay).planned(model, completion_plan(routes, prompt_width), tally):
        logits = model(input_ids=sequences, attention_mask=mask).logits.float()
    logps = torch.log_softmax(logits[:, prompt_width - 1 : -1], dim=-1).gather(2, completion[..., None]).squeeze(2)
    return logps, tally


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_generator_records_each_completion_tokens_experts(family, monkeypatch):
    """Decoding step j feeds completion token j of the live rows in: its experts are recorded there, (rows,
    completion width, layers, top-k); the last token of each row (never fed in) and what follows an end have none.
    Checked against the router's own choice in one forward over the whole sequence (float32)."""
    model, tokenizer = moe_model(family)
    batch, sequences, routes, logps = sample(model, tokenizer, monkeypatch)
    width = sequences.shape[1] - batch.input_ids.shape[1]
    assert routes.shape == (len(PROMPTS), width, 2, 2) and routes.dtype == torch.int16
    recorded = routes[..., 0, 0] != NO_ROUTE
    sampled = ~logps.isnan()
    # every sampled token but each row's last was fed in: recorded = sampled shifted by one
    assert torch.equal(recorded[:, :-1], sampled[:, 1:]) and not recorded[:, -1].any()
    prompt_width = batch.input_ids.shape[1]
    mask = torch.cat([batch.attention_mask, torch.ones_like(sequences[:, prompt_width:])], dim=1)
    with routing_replay.recorded_experts(model) as chosen:
        model(input_ids=sequences, attention_mask=mask)
        own = torch.stack([c.reshape(len(PROMPTS), -1, 2) for c in chosen], dim=2)[:, prompt_width:]
    same = (own.sort(-1).values == routes.long().sort(-1).values).all(-1).all(-1)
    assert same[recorded].all()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replayed_forward_has_the_samplers_logprobs_in_float32(family, monkeypatch):
    """Sampler and trainer in float32: with replay, no route flips and the training forward's log-probs are the
    sampler's to 2 ulps (measured 4.8e-7)."""
    model, tokenizer = moe_model(family)
    batch, sequences, routes, sampler_logps = sample(model, tokenizer, monkeypatch)
    logps, tally = trained_logps(model, batch, sequences, routes, replay=True)
    assert int(tally.tokens) == int((routes[..., 0, 0] >= 0).sum()) > 100
    assert int(tally.route_flips) == 0 == int(tally.router_flips)
    scored = ~sampler_logps.isnan()
    assert (logps[scored] - sampler_logps[scored]).abs().max() <= LOGP_BOUND


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_a_bf16_sampler_flips_routes_and_replay_brings_them_to_zero(family, monkeypatch):
    """Negative control: a bf16 copy samples, the float32 model trains. Without replay some completion tokens go to
    other experts in training than in sampling (measured on these seeds: 4, 1 and 1 of ~230 tokens); with replay the
    experts the training forward's experts modules receive are the sampler's (route flips 0), while the router's own
    choice still differs where it did (what replay overrode)."""
    trainer_model, tokenizer = moe_model(family)
    sampler = copy.deepcopy(trainer_model).to(torch.bfloat16)
    batch, sequences, routes, _ = sample(sampler, tokenizer, monkeypatch)
    _, off = trained_logps(trainer_model, batch, sequences, routes, replay=False)
    _, on = trained_logps(trainer_model, batch, sequences, routes, replay=True)
    assert int(off.route_flips) == int(off.router_flips) > 0
    assert int(on.route_flips) == 0 and int(on.router_flips) == int(off.router_flips)


# ---- the gradient against the method's definition ----------------------------------------------------------------


def oracle_block(block, family: str, recorded: torch.Tensor):
    """An MoE block's forward written from routing replay's definition: token t goes to its recorded experts
    e_t1..e_tk (where it has a record; else the router's own top-k), each expert's output weighed by the CURRENT
    router's probabilities at those experts, with the family's normalization: Qwen3-MoE / OLMoE softmax over all
    experts (renormalized over the k when norm_topk_prob), Mixtral the same always renormalized, gpt-oss a softmax
    over the k chosen logits. Each expert's output: the experts module run on that expert alone at weight 1."""
    router = block.router if family == "gpt_oss" else block.gate
    experts = block.experts

    def forward(hidden_states):
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])
        logits = torch.nn.functional.linear(hidden, router.weight, getattr(router, "bias", None))
        if family == "gpt_oss":
            own = logits.topk(2, dim=-1).indices
        else:
            own = logits.softmax(-1).topk(2, dim=-1).indices
        chosen = torch.where((recorded >= 0).all(-1, keepdim=True), recorded, own)
        if family == "gpt_oss":
            weights = logits.gather(1, chosen).softmax(-1)
        else:
            weights = logits.float().softmax(-1).gather(1, chosen)
            if family == "mixtral" or router.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(hidden)
        for slot in range(chosen.shape[1]):
            alone = experts(hidden, chosen[:, slot : slot + 1], torch.ones_like(weights[:, :1]))
            out = out + weights[:, slot : slot + 1].to(hidden.dtype) * alone
        out = out.reshape(shape)
        return (out, weights) if family == "gpt_oss" else out

    return forward


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_the_replayed_gradient_is_the_definitions(family, norm_topk_prob, monkeypatch):
    """Recorded experts that are not the router's choice (each completion position's top-2 replaced by the two
    experts it ranks lowest), prompt positions without a record: the logits and every parameter's gradient (the
    router's included) of the replayed forward, under gradient checkpointing (its recompute routes again), equal
    those of the oracle (`oracle_block`) to float32 rounding. Negative control: the forward without the plan is
    another function (its logits differ by far more)."""
    if norm_topk_prob and family not in ("qwen3_moe", "olmoe"):
        return  # the others have no such switch
    model, tokenizer = moe_model(family)
    if family in ("qwen3_moe", "olmoe"):
        for layer in moe_layers(model):
            layer.router.norm_topk_prob = norm_topk_prob
    torch.manual_seed(1)
    ids = torch.randint(3, len(tokenizer), (3, 9))
    prompt_width = 4
    layers = len(moe_layers(model))
    probe = {}

    def lowest(router, args, output):
        probe.setdefault(id(router), output[0].topk(2, dim=-1, largest=False).indices)

    handles = [layer.router.register_forward_hook(lowest) for layer in moe_layers(model)]
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    # recorded experts: each layer's two lowest-ranked in a forward without replay (as a sampler that routed elsewhere)
    routes = torch.stack([probe[id(layer.router)].reshape(3, 9, 2) for layer in moe_layers(model)], dim=2)
    routes = routes[:, prompt_width:].to(torch.int16)
    plan = completion_plan(routes, prompt_width)

    def loss_and_grads(run):
        model.zero_grad()
        logits = run()
        loss = (logits.float().log_softmax(-1)[..., :7] * torch.linspace(-1, 1, 7)).sum()
        loss.backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.train()
    model.gradient_checkpointing_enable()
    replay = RouteReplay(True)

    def replayed():
        with replay.planned(model, plan):
            return model(input_ids=ids).logits

    with replay.hooks_held(model):  # through backward: the recompute routes again
        replayed_logits, replayed_grads = loss_and_grads(replayed)
    model.gradient_checkpointing_disable()
    flat = plan.permute(2, 0, 1, 3).reshape(layers, -1, 2).long()
    with monkeypatch.context() as patch:
        for index, layer in enumerate(model.model.layers):
            patch.setattr(layer.mlp, "forward", oracle_block(layer.mlp, family, flat[index]))
        oracle_logits, oracle_grads = loss_and_grads(lambda: model(input_ids=ids).logits)
    plain_logits, _ = loss_and_grads(lambda: model(input_ids=ids).logits)

    assert (replayed_logits - oracle_logits).abs().max() <= ORACLE_LOGITS_BOUND
    assert set(replayed_grads) == set(oracle_grads)
    router_names = [name for name in oracle_grads if ".gate.weight" in name or ".router.weight" in name]
    assert router_names and all(oracle_grads[name].abs().max() > 0 for name in router_names)
    for name, grad in oracle_grads.items():
        assert (replayed_grads[name] - grad).abs().max() <= ORACLE_GRAD_BOUND * max(1.0, grad.abs().max().item()), name
    assert (plain_logits - oracle_logits).abs().max() > 1e-3


def test_the_hooks_leave_no_trace(monkeypatch):
    """Outside a plan the model routes as it always does: inside `hooks_held` without a plan, and after the block,
    the logits are bit-equal to a fresh copy's, and no hook is left on any attention, router or experts module."""
    model, tokenizer = moe_model("qwen3_moe")
    fresh = copy.deepcopy(model)
    batch, sequences, routes, _ = sample(model, tokenizer, monkeypatch)
    routes = (routes.long() + 1).remainder(4).to(torch.int16).masked_fill(routes < 0, NO_ROUTE)  # other experts
    replayed, _ = trained_logps(model, batch, sequences, routes, replay=True)
    with torch.no_grad():
        expected = fresh(input_ids=sequences).logits
        with RouteReplay(True).hooks_held(model):
            assert torch.equal(model(input_ids=sequences).logits, expected)
        assert torch.equal(model(input_ids=sequences).logits, expected)
    normal, _ = trained_logps(fresh, batch, sequences, routes, replay=False)
    assert (replayed - normal).nan_to_num().abs().max() > 1e-3  # the plan did change the routes
    for layer in moe_layers(model):
        for module in layer:
            assert not module._forward_hooks and not module._forward_pre_hooks, type(module).__name__


def test_a_plan_the_forward_does_not_follow_fails():
    """A plan of another layout than the model calls made fails, naming the shapes (never a silent misroute)."""
    model, _ = moe_model("qwen3_moe")
    plan = torch.full((2, 5, 2, 2), NO_ROUTE, dtype=torch.int16)
    with pytest.raises(RuntimeError, match="not the plan's"):
        with RouteReplay(True).planned(model, plan):
            model(input_ids=torch.randint(3, 20, (2, 6)))
    with pytest.raises(RuntimeError, match="took 1 of the plan's 2 rows"):
        with RouteReplay(True).planned(model, plan):
            model(input_ids=torch.randint(3, 20, (1, 5)))


# ---- settings and the trainer ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        (
            dict(use_vllm=True),
            "needs vLLM's Model Runner V2 ('AuxOutput Connector requires Model Runner V2'), which "
            "needs Triton with a CPU backend",
        ),
        (dict(zero_waste_generation=False), "zero_waste_generation=False"),
        (dict(speculative_rollouts=True), "speculative_rollouts=True"),
        (dict(loss_type="cispo"), "TRL's own _compute_loss"),
    ],
)
def test_what_cannot_record_or_replay_is_refused(settings, fragment, tmp_path):
    with pytest.raises(ConfigError, match="routing_replay=True is not allowed") as error:
        grpo_plus.GRPOConfig(**tiny_run_kwargs(tmp_path, routing_replay=True, **settings))
    assert fragment in " ".join(str(error.value).split())
    grpo_plus.GRPOConfig(**tiny_run_kwargs(tmp_path, routing_replay=False, **settings))  # off: nothing refused


def test_the_receipt_is_refused_with_vllm_as_replay_is(tmp_path):
    """The receipt needs the same records: refused with vLLM for the same reason (the CPU build's engine refuses
    `enable_return_routed_experts`: tests/vllm_engine/test_moe.py checks that on the real build)."""
    with pytest.raises(ConfigError, match="routing_receipt=True is not allowed: .*Model Runner V2"):
        grpo_plus.GRPOConfig(**tiny_run_kwargs(tmp_path, routing_receipt=True, use_vllm=True))


@pytest.mark.floor("cpu_logps")
def test_a_dense_model_or_a_version_below_the_floor_is_refused_at_construction(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="no mixture-of-experts model"):
        tiny_trainer(tmp_path, [half_dead_reward], routing_replay=True)
    from grpo_plus.compat import versions

    reason = "transformers 4.56.2 < 5.0.0: 4.x builds each expert as its own MLP"
    monkeypatch.setattr(versions, "version_gap", lambda name: reason if name == "moe_experts" else None)
    model, tokenizer = moe_model("qwen3_moe")
    with pytest.raises(ValueError, match="below the documented floor `moe_experts` .*: transformers 4.56.2 < 5.0.0"):
        tiny_trainer(tmp_path, [half_dead_reward], model=model, tokenizer=tokenizer, routing_replay=True)


def record_elsewhere(monkeypatch) -> None:
    """The generator records, for each completion token, the experts after the ones chosen (a sampler that routed
    elsewhere: with replay, every recorded token trains through other experts than the router's own)."""
    assemble = routing_replay.StepRoutes.assemble

    def elsewhere(self, width, device):
        routes = assemble(self, width, device)
        return (routes.long() + 1).remainder(4).to(routes.dtype).masked_fill(routes < 0, NO_ROUTE)

    monkeypatch.setattr(routing_replay.StepRoutes, "assemble", elsewhere)


def train(tmp_path, family="qwen3_moe", peft_config=None, **settings):
    model, tokenizer = moe_model(family)
    model.train()
    trainer = tiny_trainer(
        tmp_path, [half_dead_reward], model=model, tokenizer=tokenizer, peft_config=peft_config,
        per_device_train_batch_size=8,
        max_completion_length=12, optim="sgd", learning_rate=0.5, **settings,
    )  # fmt: skip
    trainer.train()
    return trainer


def logged(trainer, key: str) -> list:
    return [entry.get(key) for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.floor("cpu_logps")
def test_the_trainer_replays_in_every_forward(monkeypatch, tmp_path):
    """The records are handed to the trainer with the batch: each completion token's experts shifted to other ones
    (a sampler that routed elsewhere), with replay the training forward's experts modules receive them in every
    layout the pass runs (packed shared prompts, gradient checkpointing), so route flips are 0 while the router's own
    choice differs for every token; the reference pass (beta > 0) replays too: at the first step, policy = reference,
    the KL is exactly 0; so does the old-policy pass (two micro-batches per generation batch): the first step's
    importance ratio is exactly 1. Negative control: the receipt alone logs every token flipped, and a KL > 0 would show a
    pass that routed otherwise."""
    record_elsewhere(monkeypatch)
    replayed = train(tmp_path / "replay", routing_replay=True, beta=0.1, gradient_checkpointing=True,
                     peft_config=lora(), steps_per_generation=2)  # fmt: skip
    assert logged(replayed, "routing/route_flips") == [0.0, 0.0]
    assert logged(replayed, "routing/router_flips") == [1.0, 1.0]
    assert logged(replayed, "kl")[0] == 0.0
    assert logged(replayed, "ratio/mean")[0] == 1.0  # the old-policy pass replayed: at the first step, ratio 1
    if version_gap("shared_prompt") is None:  # shared prompts packed (TRL 1.14: rows computed one by one)
        assert all(frac < 1 for frac in logged(replayed, "zero_waste/positions_frac"))
    receipt = train(tmp_path / "receipt", routing_receipt=True, beta=0.1, gradient_checkpointing=True,
                    peft_config=lora())  # fmt: skip
    assert logged(receipt, "routing/route_flips") == [1.0, 1.0] == logged(receipt, "routing/router_flips")


@pytest.mark.floor("cpu_logps")
def test_an_unrecorded_round_stops_a_replaying_run(tmp_path):
    """The user chose replay: a round whose generation recorded nothing (here: dropout active, so TRL's generation
    ran) stops the run saying why, instead of training unreplayed."""
    model, tokenizer = moe_model("qwen3_moe")
    model.config.attention_dropout = 0.1
    trainer = tiny_trainer(tmp_path, [half_dead_reward], model=model, tokenizer=tokenizer, routing_replay=True,
                           per_device_train_batch_size=8, max_completion_length=8)  # fmt: skip
    with pytest.raises(RuntimeError, match="recorded no experts to replay, because dropout is active"):
        trainer.train()


@pytest.mark.floor("cpu_logps")
def test_a_no_grad_pass_at_generation_is_refused_with_replay(tmp_path):
    """TRL's own reference pass at generation (zero_waste_pass=False, beta > 0) runs inside the generation step,
    before the records are in the batch: with replay the run stops saying so, instead of routing that pass as the
    router decides. The receipt alone (nothing replayed) trains."""
    settings = dict(zero_waste_pass=False, beta=0.1, max_steps=1, peft_config=lora())
    with pytest.raises(RuntimeError, match="TRL runs a no-grad log-prob pass at generation"):
        train(tmp_path / "replay", routing_replay=True, **settings)
    receipt = train(tmp_path / "receipt", routing_receipt=True, **settings)
    assert logged(receipt, "routing/route_flips") == [0.0]


# ---- resume with records in flight -------------------------------------------------------------------------------

# steps_per_generation=4 micro-batches per generation batch, 2 per optimizer step: the checkpoints of steps 1 and 3
# lie inside a generation batch, whose untrained micro-batches (their records with them) the checkpoint buffers.
# LoRA: transformers 5.24's Trainer does not restore a fully trained MoE's experts from its own checkpoint (it saves
# them per expert, as the hub's files hold them, and loads that state dict into the fused experts: "missing keys")
RESUMABLE = dict(steps_per_generation=4, gradient_accumulation_steps=2, max_steps=4, rewards=[half_dead_reward],
                 routing_replay=True, optim="sgd", learning_rate=0.5)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), family="qwen3_moe"))


def restored_records(monkeypatch, change) -> None:
    """The resumed trainer's restored generation buffer, each micro-batch passed through `change` (records lost)."""
    load = GenerationBuffer.load_state_dict

    def load_and_change(self, state):
        load(self, state)
        for batch in self.trainer._buffered_inputs or []:
            change(batch)

    monkeypatch.setattr(GenerationBuffer, "load_state_dict", load_and_change)


@pytest.mark.engine  # five short training runs
@pytest.mark.floor("cpu_logps")
def test_a_checkpoint_inside_a_generation_batch_resumes_with_its_records(tiny_moe_dir, tmp_path, monkeypatch):
    """Records shifted to other experts (replay changes every recorded token's route), float32, SGD: resumed from a
    checkpoint inside a generation batch (steps 1 and 3), the run is the uninterrupted one to the bit: weights, every
    log entry, every micro-batch trained (its records included). The records travel in the checkpoint's buffer.
    Negative controls: the same resume with the restored records emptied (each token routed as the router decides)
    ends elsewhere (measured 1.2e-4 away); with them missing (a checkpoint written with routing_replay off) the run
    stops saying so."""
    record_elsewhere(monkeypatch)

    def run(name: str, checkpoint: str | None = None, **settings):
        saved = None if checkpoint is None else tmp_path / "whole" / checkpoint
        return resumable_run(tiny_moe_dir, tmp_path / name, saved, peft_config=lora(), **RESUMABLE, **settings)

    whole = run("whole", save_strategy="steps", save_steps=1)
    assert (
        logged_run(whole, "routing/route_flips") == [0.0] * 4
        and logged_run(whole, "routing/router_flips") == [1.0] * 4
    )
    for step in (1, 3):
        assert_same_trajectory(run(f"from-{step}", f"checkpoint-{step}"), whole, from_step=step)

    def emptied(batch):
        batch[ROUTES_KEY] = torch.full_like(batch[ROUTES_KEY], NO_ROUTE)

    restored_records(monkeypatch, emptied)
    dropped = run("emptied", "checkpoint-1")
    assert max_weight_diff(whole.weights, dropped.weights) > 1e-5  # measured 1.2e-4 (the resumes: 0.0)
    restored_records(monkeypatch, lambda batch: batch.pop(ROUTES_KEY))
    with pytest.raises(RuntimeError, match="a micro-batch carries no recorded experts to replay"):
        run("missing", "checkpoint-1")


def logged_run(run, key: str) -> list:
    return [entry.get(key) for entry in run.log_history if "loss" in entry]


def test_the_step_time_benchmark_reports_the_median_of_its_runs(tmp_path, benchmark_in_this_process):
    """benchmarks/routing_replay.py --smoke --part steps --repeats 3, in process: three lock-step runs of the three
    settings, each figure of the table the median over the runs; replay trains with no route flip in any run."""
    import json

    import routing_replay as benchmark

    output = tmp_path / "steps.json"
    assert benchmark.main(["--smoke", "--part", "steps", "--repeats", "3", "--json", str(output)]) == 0
    report = json.loads(output.read_text())
    runs, summary = report["step_time_runs"], report["step_time"]
    assert len(runs) == 3 and set(summary) == {"off", "receipt", "replay"}
    for name, figures in summary.items():
        for key, value in figures.items():
            assert value == sorted(run[name][key] for run in runs)[1], (name, key)
    assert summary["off"]["wall_over_off"] == 1.0
    assert all(flips == 0 for run in runs for flips in run["replay"]["route_flips"])
    assert "wall vs off, each run" in output.with_suffix(".md").read_text()
