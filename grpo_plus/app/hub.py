"""Hub support for the recipes: fail-fast token/permission check, model card, adapter-only push, local merge.

The recipes call `check_hub_access` before training (a missing or read-only token costs seconds, not a run),
then after training `write_model_card` (rendered from templates/model_card.md, a Jinja template shipped as package
data) and `push_adapter`. `merge_adapter` backs the `--merge` option.
torch / transformers / peft are imported inside `merge_adapter` only, so the rest stays light.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.resources
import logging
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
import jinja2
from huggingface_hub import CommitOperationAdd, ModelCard, ModelCardData
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

logger = logging.getLogger(__name__)

__all__ = [
    "LOSS_CONFIG_KEYS",
    "HubAccessError",
    "PushSettings",
    "adapter_files_to_push",
    "check_hub_access",
    "loss_config_from_args",
    "merge_adapter",
    "push_adapter",
    "write_model_card",
]

# The adapter weights, in the order they are looked for (safetensors wins when both exist).
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# Org roles that may create/push model repos (contributor: repos it created). Hub docs: read|contributor|write|admin.
_WRITE_ORG_ROLES = frozenset({"admin", "write", "contributor"})

# The grpo_plus / TRL fields that define the objective, with what each one means (for the model card).
LOSS_CONFIG_KEYS: dict[str, str] = {
    "loss_type": "loss aggregation over tokens and sequences",
    "importance_sampling_level": "importance ratio: per token, per sequence (GSPO) or sequence_token",
    "scale_rewards": "advantage normalization (group / batch / none)",
    "epsilon": "lower clip range of the ratio",
    "epsilon_high": "upper clip range of the ratio (clip-higher)",
    "delta": "two-sided upper bound on the ratio (INTELLECT-2)",
    "dual_clip": "dual-clip constant for negative advantages",
    "beta": "KL penalty coefficient (0: no reference model)",
    "num_generations": "completions per prompt (group size)",
    "num_iterations": "optimization passes per generation batch",
    "mask_truncated_completions": "drop truncated completions from the loss",
    "top_entropy_quantile": "train only on the highest-entropy tokens",
    "use_bias_correction_kl": "importance-weighted KL term",
}

DEFAULT_COMMIT_MESSAGE = "Upload GRPO LoRA adapter (grpo_plus)"

_LOGIN_HINT = (
    "Log in with `hf auth login` (or the older `huggingface-cli login`), or set the HF_TOKEN environment "
    "variable to a token with write access (https://huggingface.co/settings/tokens); "
    "or drop --push_to_hub to train without pushing."
)


class HubAccessError(RuntimeError):
    """Pushing to the Hub cannot work: no token, bad token, no write permission, bad repo id or no network."""


# ----------------------------------------------------------------------------------------------------------
# Access check
# ----------------------------------------------------------------------------------------------------------


def check_hub_access(repo_id: str, token: str | None = None) -> str:
    """Check that `token` (or the logged-in one) can push to `repo_id`; return the full `namespace/name` id."""
    namespace, name = _split_repo_id(repo_id)
    token = _resolve_token(token)
    info = _whoami(token)
    user = info.get("name")
    if not user:
        raise HubAccessError(f"Unexpected answer from the Hub's whoami endpoint (no user name): {sorted(info)}")
    full_id = f"{namespace or user}/{name}"
    _check_can_write(info, full_id)
    return full_id


def _split_repo_id(repo_id: str) -> tuple[str | None, str]:
    """Split 'namespace/name' (or a bare 'name') after validating the characters the Hub allows."""
    parts = repo_id.strip().split("/") if repo_id else []
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise HubAccessError(f"Invalid hub model id {repo_id!r}: expected 'namespace/name' (e.g. 'alice/my-adapter').")
    try:
        huggingface_hub.utils.validate_repo_id("/".join(parts))
    except huggingface_hub.errors.HFValidationError as e:
        raise HubAccessError(f"Invalid hub model id {repo_id!r}: {e}") from e
    return (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])


def _resolve_token(token: str | None) -> str:
    """Explicit token, else HF_TOKEN / the cached login; fail before any network call when there is none."""
    token = token or huggingface_hub.get_token()
    if not token:
        raise HubAccessError(f"--push_to_hub needs a Hugging Face token, and none was found. {_LOGIN_HINT}")
    return token


def _hub_offline() -> bool:
    """Offline mode, read at call time (huggingface_hub reads its env vars once, at import)."""
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    is_offline_mode = getattr(huggingface_hub.constants, "is_offline_mode", None)  # huggingface_hub >= 1.0
    offline = is_offline_mode() if is_offline_mode is not None else huggingface_hub.constants.HF_HUB_OFFLINE
    return offline or env.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _network_error(e: BaseException | None = None) -> HubAccessError:
    """The error for 'the Hub cannot be reached'."""
    why = "offline mode is on (HF_HUB_OFFLINE=1)" if _hub_offline() else f"the Hub could not be reached ({e})"
    return HubAccessError(
        f"--push_to_hub needs network access to huggingface.co, but {why}. "
        "Unset HF_HUB_OFFLINE / connect to the network, or drop --push_to_hub (the adapter is still saved locally)."
    )


def _is_network_error(e: BaseException) -> bool:
    """Connection failures as raised by huggingface_hub's HTTP client (httpx2, httpx or, before 1.0, requests)."""
    if isinstance(e, (OfflineModeIsEnabled, ConnectionError, TimeoutError)):
        return True
    # Matched by name so this works whichever HTTP library is installed: httpx's transport errors, requests'
    # ConnectionError / Timeout (not subclasses of the built-in exceptions of the same name).
    names = {"TransportError", "ConnectError", "TimeoutException", "ConnectionError", "Timeout"}
    return any(cls.__name__ in names for cls in type(e).__mro__)


