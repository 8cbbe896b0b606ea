"""grpolab.training.config (YAML + overrides, one-line errors, resume changes) and the shared config classes
(run_config.py, sampled_run_config.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

from grpolab.core import AdaptiveKLController, FixedKLController
from grpolab.training.config import RESUME_MAY_CHANGE, ConfigError, parse_overrides, resume_changes
from grpolab.training.run_config import RunConfig
from grpolab.training.sampled_run_config import PolicyUpdateConfig, SampledRunConfig

ROOT = Path(__file__).resolve().parents[2]
BATCHES = dict(rollout_batch_size=8, group_size=4, train_batch_size=8, gradient_accumulation_steps=1)


def _policy(**kw):
    return PolicyUpdateConfig(**{**BATCHES, **kw})


# ---------------------------------------------------------------- build: YAML and overrides
def test_build_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 3\nrun_dir: runs/x\nbetas: [0.8, 0.9]\n")
    cfg = RunConfig.build(path, {"seed": 5, "max-grad-norm": None})
    assert (cfg.seed, cfg.run_dir, cfg.betas, cfg.max_grad_norm) == (5, "runs/x", (0.8, 0.9), None)
    assert RunConfig.build(None).seed == 0


def test_empty_yaml_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert RunConfig.build(path).to_dict() == RunConfig().to_dict()


@pytest.mark.parametrize("text,message", [
    ("seed: 3\nfoo: [1\n", r"bad.yaml:\d+: invalid YAML"),
    ("- 1\n- 2\n", "the config must be a mapping"),
    ("seeed: 1\n", "unknown key 'seeed'"),
    ("seed: banana\n", "'seed'"),
])
def test_file_errors_name_the_file_and_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        RunConfig.build(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_file_and_unknown_override():
    with pytest.raises(ConfigError, match="no such config file"):
        RunConfig.build("/nonexistent/c.yaml")
    with pytest.raises(ConfigError, match=r"unknown key 'sed' \(command line\); did you mean 'seed'\?"):
        RunConfig.build(None, {"sed": 1})


def test_parse_overrides():
    # values are kept as typed and read by their field's type; an empty value is null, like "null" and "~"
    args = ["--seed", "3", "--run-dir=runs/a b", "--betas", "[0.8, 0.9]", "--max-grad-norm", "null", "--task", "",
            "--model", "embedded:tiny", "--show-progress", "false", "--train-data", "x.jsonl"]
    overrides = parse_overrides(args)
    assert overrides == {"seed": "3", "run_dir": "runs/a b", "betas": "[0.8, 0.9]", "max_grad_norm": "null",
                         "task": "", "model": "embedded:tiny", "show_progress": "false", "train_data": "x.jsonl"}
    cfg = RunConfig.build(None, overrides)
    assert (cfg.seed, cfg.run_dir, cfg.betas, cfg.max_grad_norm, cfg.task, cfg.show_progress) == \
        (3, "runs/a b", (0.8, 0.9), None, None, False)
    with pytest.raises(ConfigError, match="unexpected argument 'seed'"):
        parse_overrides(["seed", "3"])
    with pytest.raises(ConfigError, match="--seed needs a value"):  # a bare --key is true only for a boolean
        RunConfig.build(None, parse_overrides(["--seed"]))


def test_data_source_and_accumulation_rules():
    assert RunConfig.build(None, {"train_data": "x.jsonl"}).task is None  # a file alone means no embedded task
    with pytest.raises(ConfigError, match="exactly one of task"):
        RunConfig.build(None, {"train_data": "x.jsonl", "task": "arithmetic"})
    with pytest.raises(ConfigError, match="exactly one of task"):
        RunConfig.build(None, {"task": None})
    with pytest.raises(ConfigError,
                       match=r"train_batch_size \(10\) must be divisible by gradient_accumulation_steps \(4\)"):
        PolicyUpdateConfig.build(None, {**BATCHES, "train_batch_size": 10, "gradient_accumulation_steps": 4,
                                        "rollout_batch_size": 20, "group_size": 2})


def test_yaml_errors_and_cli_exit_codes(tmp_path):
    from grpolab.algorithms.grpo import GRPOConfig

    bad = tmp_path / "bad.yaml"
    bad.write_text("n_grpo_steps: 3\nfoo: [1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: invalid YAML"):
        GRPOConfig.build(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("n_grpo_steps: 3\ngroup_sise: 4\n")
    proc = subprocess.run([sys.executable, "-m", "grpolab.cli", "grpo", "--config", str(unknown)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert "unknown key 'group_sise'" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "grpolab.cli", "grpo", "--group-size", "3"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "rollout_batch_size (256) must be divisible by group_size (3)" in proc.stderr


def test_shipped_configs_validate():
    from grpolab.algorithms.distill import DistillConfig
    from grpolab.algorithms.dpo import DPOConfig
    from grpolab.algorithms.expert_iteration import EIConfig
    from grpolab.algorithms.grpo import GRPOConfig
    from grpolab.algorithms.ppo import PPOConfig
    from grpolab.algorithms.sft import SFTConfig

    classes = {"grpo": GRPOConfig, "sft": SFTConfig, "ppo": PPOConfig, "dpo": DPOConfig, "ei": EIConfig,
               "distill": DistillConfig}
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    assert len(paths) >= 6
    for path in paths:
        classes[path.name.split("_")[0]].build(path)


# ---------------------------------------------------------------- SampledRunConfig
def test_greedy_sampling_with_groups_is_refused_but_greedy_evaluation_is_allowed():
    with pytest.raises(ConfigError, match=r"sampling_temperature 0 \(greedy\) with group_size 4.*every advantage is 0"):
        PolicyUpdateConfig.build(None, {**BATCHES, "sampling_temperature": 0})
    assert _policy(eval_temperature=0).eval_temperature == 0
    # one response per question: nothing to compare within a group, greedy is allowed
    assert _policy(sampling_temperature=0, group_size=1).sampling_temperature == 0
    assert SampledRunConfig(sampling_temperature=0).sampling_params().temperature == 0


def test_policy_temperature_is_the_sampling_temperature_and_greedy_scores_at_one():
    assert SampledRunConfig(sampling_temperature=0.6).policy_temperature == 0.6
    assert SampledRunConfig(sampling_temperature=0).policy_temperature == 1.0
    assert SampledRunConfig().policy_temperature == 1.0


def test_sampling_params_follow_the_config():
    cfg = SampledRunConfig(sampling_temperature=0.7, sampling_top_p=0.9, sampling_max_tokens=20, sampling_min_tokens=2,
                           stop=["</answer>", "\n\n"], eval_temperature=0.0, seed=4)
    s = cfg.sampling_params()
    assert (s.temperature, s.top_p, s.max_tokens, s.min_tokens, s.stop, s.seed) == (0.7, 0.9, 20, 2,
                                                                                    ["</answer>", "\n\n"], None)
    e = cfg.eval_sampling_params()
    assert (e.temperature, e.max_tokens, e.min_tokens, e.stop, e.seed) == (0.0, 20, 2, ["</answer>", "\n\n"], 5)


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(ConfigError, match=r"sampling_min_tokens \(9\) exceeds sampling_max_tokens \(8\)"):
        SampledRunConfig.build(None, {"sampling_min_tokens": 9, "sampling_max_tokens": 8})


# ---------------------------------------------------------------- PolicyUpdateConfig


def test_kl_controller_with_kl_coef_zero_is_a_fixed_zero_even_when_adaptive():
    ctl = _policy(kl_coef=0.0, kl_adaptive=True, kl_coef_min=0.1).kl_controller()
    assert isinstance(ctl, FixedKLController) and ctl.value == 0.0
    assert ctl.update(100.0, 8) == 0.0 and ctl.value == 0.0  # the controller never raises it to kl_coef_min


def test_kl_controller_kinds():
    adaptive = _policy(kl_coef=0.2, kl_adaptive=True, kl_target=0.5, kl_horizon=8, kl_coef_min=0.05,
                       kl_coef_max=0.4).kl_controller()
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.2
    assert adaptive.update(10.0, 8) == pytest.approx(0.2 * 1.2)  # KL far above target: the error clips at +0.2
    fixed = _policy(kl_coef=0.2).kl_controller()
    assert isinstance(fixed, FixedKLController) and fixed.update(10.0, 8) == 0.2


@pytest.mark.parametrize("over,message", [
    (dict(rollout_batch_size=10, group_size=4), r"rollout_batch_size \(10\) must be divisible by group_size \(4\)"),
    (dict(rollout_batch_size=8, group_size=4, train_batch_size=3), r"must be divisible by train_batch_size \(3\)"),
    (dict(kl_coef_min=0.5, kl_coef_max=0.3), r"kl_coef_min \(0.5\) exceeds kl_coef_max \(0.3\)"),
    (dict(kl_stop=0), "'kl_stop'"),
])
def test_policy_update_batch_rules(over, message):
    with pytest.raises(ConfigError, match=message):
        PolicyUpdateConfig.build(None, {**BATCHES, **over})


# ---------------------------------------------------------------- resume changes
def test_resume_changes_separates_allowed_from_refused():
    saved = {"n_grpo_steps": 10, "learning_rate": 1e-5, "seed": 0, "eval_every": 5, "betas": [0.9, 0.95],
             "report_to": []}
    new = {"n_grpo_steps": 20, "learning_rate": 2e-5, "seed": 1, "eval_every": 5, "betas": (0.9, 0.95),
           "report_to": ["tensorboard"], "extra": True}
    changes = resume_changes(saved, new, "n_grpo_steps")
    assert changes.allowed == {"n_grpo_steps": (10, 20), "report_to": ([], ["tensorboard"])}
    # "extra" is a field the saved run did not have (a newer grpolab added it): not a change
    assert changes.refused_fields == {"learning_rate": (1e-5, 2e-5), "seed": (0, 1)}
    assert changes.refused == "learning_rate: 1e-05 -> 2e-05; seed: 0 -> 1"
    assert changes.allowed_keys == ("n_grpo_steps", *RESUME_MAY_CHANGE)


def test_resume_changes_of_an_identical_config_are_empty():
    from grpolab.algorithms.grpo import GRPOConfig

    d = GRPOConfig().to_dict()
    changes = resume_changes(d, dict(d), GRPOConfig.steps_field)
    assert changes.allowed == {} and changes.refused_fields == {} and changes.refused == ""


def test_only_length_and_watching_fields_may_change_on_resume():
    from grpolab.algorithms import METHODS

    for key in (
        "learning_rate",
        "seed",
        "group_size",
        "loss_type",
        "model",
        "reward",
        "sampling_temperature",
        "kl_coef",
    ):
        assert key not in RESUME_MAY_CHANGE
    for key in ("eval_every", "checkpoint_every", "keep_last", "run_dir", "device"):
        assert key in RESUME_MAY_CHANGE
    for method in METHODS.values():  # each run's own length, and no other method's
        config = method.load()[0]
        changes = resume_changes(config().to_dict(), {**config().to_dict(), config.steps_field: 10**6},
                                 config.steps_field)
        assert set(changes.allowed) == {config.steps_field} and not changes.refused_fields
        assert not any(key.startswith("n_") and key.endswith("_steps") for key in RESUME_MAY_CHANGE)


def test_rollout_backend_vllm_is_grpo_only_and_turns_the_is_correction_on():
    from grpolab.algorithms.grpo import GRPOConfig
    from grpolab.algorithms.ppo import PPOConfig

    assert GRPOConfig(rollout_backend="vllm").is_correction == "tis"
    assert GRPOConfig().is_correction == "none"
    assert GRPOConfig(rollout_backend="vllm", importance_sampling_correction="none").is_correction == "none"
    options = GRPOConfig(rollout_backend="vllm", dtype="bfloat16", vllm_cpu_kvcache_space_gib=2).backend_options()
    assert options["dtype"] == "bfloat16" and options["cpu_kvcache_space_gib"] == 2
    assert GRPOConfig().backend_options() == {}
    with pytest.raises(ConfigError, match="rollout_backend 'vllm' is supported by grpo, sft, ei and grpolab eval; ppo"):
        PPOConfig.build(overrides={"rollout_backend": "vllm"})


CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")) + sorted(CONFIGS.glob("real/*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_config_file_is_valid(path):
    from grpolab.algorithms import METHODS

    # grpo_*.yaml -> GRPOConfig, ...; configs/real/MODEL_METHOD_*.yaml name their method after the model
    method = next(part for part in path.stem.split("_") if part in METHODS)
    config = METHODS[method].load()[0].build(path)
    assert config.command == method


def test_a_field_declared_again_only_for_its_default_keeps_the_base_description():
    from grpolab.algorithms.dpo import DPOConfig
    from grpolab.algorithms.grpo import GRPOConfig

    for cls in (GRPOConfig, DPOConfig):
        assert cls.model_fields["run_dir"].description == RunConfig.model_fields["run_dir"].description
    assert DPOConfig.model_fields["task_train_size"].description.startswith("How many distinct training questions")
    assert (GRPOConfig().run_dir, DPOConfig().task_train_size) == ("runs/grpo", 1000)
