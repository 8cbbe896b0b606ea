"""grpolab compare --variants: presets, configs, and the seeded report."""

import json
import statistics
from pathlib import Path

import pytest
import yaml

from grpolab.experiments.presets import DEMO_GRPO, REAL_VARIANTS_GRPO, VARIANTS
from grpolab.experiments.variants import (
    accuracy_at,
    curve_area,
    paired,
    parse_variants,
    run_variants,
    summarize,
    variant_config,
)
from tests.helpers.chat_models import chat_model_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_variant_preset_is_a_valid_config_and_its_yaml_matches(name, tmp_path):
    cfg = variant_config(name, tmp_path / name, steps=10, seed=0, show_progress=False)
    for key, value in VARIANTS[name].items():
        assert getattr(cfg, key) == value
    assert cfg.max_rollout_samples == 10 * 128
    on_disk = yaml.safe_load((ROOT / "configs" / "variants" / f"{name}.yaml").read_text())
    assert {k: on_disk[k] for k in VARIANTS[name]} == VARIANTS[name]
    assert all(on_disk[k] == v for k, v in DEMO_GRPO.items() if k not in VARIANTS[name])


def test_unknown_variant_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown variant\\(s\\) nope; choose from grpo, dr_grpo"):
        parse_variants("grpo,nope")


def test_a_variant_named_twice_is_refused_before_anything_trains(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from grpolab import cli
    from grpolab.experiments import variants

    with pytest.raises(ValueError, match="^--variants names grpo more than once; give each variant once$"):
        parse_variants("grpo,dapo,grpo")
    # the CLI: one line, exit 2, and nothing loaded or trained (the report would pair a run with itself)
    monkeypatch.setattr(variants, "load_model_and_tokenizer", lambda *a, **k: pytest.fail("a model was loaded"))
    out = CliRunner().invoke(cli.app, ["compare", "--variants", "grpo,grpo", "--seeds", "1", "--steps", "1",
                                       "--run-dir", str(tmp_path / "c")])
    assert out.exit_code == 2 and out.stderr.strip().splitlines() == [
        "grpolab: error: --variants names grpo more than once; give each variant once"], out.stderr
    assert not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match="more than once"):  # the API too
        run_variants(tmp_path / "r", ["grpo", "grpo"], seeds=1, steps=1, warm_steps=0)


def test_report_aggregates_the_seeds(tmp_path):
    quick = dict(rollout_batch_size=16, train_batch_size=16, sampling_max_tokens=8)
    report = run_variants(tmp_path, ["dr_grpo", "dapo"], seeds=2, steps=2, warm_steps=2, test_examples=8,
                          show_progress=False, overrides=quick)
    assert report["sample_budget"] == 32
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["variants"] == report["variants"]
    assert (tmp_path / "report.png").stat().st_size > 1000 and "| dapo |" in (tmp_path / "report.md").read_text()
    for name in ("dr_grpo", "dapo"):
        runs = report["runs"][name]
        assert [r["seed"] for r in runs] == [0, 1]
        accs = [r["accuracy"] for r in runs]
        assert report["variants"][name]["accuracy_mean"] == pytest.approx(statistics.fmean(accs))
        assert report["variants"][name]["accuracy_std"] == pytest.approx(statistics.stdev(accs))
        # every run spent its budget of 32 sampled responses (dynamic sampling may draw more rounds in one step)
        metrics = [json.loads(l) for l in (tmp_path / "seed0" / name / "metrics.jsonl").read_text().splitlines()]
        drawn = [m["train/samples_drawn"] for m in metrics if "train/samples_drawn" in m]
        assert drawn[-1] >= 32 and (len(drawn) == 1 or drawn[-2] < 32)

    # paired by seed against grpo's absent here: the first variant is the baseline
    assert report["baseline"] == "dr_grpo"
    d = [
        a - b
        for a, b in zip([r["accuracy"] for r in report["runs"]["dapo"]],
                        [r["accuracy"] for r in report["runs"]["dr_grpo"]])
    ]
    assert report["variants"]["dapo"]["vs_baseline"]["per_seed"] == pytest.approx(d)
    gain = report["variants"]["dapo"]["gain_over_warm_start"]["per_seed"]
    assert gain == pytest.approx(
        [r["accuracy"] - w for r, w in zip(report["runs"]["dapo"], report["warm_start_accuracy"])]
    )


def test_paired_differences_are_marked_only_beyond_the_seed_spread():
    consistent = paired([0.50, 0.62, 0.55], [0.40, 0.50, 0.46])  # +10, +12, +9 points
    assert consistent["mean"] == pytest.approx(31 / 300) and consistent["beyond_spread"]
    assert consistent["std"] == pytest.approx(statistics.stdev([0.10, 0.12, 0.09]))
    noisy = paired([0.50, 0.30, 0.55], [0.40, 0.45, 0.46])  # +10, -15, +9: mean +1.3 < its spread
    assert not noisy["beyond_spread"]
    assert not paired([0.9], [0.1])["beyond_spread"]  # one seed: no spread to beat, never marked
    with pytest.raises(ValueError):
        paired([0.5, 0.6], [0.5])  # differences are by seed: the lists must line up