def _whoami(token: str) -> dict[str, Any]:
    """Ask the Hub who the token belongs to, turning HTTP and network failures into HubAccessError."""
    if _hub_offline():
        raise _network_error()
    try:
        return huggingface_hub.HfApi(token=token).whoami(token=token)
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status == 401:
            raise HubAccessError(f"The Hugging Face token is invalid or expired (HTTP 401). {_LOGIN_HINT}") from e
        raise HubAccessError(f"Could not check the Hugging Face token (HTTP {status}): {e}") from e
    except Exception as e:
        if _is_network_error(e):
            raise _network_error(e) from e
        raise


def _check_can_write(info: Mapping[str, Any], full_id: str) -> None:
    """Raise unless whoami's answer shows the token may push to `full_id`.

    Blocks only on positive evidence (read role, foreign namespace, fine-grained token without repo.write):
    an unknown token format passes and the Hub itself decides at push time.
    """
    namespace = full_id.split("/")[0]
    user = info["name"]
    access = (info.get("auth") or {}).get("accessToken") or {}
    role = access.get("role")
    if role == "read":
        raise HubAccessError(
            f"The Hugging Face token {access.get('displayName', '')!r} is read-only and cannot push to {full_id}. "
            "Create a token with 'write' role (or a fine-grained token with 'repo.write'). " + _LOGIN_HINT
        )
    orgs = {org.get("name"): org.get("roleInOrg") for org in info.get("orgs") or []}
    if namespace != user:
        if namespace not in orgs:
            raise HubAccessError(
                f"Cannot push to {full_id}: the token belongs to {user!r}, who is not a member of {namespace!r} "
                f"(member of: {sorted(o for o in orgs if o) or 'no organizations'}). Use --hub_model_id {user}/<name>."
            )
        org_role = orgs[namespace]
        if org_role is not None and org_role not in _WRITE_ORG_ROLES:
            raise HubAccessError(
                f"Cannot push to {full_id}: {user!r} has role {org_role!r} in {namespace!r}, which cannot write "
                f"repositories (needs one of {sorted(_WRITE_ORG_ROLES)})."
            )
    if role == "fineGrained" and not _fine_grained_can_write(access.get("fineGrained") or {}, namespace, full_id):
        raise HubAccessError(
            f"The fine-grained token {access.get('displayName', '')!r} has no 'repo.write' permission for "
            f"{namespace!r} (or {full_id}). Edit the token at https://huggingface.co/settings/tokens to allow writing "
            f"to {namespace}'s repositories, or use a 'write' token."
        )


def _fine_grained_can_write(fine_grained: Mapping[str, Any], namespace: str, full_id: str) -> bool:
    """True when a scoped permission grants repo.write on the namespace (user/org) or on the repo itself."""
    for scope in fine_grained.get("scoped") or []:
        entity = (scope.get("entity") or {}).get("name")
        if entity in (namespace, full_id) and "repo.write" in (scope.get("permissions") or []):
            return True
    return False


# ----------------------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------------------


def loss_config_from_args(args: Any) -> dict[str, Any]:
    """Pick the objective-defining fields (LOSS_CONFIG_KEYS) that `args` (a GRPOConfig) has."""
    return {key: getattr(args, key) for key in LOSS_CONFIG_KEYS if hasattr(args, key)}


