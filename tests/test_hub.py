"""grpo_plus.app.hub: fail-fast access check, model card, adapter-only push, merge. Offline: the Hub is faked."""

from __future__ import annotations

import http.server
import importlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
from helpers.probes import kept_unchanged
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.hf_api import RepoUrl

from grpo_plus.app.hub import (
    HubAccessError,
    adapter_files_to_push,
    check_hub_access,
    loss_config_from_args,
    merge_adapter,
    push_adapter,
    write_model_card,
)

ADAPTER_PUSH = {"adapter_config.json", "adapter_model.safetensors", "README.md", "reward_curve.png"}
WHOAMI_URL = "https://huggingface.co/api/whoami-v2"
# The HTTP library huggingface_hub sends requests with: httpx2 (hub 2.x), httpx (1.x) or requests (0.x, which
# transformers 4.x needs).
HTTP_SESSION_CLASS = type(huggingface_hub.utils.get_session())
HTTP = importlib.import_module(HTTP_SESSION_CLASS.__module__.split(".")[0])
REAL_SEND = HTTP_SESSION_CLASS.send


# ------------------------------------------------------------------------------------------------ helpers


def add_lora(model):
    """Wrap with a LoRA whose B is random (not zero), so the adapter really changes the outputs."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, config)


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory, tiny_model_dir):
    """(base_dir, adapter_dir, peft_model): the shared tiny base (model + tokenizer) and a LoRA adapter on it."""
    from transformers import AutoModelForCausalLM

    adapter_dir = tmp_path_factory.mktemp("tiny-adapter")
    torch.manual_seed(0)
    peft_model = add_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    peft_model.save_pretrained(adapter_dir)
    with kept_unchanged(adapter_dir, "the shared adapter"):
        yield Path(tiny_model_dir), adapter_dir, peft_model.eval()


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Hub 'online' as far as grpo_plus.app.hub can tell (conftest sets offline mode), but any real HTTP request fails."""

    def refuse(*args, **kwargs):
        raise AssertionError("a test made a network call")

    monkeypatch.setattr(HTTP_SESSION_CLASS, "send", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def fake_whoami(monkeypatch, info: dict, calls: list | None = None) -> None:
    """Make HfApi.whoami answer `info` (recording the token it was asked about)."""

    def whoami(self, token=None, **kwargs):
        if calls is not None:
            calls.append(token)
        return info

    monkeypatch.setattr(HfApi, "whoami", whoami)


def user_info(name="alice", role="write", orgs=(), fine_grained=None) -> dict:
    """A whoami-v2 answer in the Hub's format (auth.accessToken.role: read | write | fineGrained)."""
    token = {"displayName": "test-token", "role": role}
    if fine_grained is not None:
        token["fineGrained"] = {"canReadGatedRepos": False, "global": [], "scoped": fine_grained}
    return {
        "type": "user",
        "name": name,
        "orgs": [{"type": "org", "name": org, "roleInOrg": org_role} for org, org_role in orgs],
        "auth": {"type": "access_token", "accessToken": token},
    }


def scope(entity: str, *permissions: str, kind: str = "user") -> dict:
    """One entry of a fine-grained token's `scoped` list."""
    return {"entity": {"_id": "0", "type": kind, "name": entity}, "permissions": list(permissions)}


def http_error(status: int) -> HfHubHTTPError:
    """An HfHubHTTPError as huggingface_hub raises it for an HTTP status."""
    if HTTP.__name__ == "requests":
        response = HTTP.Response()
        response.status_code, response.url = status, WHOAMI_URL
        response.request = HTTP.Request("GET", WHOAMI_URL).prepare()
    else:
        response = HTTP.Response(status, request=HTTP.Request("GET", WHOAMI_URL))
    return HfHubHTTPError(f"{status} error", response=response)


def connection_error() -> Exception:
    """What the HTTP library raises when the Hub's address does not resolve."""
    error_class = HTTP.exceptions.ConnectionError if HTTP.__name__ == "requests" else HTTP.ConnectError
    return error_class("Name or service not known")


# ------------------------------------------------------------------------------------------------ access check


def test_missing_token_fails_fast_without_network(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.setattr(HfApi, "whoami", lambda *a, **k: pytest.fail("whoami called without a token"))
    start = time.perf_counter()
    with pytest.raises(HubAccessError, match="hf auth login") as err:
        check_hub_access("alice/x")
    assert time.perf_counter() - start < 1.0
    assert "HF_TOKEN" in str(err.value) and "--push_to_hub" in str(err.value)


def test_no_env_token_and_no_cached_login_is_missing_token(monkeypatch, tmp_path):
    """Unpatched get_token: HF_TOKEN unset and no token file means 'no token' (not a network error)."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "stored_tokens"))
    with pytest.raises(HubAccessError, match="none was found"):
        check_hub_access("alice/x")


def test_token_from_env_is_used(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    calls = []
    fake_whoami(monkeypatch, user_info(), calls)
    assert check_hub_access("alice/x") == "alice/x"
    assert calls == ["hf_from_env"]


@pytest.mark.parametrize(
    ("repo_id", "info", "expected"),
    [
        ("x", user_info("alice"), "alice/x"),  # bare name gets the user's namespace, as Trainer does
        ("alice/x", user_info("alice"), "alice/x"),
        ("acme/x", user_info("alice", orgs=[("acme", "write")]), "acme/x"),
        ("acme/x", user_info("alice", orgs=[("acme", "admin")]), "acme/x"),
        ("acme/x", user_info("alice", orgs=[("acme", "contributor")]), "acme/x"),
        ("alice/x", user_info("alice", "fineGrained", fine_grained=[scope("alice", "repo.write")]), "alice/x"),
        (
            "acme/x",
            user_info("alice", "fineGrained", [("acme", "write")], [scope("acme", "repo.write", kind="org")]),
            "acme/x",
        ),
        (
            "alice/x",
            user_info("alice", "fineGrained", fine_grained=[scope("alice/x", "repo.write", kind="model")]),
            "alice/x",
        ),
    ],
)
def test_access_allowed(monkeypatch, repo_id, info, expected):
    fake_whoami(monkeypatch, info)
    assert check_hub_access(repo_id, token="hf_test") == expected


@pytest.mark.parametrize(
    ("repo_id", "info", "message"),
    [
        ("alice/x", user_info("alice", role="read"), "read-only"),
        ("bob/x", user_info("alice"), "not a member of 'bob'"),
        ("acme/x", user_info("alice", orgs=[("acme", "read")]), "role 'read' in 'acme'"),
        (
            "alice/x",
            user_info("alice", "fineGrained", fine_grained=[scope("alice", "repo.content.read")]),
            "repo.write",
        ),
        (
            "acme/x",
            user_info("alice", "fineGrained", [("acme", "admin")], [scope("alice", "repo.write")]),
            "repo.write",
        ),
        ("a/b/c", user_info(), "namespace/name"),
        ("alice/bad name!", user_info(), "Invalid hub model id"),
    ],
)
def test_access_denied(monkeypatch, repo_id, info, message):
    fake_whoami(monkeypatch, info)
    with pytest.raises(HubAccessError, match=message):
        check_hub_access(repo_id, token="hf_test")


def test_invalid_token_is_clear(monkeypatch):
    def whoami(self, token=None, **kwargs):
        raise http_error(401)

    monkeypatch.setattr(HfApi, "whoami", whoami)
    with pytest.raises(HubAccessError, match="invalid or expired"):
        check_hub_access("alice/x", token="hf_bad")


def test_offline_mode_says_network_is_needed(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(HfApi, "whoami", lambda *a, **k: pytest.fail("whoami called in offline mode"))
    with pytest.raises(HubAccessError, match="network access"):
        check_hub_access("alice/x", token="hf_test")


def test_unreachable_hub_says_network_is_needed(monkeypatch):
    def whoami(self, token=None, **kwargs):
        raise connection_error()

    monkeypatch.setattr(HfApi, "whoami", whoami)
    with pytest.raises(HubAccessError, match="could not be reached"):
        check_hub_access("alice/x", token="hf_test")


# ------------------------------------------------------------------------------------------------ model card

LOSS = {"loss_type": "dapo", "importance_sampling_level": "token", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.0}
TASK = {"name": "arithmetic", "description": "sums of two numbers", "difficulty": "two-digit"}


def test_model_card_has_the_fields(tmp_path):
    (tmp_path / "reward_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    path = write_model_card(
        tmp_path,
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        repo_id="alice/smollm2-grpo",
        loss_config={**LOSS, "dual_clip": None, "scale_rewards": "group"},
        task=TASK,
        eval_before={"accuracy": 0.62, "format_rate": 0.1},
        eval_after={"accuracy": 1.0, "format_rate": 0.85},
        training_args={"learning_rate": 3e-4, "max_steps": 40},
        license="apache-2.0",
    )
    card = ModelCard.load(path)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.library_name == "peft"
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.license == "apache-2.0"
    assert {"grpo", "grpo_plus", "trl", "lora"} <= set(card.data.tags)
    text = card.text
    for field in (
        "`loss_type` | dapo",
        "`epsilon_high` | 0.280",
        "`beta` | 0.000",
        "`dual_clip` | –",
        "`scale_rewards`",
    ):
        assert field in text
    assert "arithmetic" in text and "sums of two numbers" in text and "two-digit" in text
    assert "| accuracy | 0.620 | 1.000 | +0.380 |" in text
    assert "| format_rate | 0.100 | 0.850 | +0.750 |" in text
    assert "![reward curve](reward_curve.png)" in text
    assert 'PeftModel.from_pretrained(base, "alice/smollm2-grpo")' in text
    assert "learning_rate" in text
    for lib in ("grpo_plus", "trl", "transformers", "peft", "torch"):
        assert f"- {lib}: " in text


def test_model_card_without_plot_eval_or_hub_base(tmp_path):
    local_base = tmp_path / "base"
    local_base.mkdir()
    path = write_model_card(
        tmp_path / "out",
        base_model=str(local_base),
        repo_id=None,
        loss_config=LOSS,
        task="Count the letters.",
        eval_before=None,
        eval_after=None,
    )
    card = ModelCard.load(path)
    assert card.data.base_model is None  # a local path is not valid Hub metadata
    assert "reward_curve.png" not in card.text and "## Evaluation" not in card.text
    assert "Count the letters." in card.text


def test_model_card_eval_with_one_side_missing_and_unnamed_task(tmp_path):
    """A metric only one side has gets a dash there and no change; a task without a name shows its description."""
    path = write_model_card(
        tmp_path,
        base_model="org/base",
        repo_id=None,
        loss_config=LOSS,
        task={"description": "sums of two numbers", "prompts": 54},
        eval_before={"accuracy": 0.5},
        eval_after={"accuracy": 0.75, "format_rate": 1},
    )
    text = ModelCard.load(path).text
    assert "## Task\n\nsums of two numbers\n\n- prompts: 54\n" in text
    assert "| accuracy | 0.500 | 0.750 | +0.250 |" in text
    assert "| format_rate | – | 1 |  |" in text
    assert f'PeftModel.from_pretrained(base, "{tmp_path}")' in text  # no repo id: the local adapter directory
    assert "Other hyperparameters" not in text


def test_loss_config_from_args():
    class Args:
        loss_type, epsilon, beta, learning_rate = "dapo", 0.2, 0.0, 1e-5

    assert loss_config_from_args(Args()) == {"loss_type": "dapo", "epsilon": 0.2, "beta": 0.0}


# ------------------------------------------------------------------------------------------------ push


@pytest.fixture
def trained_output_dir(tmp_path, base_and_adapter):
    """An output_dir as a training run leaves it: adapter, card, plot, and a lot that must not be pushed."""
    _, adapter_dir, _ = base_and_adapter
    out = tmp_path / "run"
    out.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (out / name).write_bytes((adapter_dir / name).read_bytes())
    write_model_card(
        out, base_model="org/base", repo_id="alice/x", loss_config=LOSS, task=TASK, eval_before=None, eval_after=None
    )
    (out / "reward_curve.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    for junk in (
        "optimizer.pt",
        "scheduler.pt",
        "training_args.bin",
        "model.safetensors",
        "trainer_state.json",
        "adapter_model.bin",
    ):
        (out / junk).write_bytes(b"junk")
    for ckpt in ("checkpoint-1", "checkpoint-2"):
        (out / ckpt).mkdir()
        for name in ("adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "rng_state.pth"):
            (out / ckpt / name).write_bytes(b"junk")
    return out


def fake_upload(monkeypatch) -> dict:
    """Intercept create_repo / create_commit on HfApi; any other upload path fails the test."""
    seen: dict = {"repo": [], "commits": []}

    def create_repo(self, repo_id, **kwargs):
        seen["repo"].append((repo_id, kwargs))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        seen["commits"].append((repo_id, list(operations), kwargs))

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    for name in ("upload_folder", "upload_file"):
        monkeypatch.setattr(HfApi, name, lambda *a, _n=name, **k: pytest.fail(f"{_n} must not be used"))
    return seen


def test_push_sends_exactly_the_adapter_files(monkeypatch, trained_output_dir):
    seen = fake_upload(monkeypatch)
    url = push_adapter(trained_output_dir, "alice/x", token="hf_test", private=True)
    assert url == "https://huggingface.co/alice/x"
    assert seen["repo"] == [("alice/x", {"private": True, "exist_ok": True, "repo_type": "model"})]
    ((repo_id, operations, kwargs),) = seen["commits"]
    assert repo_id == "alice/x"
    assert {op.path_in_repo for op in operations} == ADAPTER_PUSH
    for op in operations:  # each one is the top-level file of output_dir, not a checkpoint's copy
        assert Path(op.path_or_fileobj) == trained_output_dir / op.path_in_repo
    assert "commit_message" in kwargs


def test_push_bin_weights_when_no_safetensors(monkeypatch, trained_output_dir):
    (trained_output_dir / "adapter_model.safetensors").unlink()
    seen = fake_upload(monkeypatch)
    push_adapter(trained_output_dir, "alice/x", token="hf_test")
    paths = {op.path_in_repo for op in seen["commits"][0][1]}
    assert paths == ADAPTER_PUSH - {"adapter_model.safetensors"} | {"adapter_model.bin"}


def test_push_refused_by_the_hub_is_a_hub_access_error(monkeypatch, trained_output_dir):
    """An HTTP error while pushing (e.g. write access revoked during training) reads like the access check's errors,
    so the recipe prints it as an `error:` line."""
    fake_upload(monkeypatch)

    def forbidden(self, repo_id, operations, **kwargs):
        raise http_error(403)

    monkeypatch.setattr(HfApi, "create_commit", forbidden)
    with pytest.raises(HubAccessError, match="Pushing the adapter to alice/x failed \\(HTTP 403\\)"):
        push_adapter(trained_output_dir, "alice/x", token="hf_test")


def test_push_without_adapter_is_a_clear_error(monkeypatch, tmp_path):
    """A full fine-tune (no LoRA) leaves model weights only: refuse before touching the Hub."""
    for name in ("config.json", "model.safetensors", "README.md"):
        (tmp_path / name).write_text("{}")
    seen = fake_upload(monkeypatch)
    with pytest.raises(HubAccessError, match="LoRA adapters only"):
        push_adapter(tmp_path, "alice/x", token="hf_test")
    assert seen == {"repo": [], "commits": []}
    with pytest.raises(HubAccessError, match="--merge"):
        adapter_files_to_push(tmp_path)


# ------------------------------------------------------------------------------------------------ merge


def test_merge_adapter_matches_peft_logits(tmp_path, base_and_adapter):
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir, adapter_dir, peft_model = base_and_adapter
    out = merge_adapter(str(base_dir), adapter_dir, tmp_path / "merged")

    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any(isinstance(m, BaseTunerLayer) for m in merged.modules())
    assert not any("lora" in k for k in merged.state_dict())
    assert not (out / "adapter_config.json").exists()

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template  # the base's tokenizer, chat template included, travels with the merged model
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False)
    ids = tokenizer(text, return_tensors="pt").input_ids
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    with torch.no_grad():
        merged_logits = merged(ids).logits
        peft_logits = peft_model(input_ids=ids).logits
        base_logits = base(ids).logits
    torch.testing.assert_close(merged_logits, peft_logits, atol=6e-7, rtol=0)  # worst 1.9e-7: 3.1x
    assert not torch.allclose(merged_logits, base_logits, atol=1e-3)  # the adapter really did something


# ------------------------------------------------------------------------------------------------ retrying a failed push


class FakeHub(http.server.ThreadingHTTPServer):
    """The Hub's endpoints a push uses, on 127.0.0.1: records every repo-create request and every commit."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), FakeHubHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.creates, self.branches, self.commits, self.fail_commits = [], [], [], True


class FakeHubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path.startswith("/api/whoami-v2"):
            return self.reply(200, user_info())
        self.reply(404, {"error": f"not faked: GET {self.path}"})

    def do_POST(self):
        hub, path = self.server, self.path.split("?")[0]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if path == "/api/repos/create":
            request = json.loads(body)
            hub.creates.append(request)
            return self.reply(200, {"url": f"{hub.url}/{request['organization']}/{request['name']}"})
        if path == "/api/validate-yaml":
            return self.reply(200, {})
        parts = path.split("/")  # /api/models/{namespace}/{name}/{action}/{revision}
        if parts[:3] == ["", "api", "models"] and parts[5] == "branch":
            hub.branches.append(parts[6])
            return self.reply(200, {})
        if parts[:3] == ["", "api", "models"] and parts[5] == "preupload":
            files = json.loads(body)["files"]
            return self.reply(
                200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
            )
        if parts[:3] == ["", "api", "models"] and parts[5] == "commit":
            if hub.fail_commits:
                return self.reply(
                    500, {"error": "Internal Error - We're working hard to fix this as soon as possible!"}
                )
            lines = [json.loads(line) for line in body.splitlines()]
            header = next(line["value"] for line in lines if line["key"] == "header")
            files = sorted(line["value"]["path"] for line in lines if line["key"] == "file")
            hub.commits.append({"revision": parts[6], "summary": header["summary"], "files": files})
            url = f"{hub.url}/{parts[3]}/{parts[4]}/commit/{'0' * 40}"
            return self.reply(200, {"commitUrl": url, "commitOid": "0" * 40, "pullRequestUrl": None})
        self.reply(404, {"error": f"not faked: POST {path}"})


@pytest.fixture
def fake_hub(monkeypatch):
    """A fake Hub on 127.0.0.1 that this process (and a subprocess given HF_ENDPOINT) really talks HTTP to."""
    hub = FakeHub()
    thread = threading.Thread(target=hub.serve_forever, daemon=True)
    thread.start()

    def local_only(self, request, *args, **kwargs):
        assert str(request.url).startswith(hub.url), f"a request left the fake Hub: {request.url}"
        return REAL_SEND(self, request, *args, **kwargs)

    monkeypatch.setattr(HTTP_SESSION_CLASS, "send", local_only)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
    # Online as far as huggingface_hub can tell (conftest sets offline mode; huggingface_hub < 1 refuses every
    # request then, 127.0.0.1 included, through the sessions it made while offline).
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    reset_sessions = getattr(huggingface_hub.utils, "reset_sessions", None)
    if reset_sessions is not None:
        reset_sessions()
    yield hub
    hub.shutdown()
    hub.server_close()


@pytest.mark.engine  # its work is in a child process (moved out of make test: its 10-minute budget)
def test_the_retry_command_of_a_failed_push_keeps_every_setting(monkeypatch, trained_output_dir, fake_hub, capsys):
    """A private push fails after the repo was created; the command the recipe prints must push with the same settings
    (private, branch, commit message), or a retry would create a public repo (the Hub's default)."""
    from grpo_plus.app.hub import PushSettings
    from grpo_plus.app.recipe import push_or_exit

    class Args:
        hub_private_repo, hub_revision, hub_token = True, "grpo-run-1", None

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    with pytest.raises(SystemExit) as exit_info:
        push_or_exit(PushSettings.from_args(trained_output_dir, "alice/x", Args), token=None)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: Pushing the adapter to alice/x failed (HTTP 500)" in err
    retry = err.split("push it later with the same settings: ", 1)[1].strip()
    assert fake_hub.commits == [] and len(fake_hub.creates) == 1
    created = fake_hub.creates[0]
    assert created.get("visibility") == "private" or created.get("private") is True  # huggingface_hub >= 1 / older

    fake_hub.fail_commits = False
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=fake_hub.url, HF_TOKEN="hf_test", HF_HOME=str(trained_output_dir.parent / "hf-home"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # grpo-plus and python of this venv
    result = subprocess.run(["bash", "-c", retry], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert fake_hub.creates[1] == fake_hub.creates[0]  # same visibility, same name
    assert fake_hub.branches == ["grpo-run-1", "grpo-run-1"]
    (commit,) = fake_hub.commits
    assert commit == {
        "revision": "grpo-run-1",
        "summary": "Upload GRPO LoRA adapter (grpo_plus)",
        "files": sorted(ADAPTER_PUSH),
    }


def test_a_failed_push_with_a_flag_token_says_to_export_it(monkeypatch, capsys):
    """The recipe's error line for a failed push whose token came from --hub_token says to export it first (the
    retry command reads HF_TOKEN), and never prints the token."""
    import grpo_plus.app.hub
    from grpo_plus.app.hub import PushSettings
    from grpo_plus.app.recipe import push_or_exit

    def refused(*args, **kwargs):
        raise HubAccessError("Pushing the adapter to alice/x failed (HTTP 500)")

    monkeypatch.setattr(grpo_plus.app.hub, "push_adapter", refused)

    class Args:
        hub_private_repo, hub_revision, hub_token = None, None, "hf_secret_from_the_command_line"

    with pytest.raises(SystemExit):
        push_or_exit(PushSettings.from_args("out", "alice/x", Args), token=Args.hub_token)
    err = capsys.readouterr().err
    assert "hf_secret" not in err
    assert (
        "The adapter is saved in out; push it later with the same settings (first export the token this run got "
        "from --hub_token as HF_TOKEN): grpo-plus push out --repo-id alice/x" in err
    )


def test_the_retry_command_says_where_the_token_came_from():
    from grpo_plus.app.hub import PushSettings

    class Args:
        hub_private_repo, hub_revision, hub_token = False, None, "hf_secret_from_the_command_line"

    instructions = PushSettings.from_args("out dir", "alice/x", Args).retry_instructions()
    assert "hf_secret" not in instructions
    assert instructions == (
        "push it later with the same settings (first export the token this run got from --hub_token as HF_TOKEN): "
        "grpo-plus push 'out dir' --repo-id alice/x --private false --commit-message 'Upload GRPO LoRA adapter (grpo_plus)'"
    )