def test_curve_area_and_accuracy_at_a_wall_time():
    curve = [(0, 0.2), (100, 0.4), (300, 0.6)]
    # trapezoids: 100 x 0.3 + 200 x 0.5 = 130, over a range of 300
    assert curve_area(curve) == pytest.approx(130 / 300)
    assert curve_area([(0, 0.7)]) == 0.7
    assert [accuracy_at(curve, t) for t in (0, 99, 100, 250, 1e9)] == [0.2, 0.2, 0.4, 0.4, 0.6]
    # equal wall time: where the fastest variant (mean over seeds) stopped
    run = lambda acc, wall: {"accuracy": acc, "wall": wall, "samples": [(0, 0.1), (10, acc)], "wall_s": wall[-1][0],
                             "tokens_trained": 1, "groups_dropped": 0}
    report = summarize(
        {"grpo": [run(0.5, [(0, 0.1), (50, 0.5)])], "fast": [run(0.3, [(0, 0.1), (20, 0.3)])]}, 1, 10, 10
    )
    assert report["equal_wall_s"] == 20
    assert report["variants"]["grpo"]["accuracy_at_equal_wall"] == 0.1  # grpo had not validated again by 20 s
    assert report["variants"]["fast"]["accuracy_at_equal_wall"] == 0.3


def test_variants_on_a_local_chat_model_use_its_chat_template_and_scale_the_batches(tmp_path):
    cfg = variant_config("dapo", tmp_path / "d", steps=2, seed=0, show_progress=False, base=REAL_VARIANTS_GRPO)
    assert cfg.prompt_template == "chat" and cfg.rollout_batch_size == 32 and cfg.max_rollout_samples == 64
    assert cfg.train_batch_size == 16  # DAPO's two optimizer steps per rollout batch, at 32 rollouts
    # the same when only an override changes the rollout batch; a train_batch_size override is kept as given
    assert (
        variant_config("dapo", tmp_path / "d", 2, 0, False, overrides={"rollout_batch_size": 64}).train_batch_size == 32
    )
    assert variant_config("dapo", tmp_path / "d", 2, 0, False,
                          overrides={"rollout_batch_size": 64, "train_batch_size": 64}).train_batch_size == 64
    model = chat_model_dir(tmp_path / "chat")
    report = run_variants(tmp_path / "r", ["grpo", "rloo"], seeds=1, steps=1, warm_steps=0, test_examples=4,
                          show_progress=False, overrides=dict(sampling_max_tokens=4), model=str(model))
    assert report["model"] == str(model) and report["task_options"]["phrasing"] == "words"
    assert report["sample_budget"] == 32 and len(report["warm_start_accuracy"]) == 1
    on_disk = yaml.safe_load((tmp_path / "r" / "seed0" / "grpo" / "config.yaml").read_text())
    assert on_disk["prompt_template"] == "chat" and on_disk["model"] == str(model)
    with pytest.raises(ValueError, match="--warm-steps applies to the embedded model"):
        run_variants(tmp_path / "x", ["grpo"], seeds=1, steps=1, warm_steps=5, model=str(model))


def test_variants_on_a_reasoning_gym_dataset_score_with_its_own_answer_check(tmp_path):
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is the gym extra (installed by the dev extras)")
    model = chat_model_dir(tmp_path / "chat")
    report = run_variants(tmp_path, ["grpo"], seeds=1, steps=1, warm_steps=0, test_examples=4, show_progress=False,
                          overrides=dict(rollout_batch_size=8, group_size=4, train_batch_size=8, sampling_max_tokens=8),
                          data="rg:basic_arithmetic", model=str(model))
    assert report["task"] == "rg:basic_arithmetic" and report["sample_budget"] == 8
    on_disk = yaml.safe_load((tmp_path / "seed0" / "grpo" / "config.yaml").read_text())
    assert on_disk["task"] == "rg:basic_arithmetic" and on_disk["reward"] is None  # the dataset's own score_answer
    for data, warm, chat, message in (("task:arithmetic", 0, str(model), "takes a reasoning-gym dataset"),
                                      ("rg:basic_arithmetic", 3, None, "no worked solutions"),
                                      ("rg:basic_arithmetic", 0, None, "needs --model DIR")):
        with pytest.raises(ValueError, match=message):
            run_variants(tmp_path / "x", ["grpo"], seeds=1, steps=1, warm_steps=warm, data=data, model=chat)


def test_the_real_model_settings_are_those_of_the_real_model_config_file():
    on_disk = yaml.safe_load((ROOT / "configs" / "real" / "smollm2_135m_grpo_arithmetic.yaml").read_text())
    assert {k: on_disk[k] for k in REAL_VARIANTS_GRPO} == REAL_VARIANTS_GRPO