def write_model_card(
    output_dir: str | os.PathLike,
    *,
    base_model: str,
    repo_id: str | None,
    loss_config: Mapping[str, Any],
    task: Mapping[str, Any] | str,
    eval_before: Mapping[str, Any] | None,
    eval_after: Mapping[str, Any] | None,
    reward_plot: str | None = "reward_curve.png",
    training_args: Mapping[str, Any] | None = None,
    license: str | None = None,
    tags: Iterable[str] = (),
    base_model_on_hub: bool | None = None,
) -> Path:
    """Write output_dir/README.md from templates/model_card.md: metadata, training setup, task, before/after eval,
    reward plot, usage, versions.

    `base_model_on_hub`: whether `base_model` is a Hub id (the card links it and names it in its metadata, which the
    Hub checks); None guesses from its form."""
    output_dir = Path(output_dir)
    on_hub = _is_hub_id(base_model) if base_model_on_hub is None else base_model_on_hub
    output_dir.mkdir(parents=True, exist_ok=True)
    data = ModelCardData(
        base_model=base_model if on_hub else None,
        library_name="peft",
        pipeline_tag="text-generation",
        license=license,
        tags=["grpo", "grpo_plus", "trl", "lora", "peft", "reinforcement-learning", *tags],
    )
    eval_before, eval_after = eval_before or {}, eval_after or {}
    text = _card_template().render(
        card_data=data.to_yaml(),
        base_model=base_model,
        base_model_on_hub=on_hub,
        repo_id=repo_id,
        adapter=repo_id or str(output_dir),
        task=task,
        loss_config=loss_config,
        loss_config_meanings=LOSS_CONFIG_KEYS,
        training_args=training_args,
        eval_before=eval_before,
        eval_after=eval_after,
        eval_metrics=list(dict.fromkeys([*eval_before, *eval_after])),
        reward_plot=reward_plot if reward_plot and (output_dir / reward_plot).is_file() else None,
        versions={
            dist.replace("-", "_"): _version(dist) for dist in ("grpo-plus", "trl", "transformers", "peft", "torch")
        },
    )
    path = output_dir / "README.md"
    ModelCard(text).save(path)
    return path


@functools.cache
def _card_template() -> jinja2.Template:
    """templates/model_card.md, read as package data (so it is found in an installed wheel too)."""
    environment = jinja2.Environment(
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined
    )
    environment.filters["cell"] = _fmt
    environment.globals["change"] = _change
    source = importlib.resources.files(__package__).joinpath("templates", "model_card.md").read_text(encoding="utf-8")
    return environment.from_string(source)


def _is_hub_id(model: str) -> bool:
    """A Hub repo id, not a local path (a local path in `base_model:` metadata is rejected by the Hub)."""
    return not Path(model).exists() and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", model) is not None


def _version(dist: str) -> str:
    """Installed version of a distribution, or 'unknown'."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _is_number(value: Any) -> bool:
    """int/float but not bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _change(before: Any, after: Any) -> str:
    """The eval table's change column: after - before, signed, when both are numbers."""
    return _fmt(after - before, signed=True) if _is_number(after) and _is_number(before) else ""


