"""grpolab.algorithms.distill: on-policy distillation. The update is the gradient of the sampled
reverse KL to the teacher (and of core's full-vocabulary divergences), checked against hand-written
references on the tiny model; a short run lowers the held-out KL; the bad inputs are one line each."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from grpolab.algorithms.distill import DistillConfig, distill_update, load_teacher, teacher_log_probs, train_distill
from grpolab.core import compute_advantages, get_response_log_probs, pad_token_id
from grpolab.models import load_model_and_tokenizer, save_model_and_tokenizer
from grpolab.rollout import SamplingParams, make_backend
from grpolab.training.batching import make_rollout_batch
from grpolab.training.metric_logging import read_metrics

ROOT = Path(__file__).resolve().parents[2]
# float32 against float32 in another summation order (chunked head vs plain logits): a relative bound
# well above float32's eps (1.2e-7) times the few hundred terms summed, far below a wrong sign or mask
RELATIVE = 1e-4


def config(tmp_path, **kw) -> DistillConfig:
    base = dict(teacher="embedded:small", n_distill_steps=2, rollout_batch_size=8, group_size=4, train_batch_size=8,
                gradient_accumulation_steps=2, sampling_max_tokens=8, sampling_min_tokens=1, learning_rate=1e-3,
                eval_examples=4, task_train_size=20, show_progress=False, device="cpu", max_grad_norm=None,
                log_generations_samples=0, run_dir=str(tmp_path / "distill"))
    return DistillConfig(**{**base, **kw})


def sampled_batch(model, tok, n_prompts=2, group=4, seed=0):
    backend = make_backend("hf", model, tok, generator=torch.Generator().manual_seed(seed))
    rollouts = backend.generate(["1+2=", "7-3="][:n_prompts], group,
                                SamplingParams(temperature=1.0, max_tokens=8, min_tokens=1, stop=[]))
    rewards = torch.tensor([float(i % 2) for i in range(len(rollouts))])
    return rollouts, rewards


def hand_gradient(model, teacher, batch, signal_of, temperature=1.0):
    """The gradient of sum over response tokens of -signal * log p_student / token count, from plain logits."""
    model.zero_grad(set_to_none=True)
    lp = get_response_log_probs(model, batch.input_ids, batch.labels, temperature=temperature)["log_probs"]
    with torch.no_grad():
        t_lp = get_response_log_probs(teacher, batch.input_ids, batch.labels, temperature=temperature)["log_probs"]
    mask = batch.response_mask
    loss = (-(signal_of(lp.detach(), t_lp)) * lp * mask).sum() / mask.sum()
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def applied_update(run, teacher, batch, cfg):
    before = [p.detach().clone() for p in run.model.parameters()]
    optimizer = torch.optim.SGD(run.model.parameters(), lr=1.0)  # one step: weights - gradient
    distill_update(run, teacher, batch, cfg, optimizer, None)
    return [b - p.detach() for b, p in zip(before, run.model.parameters())]


def assert_close(got: list, want: list) -> None:
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want))
    assert worst <= RELATIVE * scale, (worst, scale)


def test_the_update_is_the_sampled_reverse_kl_gradient(tmp_path, tiny_model, open_run):
    model, tok = tiny_model()
    teacher, _ = tiny_model(seed=1)
    cfg = config(tmp_path)
    run = open_run(cfg, model, tok)
    rollouts, rewards = sampled_batch(run.model, tok)
    batch = make_rollout_batch(rollouts, rewards, torch.zeros(len(rollouts)), pad_token_id(tok))
    batch.ref_log_probs = teacher_log_probs(teacher, batch, cfg, run.device, run.autocast, 0)
    want = hand_gradient(run.model, teacher, batch, lambda s, t: t - s)  # A_t = -(log p_s - log p_t)
    got = applied_update(run, teacher, batch, cfg)
    assert_close(got, want)
    # the other sign (the KL maximised) is another update, far outside the bound: the comparison can fail
    scale = max(float(w.abs().max()) for w in want)
    assert max(float((g + w).abs().max()) for g, w in zip(got, want)) > 100 * RELATIVE * scale


def test_reward_weight_adds_the_group_normalised_reward_to_every_token(tmp_path, tiny_model, open_run):
    model, tok = tiny_model()
    teacher, _ = tiny_model(seed=1)
    cfg = config(tmp_path, reward_weight=0.5)
    run = open_run(cfg, model, tok)
    rollouts, rewards = sampled_batch(run.model, tok)
    advantages = compute_advantages("grpo", rewards, cfg.group_size, advantage_eps=cfg.advantage_eps)
    batch = make_rollout_batch(rollouts, rewards, advantages, pad_token_id(tok))
    batch.ref_log_probs = teacher_log_probs(teacher, batch, cfg, run.device, run.autocast, 0)
    want = hand_gradient(run.model, teacher, batch, lambda s, t: t - s + 0.5 * advantages.unsqueeze(1))
    without = hand_gradient(run.model, teacher, batch, lambda s, t: t - s)
    got = applied_update(run, teacher, batch, cfg)
    assert_close(got, want)
    assert max(float((g - w).abs().max()) for g, w in zip(got, without)) > RELATIVE * 10


@pytest.mark.parametrize("name", ["reverse_kl", "forward_kl", "generalized_jsd"])
def test_full_vocabulary_divergence_update_matches_the_plain_softmax_gradient(name, tmp_path, tiny_model, open_run):
    model, tok = tiny_model()
    teacher, _ = tiny_model(seed=1)
    cfg = config(tmp_path, divergence=name, beta=0.3, sampling_temperature=0.7)
    run = open_run(cfg, model, tok)
    rollouts, rewards = sampled_batch(run.model, tok)
    batch = make_rollout_batch(rollouts, rewards, torch.zeros(len(rollouts)), pad_token_id(tok))
    run.model.zero_grad(set_to_none=True)
    s = torch.log_softmax(run.model(batch.input_ids).logits.double() / 0.7, -1)
    with torch.no_grad():
        t = torch.log_softmax(teacher(batch.input_ids).logits.double() / 0.7, -1)
    ps, pt = s.exp(), t.exp()
    if name == "reverse_kl":
        per = (ps * (s - t)).sum(-1)
    elif name == "forward_kl":
        per = (pt * (t - s)).sum(-1)
    else:
        m = torch.log(0.7 * ps + 0.3 * pt)
        per = 0.3 * (pt * (t - m)).sum(-1) + 0.7 * (ps * (s - m)).sum(-1)
    mask = batch.response_mask
    ((per * mask).sum() / mask.sum()).backward()
    want = [p.grad.detach().float().clone() for p in run.model.parameters()]
    run.model.zero_grad(set_to_none=True)
    assert_close(applied_update(run, teacher, batch, cfg), want)


def test_a_teacher_that_is_the_student_warns_and_moves_nothing(tmp_path, tiny_model, open_run):
    model, tok = tiny_model()
    cfg = config(tmp_path, teacher="embedded:tiny")
    run = open_run(cfg, model, tok)
    with pytest.warns(UserWarning, match="has the student's weights: the KL is 0"):
        teacher = load_teacher(cfg, run.sampling_model, tok, run.device)
    rollouts, rewards = sampled_batch(run.model, tok)
    batch = make_rollout_batch(rollouts, rewards, torch.zeros(len(rollouts)), pad_token_id(tok))
    batch.ref_log_probs = teacher_log_probs(teacher, batch, cfg, run.device, run.autocast, 0)
    assert all(float(d.abs().max()) == 0 for d in applied_update(run, teacher, batch, cfg))


def test_c5_1_teacher_equal_to_student_gives_exactly_zero_advantage_under_bf16_and_fp32_logits(tmp_path, tiny_model,
                                                                                                  open_run):
    """C5-1: under dtype bfloat16 (autocast over fp32 weights) with logits_fp32, the teacher is scored as the
    student is (fp32 weights, fp32 head), so teacher = student gives exactly 0 per-token advantage; a head scaled
    x5 makes logits large enough for a bf16 teacher's rounding to show (it did: mean |advantage| 3.9e-4)."""
    model, tok = tiny_model()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(5)
    save_model_and_tokenizer(model, tok, tmp_path / "same")
    cfg = config(tmp_path, model=str(tmp_path / "same"), teacher=str(tmp_path / "same"), dtype="bfloat16",
                 logits_fp32=True)
    run = open_run(cfg)
    with pytest.warns(UserWarning, match="has the student's weights"):
        teacher = load_teacher(cfg, run.sampling_model, tok, run.device)
    rollouts, rewards = sampled_batch(run.model, tok)
    batch = make_rollout_batch(rollouts, rewards, torch.zeros(len(rollouts)), pad_token_id(tok))
    batch.ref_log_probs = teacher_log_probs(teacher, batch, cfg, run.device, run.autocast, 0)
    out = distill_update(run, teacher, batch, cfg, torch.optim.SGD(run.model.parameters(), lr=0.0), None)
    mask = batch.response_mask
    assert mask.sum() > 0
    gap = float(((out["teacher_lp"] - out["student_lp"]) * mask).abs().sum() / mask.sum())
    assert gap == 0.0, f"mean |advantage| {gap} with the teacher's weights in {next(teacher.parameters()).dtype}"


