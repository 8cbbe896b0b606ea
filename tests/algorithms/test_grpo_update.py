"""GRPO's passes (algorithms/grpo_update.py): the tokens a pass computes, and micro-batches sorted
by length where that computes fewer."""

from grpolab.algorithms.grpo_update import fewer_padded_tokens, forward_tokens, pass_tokens


def _sequences(prompt_lengths, response_lengths, prompt_of_row):
    return [([7] * prompt_lengths[p], [8] * r, p) for r, p in zip(response_lengths, prompt_of_row)]


def test_pass_tokens_counts_padding_and_shared_prompts_once():
    seqs = _sequences([5, 9], [3, 10, 4, 1], [0, 0, 1, 1])
    # shared: prompts 5 and 9 padded to 9 (2 x 9) + 4 responses padded to 10 (4 x 10)
    assert pass_tokens(seqs, [[0, 1, 2, 3]], True) == 18 + 40
    # not shared: each row padded to the longest prompt + response (15)
    assert pass_tokens(seqs, [[0, 1, 2, 3]], False) == 4 * 15
    assert pass_tokens(seqs, [[0, 1], [2, 3]], True) == (5 + 2 * 10) + (9 + 2 * 4)
    # real tokens only (no padding): each distinct prompt once when shared
    assert forward_tokens(seqs, [0, 1, 2, 3], True) == 5 + 9 + 18
    assert forward_tokens(seqs, [0, 1, 2, 3], False) == 2 * 5 + 2 * 9 + 18


def test_passes_sorted_by_length_when_that_computes_fewer_tokens():
    # short prompts, each group with one long response: sorting puts the long ones together
    seqs = _sequences([2, 2], [1, 1, 1, 50, 1, 1, 1, 50], [0, 0, 0, 0, 1, 1, 1, 1])
    by_group = [[0, 1, 2, 3], [4, 5, 6, 7]]
    plan = fewer_padded_tokens(seqs, by_group, 4, True)
    assert plan == [[0, 1, 2, 4], [5, 6, 3, 7]]
    assert pass_tokens(seqs, plan, True) == 212 < pass_tokens(seqs, by_group, True) == 404
    # long prompts, even responses: a group per pass stays (its prompt is run once)
    seqs = _sequences([60, 60], [5, 6, 5, 6, 6, 5, 6, 5], [0, 0, 0, 0, 1, 1, 1, 1])
    assert fewer_padded_tokens(seqs, by_group, 4, True) == by_group


def _gspo_batch():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpolab.core import get_response_log_probs
    from grpolab.rollout import Rollout
    from grpolab.training.batching import make_rollout_batch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=41, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0))
    prompts, responses = [[1, 2, 3], [4, 5]], [[11, 12, 13, 14], [15, 16], [17, 18, 19], [20, 21, 22, 23, 24]]
    rollouts = [Rollout("p", "r", prompts[i // 2], responses[i], [0.0] * len(responses[i]), "eos", prompt_index=i // 2)
                for i in range(4)]
    batch = make_rollout_batch(rollouts, torch.tensor([1.0, 0, 1, 0]), torch.tensor([1.0, -1.0, 1.0, -1.0]), pad_id=0)
    with torch.no_grad():
        lp = get_response_log_probs(model, batch.input_ids, batch.labels)["log_probs"]
    batch.old_log_probs = lp + 0.15 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3))
    return model, batch, lp


def test_gspo_token_records_show_the_sequence_ratio_the_loss_clipped():
    import contextlib

    import torch

    from grpolab.algorithms.grpo import GRPOConfig
    from grpolab.algorithms.grpo_update import accumulate_policy_gradient
    from grpolab.training.token_records import empty_stats

    model, batch, lp = _gspo_batch()
    cfg = GRPOConfig(rollout_batch_size=4, group_size=2, train_batch_size=4, gradient_accumulation_steps=1,
                     epochs_per_rollout_batch=2, loss_type="gspo", cliprange=0.03, cliprange_high=0.04, device="cpu",
                     show_progress=False, share_prompt_prefix=False)
    stats = empty_stats(batch.labels.shape)
    accumulate_policy_gradient(model, batch, [0, 1, 2, 3], cfg, torch.ones(4, dtype=torch.bool), 0.0, "cpu",
                               contextlib.nullcontext, token_stats=stats)
    m = batch.response_mask
    mean_log_ratio = ((lp - batch.old_log_probs) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)
    sequence_ratio = torch.exp(mean_log_ratio).expand_as(lp)
    assert torch.allclose(stats["ratio"][m], sequence_ratio[m], atol=1e-5)
    # the clip flag agrees with the ratio shown: set where the sequence ratio left the clip range in the
    # advantage's direction (A > 0: above 1 + 0.04; A < 0: below 1 - 0.03)
    adv = batch.advantages.unsqueeze(1).expand_as(lp)[m]
    shown = stats["ratio"][m]
    expected = ((adv > 0) & (shown > 1.04)) | ((adv < 0) & (shown < 0.97))
    assert stats["clipped"][m].bool().tolist() == expected.tolist() and expected.any()


def test_no_baseline_token_records_show_the_raw_reward_the_loss_used(grpo_config, monkeypatch, tmp_path):
    import json
    import sys

    (tmp_path / "len_reward.py").write_text("def reward(response, ground_truth):\n"
                                            "    return {'reward': float(len(response) % 3)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("len_reward", None)
    from grpolab.algorithms.grpo import train_grpo

    cfg = grpo_config(n_grpo_steps=1, rollout_batch_size=8, group_size=4, train_batch_size=8, eval_examples=2,
                      eval_every=0, log_generations_samples=0, loss_type="no_baseline", token_record_groups=2,
                      reward="len_reward:reward", task_train_size=20)
    train_grpo(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "tokens.jsonl").read_text().splitlines()]
    shown = [(r["reward"], r["advantage"]) for row in rows for r in row["responses"]]
    assert len(shown) == 8 and all(reward == advantage for reward, advantage in shown), shown
    assert len({reward for reward, _ in shown}) > 1  # rewards that differ: a group-normalised one would not match