def _fmt(value: Any, signed: bool = False) -> str:
    """Compact table cell: floats to 3 decimals, None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, float):
        # Fixed decimals keep eval columns aligned; tiny/huge values (learning rates) need significant digits.
        spec = ".3f" if value == 0 or 1e-3 <= abs(value) < 1e4 else ".3g"
        return format(value, ("+" if signed else "") + spec)
    if _is_number(value) and signed:
        return f"{value:+d}"
    return str(value).replace("|", "\\|")


# ----------------------------------------------------------------------------------------------------------
# Push
# ----------------------------------------------------------------------------------------------------------


def adapter_files_to_push(output_dir: str | os.PathLike) -> list[Path]:
    """The files of output_dir that go to the Hub: adapter config + weights, card and plot if present."""
    output_dir = Path(output_dir)
    weights = next((output_dir / f for f in _WEIGHT_FILES if (output_dir / f).is_file()), None)
    if not (output_dir / "adapter_config.json").is_file() or weights is None:
        raise HubAccessError(
            f"{output_dir} holds no LoRA adapter (adapter_config.json + adapter_model.safetensors). "
            "--push_to_hub in the grpo_plus recipes pushes LoRA adapters only: train with --use_peft. "
            "To publish a full model, save it (e.g. with --merge) and upload it yourself (`hf upload <repo_id> <dir>`)."
        )
    optional = [output_dir / f for f in ("README.md", "reward_curve.png") if (output_dir / f).is_file()]
    return [output_dir / "adapter_config.json", weights, *optional]


def push_adapter(
    output_dir: str | os.PathLike,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str = DEFAULT_COMMIT_MESSAGE,
) -> str:
    """Create `repo_id` if needed and push only the adapter files of output_dir in one commit (to branch `revision`,
    created if missing, else the default branch); return the repo URL."""
    files = adapter_files_to_push(output_dir)
    api = huggingface_hub.HfApi(token=token)
    try:
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_url.repo_id, branch=revision, exist_ok=True, repo_type="model")
        # An explicit file list (not upload_folder + patterns): checkpoints, optimizer states and
        # training_args.bin in output_dir can never slip in.
        operations = [CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=str(f)) for f in files]
        api.create_commit(
            repo_url.repo_id, operations, commit_message=commit_message, repo_type="model", revision=revision
        )
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        raise HubAccessError(f"Pushing the adapter to {repo_id} failed (HTTP {status}): {e}") from e
    except Exception as e:
        if _is_network_error(e):
            raise _network_error(e) from e
        raise
    return str(repo_url)


@dataclass(frozen=True)
class PushSettings:
    """Everything a push of the adapter depends on except the token itself (which is never printed or saved), so a
    failed push can be retried with exactly the same settings: `command()` is the `grpo-plus push` line that does."""

    output_dir: str
    repo_id: str
    private: bool | None = None
    revision: str | None = None
    commit_message: str = DEFAULT_COMMIT_MESSAGE
    token_from_flag: bool = False  # the token came from --hub_token, not from HF_TOKEN or the cached login

    @classmethod
    def from_args(cls, output_dir: str | os.PathLike, repo_id: str, args: Any) -> PushSettings:
        """The settings of a recipe's push: its TrainingArguments' hub_private_repo, hub_revision, hub_token."""
        return cls(
            output_dir=str(output_dir),
            repo_id=repo_id,
            private=getattr(args, "hub_private_repo", None),
            revision=getattr(args, "hub_revision", None),
            token_from_flag=getattr(args, "hub_token", None) is not None,
        )

    def push(self, token: str | None = None) -> str:
        return push_adapter(
            self.output_dir,
            self.repo_id,
            token=token,
            private=self.private,
            revision=self.revision,
            commit_message=self.commit_message,
        )

    def command(self) -> str:
        """The shell command that pushes with these settings (the token from HF_TOKEN or the cached login)."""
        words = ["grpo-plus", "push", self.output_dir, "--repo-id", self.repo_id]
        if self.private is not None:
            words += ["--private", str(self.private).lower()]
        if self.revision:
            words += ["--revision", self.revision]
        words += ["--commit-message", self.commit_message]
        return shlex.join(words)

    def retry_instructions(self) -> str:
        token = " (first export the token this run got from --hub_token as HF_TOKEN)" if self.token_from_flag else ""
        return f"push it later with the same settings{token}: {self.command()}"


# ----------------------------------------------------------------------------------------------------------
# Merge
# ----------------------------------------------------------------------------------------------------------


def merge_adapter(
    base_model: str,
    adapter_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    dtype: Any = "auto",
) -> Path:
    """Apply the LoRA adapter to the base model, merge it into the weights and save model + tokenizer.

    The base is always loaded unquantized: an adapter trained with QLoRA (4-bit base) is merged into the
    full-precision (or `dtype`) base weights, since 4-bit weights cannot absorb the LoRA delta. Pass
    `dtype=torch.bfloat16` to halve memory for large models; "auto" uses the checkpoint's dtype.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype)
    if getattr(base.config, "quantization_config", None) is not None:
        raise ValueError(
            f"{base_model} is a quantized checkpoint; merging needs unquantized base weights. "
            "Pass the original (bf16/fp32) base model."
        )
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload(safe_merge=True)
    output_dir = Path(output_dir)
    merged.save_pretrained(output_dir)
    _save_tokenizer(output_dir, adapter_dir, base_model)
    return output_dir


def _save_tokenizer(output_dir: Path, *sources: str | os.PathLike) -> None:
    """Save the first tokenizer found (the adapter dir's, which may carry a chat template, then the base's)."""
    from transformers import AutoTokenizer

    for source in sources:
        # A directory without tokenizer files is skipped rather than handed to AutoTokenizer, which could go
        # looking for the tokenizer elsewhere (an adapter dir names its base model).
        if Path(source).is_dir() and not any(Path(source, f).is_file() for f in _TOKENIZER_FILES):
            continue
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source))
        except (OSError, ValueError, TypeError):
            continue
        tokenizer.save_pretrained(output_dir)
        return
    logger.warning("No tokenizer found in %s; the merged model in %s has none.", [str(s) for s in sources], output_dir)