def test_another_teacher_does_not_warn(tmp_path, tiny_model, open_run):
    model, tok = tiny_model()
    cfg = config(tmp_path)
    run = open_run(cfg, model, tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_teacher(cfg, run.sampling_model, tok, run.device)


def test_distillation_lowers_the_held_out_kl_and_records_per_token_gaps(tmp_path, tiny_model):
    model, tok = tiny_model()
    cfg = config(tmp_path, n_distill_steps=6, learning_rate=3e-3, eval_examples=16, token_record_groups=1,
                 eval_every=0)
    result = train_distill(cfg, model=model, tokenizer=tok)
    before, after = result.before["reverse_kl"], result.after["reverse_kl"]
    assert after < 0.8 * before, (before, after)
    steps = [r for r in read_metrics(result.metrics_path) if "distill/reverse_kl" in r]
    assert [r["distill_step"] for r in steps] == list(range(6))
    assert all("train/reward" in r for r in steps)
    record = json.loads((Path(cfg.run_dir) / "tokens.jsonl").read_text().splitlines()[0])
    response = record["responses"][0]
    gaps = [t - s for t, s in zip(response["teacher_lp"], response["trainer_lp"])]
    assert response["advantage"] == pytest.approx(gaps, abs=2e-3)  # rounded to 3 decimals in the records


def test_c5_5_the_held_out_kl_is_the_policys_whatever_eval_temperature(tmp_path, tiny_model):
    """C5-5: eval/reverse_kl scores log p_student - log p_teacher at the sampling temperature, so its samples are
    drawn there too (a second, seeded draw when eval_temperature differs): greedy validation (eval_temperature 0)
    and eval_temperature 1 give the same figure for the same student and teacher, before any update."""
    figures = {}
    for temperature in (1.0, 0.0):
        model, tok = tiny_model()
        cfg = config(tmp_path, n_distill_steps=1, eval_temperature=temperature, eval_examples=8, eval_every=0,
                     run_dir=str(tmp_path / f"eval_t{temperature}"))
        figures[temperature] = train_distill(cfg, model=model, tokenizer=tok).before["reverse_kl"]
    assert figures[0.0] == figures[1.0], figures


def test_prompt_only_data_trains_and_measures_the_held_out_kl(tmp_path, tiny_model):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{b}="}) + "\n" for a in range(5) for b in range(4)))
    model, tok = tiny_model()
    cfg = config(tmp_path, task=None, train_data=str(data), eval_data=str(data), answer_field=None,
                 prompt_template="compact", eval_every=0)
    result = train_distill(cfg, model=model, tokenizer=tok)
    assert set(result.after) >= {"reverse_kl"} and "accuracy" not in result.after
    assert all("train/reward" not in r for r in read_metrics(result.metrics_path))
    with pytest.raises(ValueError, match="reward_weight > 0 needs answers"):
        train_distill(config(tmp_path, task=None, train_data=str(data), answer_field=None, reward_weight=1.0,
                             prompt_template="compact", run_dir=str(tmp_path / "other")), model=model, tokenizer=tok)


# ---------------------------------------------------------------- bad input: one line each


def cli(tmp_path, *args) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "grpolab", "distill", "--n-distill-steps", "1", "--rollout-batch-size", "4",
            "--group-size", "2", "--train-batch-size", "4", "--gradient-accumulation-steps", "1",
            "--sampling-max-tokens", "4", "--task-train-size", "8", "--eval-examples", "2", "--show-progress", "false",
            "--run-dir", str(tmp_path / "run"), *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def one_line(proc, *needles) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("grpolab:") and "error" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_a_missing_teacher_is_one_line(tmp_path):
    one_line(cli(tmp_path, "--teacher", tmp_path / "nowhere"), "teacher", "nowhere", "no such model directory")
    assert not (tmp_path / "run").exists()


def test_no_teacher_is_one_line(tmp_path):
    one_line(cli(tmp_path), "teacher")


def test_a_teacher_with_another_vocabulary_is_one_line(tmp_path, tiny_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok = tiny_model()
    tok.add_tokens(["<extra>"])  # one more token: another tokenizer and another vocabulary
    other = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    save_model_and_tokenizer(other, tok, tmp_path / "teacher")
    one_line(cli(tmp_path, "--teacher", tmp_path / "teacher"), "tokenizer differs from the student's")
    assert not (tmp_path / "run").exists()


def test_nan_teacher_log_probs_are_one_line(tmp_path):
    teacher, tok = load_model_and_tokenizer("embedded:tiny", seed=3)
    with torch.no_grad():
        teacher.model.norm.weight.fill_(float("nan"))
    save_model_and_tokenizer(teacher, tok, tmp_path / "teacher")
    # its weights are checked before anything runs (reliability case D08/D10): the weight is named
    one_line(cli(tmp_path, "--teacher", tmp_path / "teacher"), "model.norm.weight holds NaN or inf")
    assert not (tmp_path / "run").exists()
