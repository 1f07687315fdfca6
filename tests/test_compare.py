"""`grpo-plus compare`: runs named configurations on a tiny model and writes a readable report."""

import json

import pytest

from grpo_plus.app.cli import main
from grpo_plus.app.compare import PRESETS, parse_configuration


@pytest.mark.slow
@pytest.mark.engine  # a benchmark's smoke run (moved out of make test: its 10-minute budget)
def test_compare_writes_png_table_and_runs(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "report"
    code = main(
        ["compare", "--model", tiny_model_dir, "--task-level", "add-1d", "--max-steps", "2", "--eval-every", "1",
         "--eval-size", "8", "--configs", "grpo", "dapo_dynamic_sampling", "wide:gspo+epsilon_high=0.001",
         "--output-dir", str(out)]
    )  # fmt: skip
    assert code == 0
    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    table = (out / "compare.md").read_text()
    for name in ("grpo", "dapo_dynamic_sampling", "wide"):
        assert f"| {name} | 1 |" in table
    assert "held-out acc after" in table and "![curves](compare.png)" in table
    runs = json.loads((out / "runs.json").read_text())
    assert [r["name"] for r in runs] == ["grpo", "dapo_dynamic_sampling", "wide"]
    for run in runs:
        evals = [e for e in run["log_history"] if "eval_accuracy" in e]
        assert [e["step"] for e in evals] == [0, 1, 2]
        assert any("reward" in e for e in run["log_history"])
    dynamic = next(r for r in runs if r["name"] == "dapo_dynamic_sampling")
    assert any("dynamic_sampling/rounds" in e for e in dynamic["log_history"])
    assert "| configuration |" in capsys.readouterr().out


def test_configuration_specs():
    assert parse_configuration("gspo") == ("gspo", PRESETS["gspo"])
    name, overrides = parse_configuration("mine:dapo_clip_higher+scale_rewards=batch,beta=0.01,dynamic_sampling=true")
    assert name == "mine"
    assert overrides == {
        **PRESETS["dapo_clip_higher"],
        "scale_rewards": "batch",
        "beta": 0.01,
        "dynamic_sampling": True,
    }
    assert parse_configuration("plain:loss_type=dr_grpo") == ("plain", {"loss_type": "dr_grpo"})
    with pytest.raises(ValueError, match="presets: grpo"):
        parse_configuration("ppo")


def test_cli_reports_bad_configuration(capsys):
    assert main(["compare", "--configs", "nope", "--max-steps", "1"]) == 2
    assert "Unknown configuration 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec, message",
    [
        ("x:nopreset+beta=0.1", "unknown preset 'nopreset'"),
        ("x:grpo+epsilon_hgh=0.3", "'epsilon_hgh' is not a GRPOConfig field. Did you mean 'epsilon_high'"),
        ("x:grpo+loss_type=dapoo", "loss_type"),
        ("x:dual_clip=0.5", "dual_clip"),
    ],
)
def test_cli_rejects_bad_configuration_before_training(spec, message, capsys, monkeypatch):
    import grpo_plus.app.compare

    def must_not_train(*args, **kwargs):
        raise AssertionError("a run started before every configuration was checked")

    monkeypatch.setattr(grpo_plus.app.compare, "run_configuration", must_not_train)
    assert main(["compare", "--configs", "grpo", spec, "--max-steps", "1"]) == 2
    assert message in capsys.readouterr().err


def test_cli_names_the_closest_flag_for_an_unknown_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--eval-evry", "2", "--max-steps", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "grpo-plus compare: error: unrecognized arguments: '--eval-evry' (did you mean '--eval-every'?)" in err


def test_cli_reports_a_plugin_that_does_not_import(capsys):
    assert main(["list", "--plugins", "no_such_module_of_modes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo-plus list: error: plugins: could not import 'no_such_module_of_modes'")
    assert "Traceback" not in err
