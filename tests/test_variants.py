"""grpolab compare --variants: presets, configs, and the seeded report."""

import json
import statistics
from pathlib import Path

import pytest
import yaml

from grpolab.presets import DEMO_GRPO, VARIANTS
from grpolab.variants import parse_variants, run_variants, variant_config

ROOT = Path(__file__).resolve().parents[1]


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
