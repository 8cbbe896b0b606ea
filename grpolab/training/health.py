"""Health checks that speak up when a run cannot learn.

Every step the trainer reports: the fraction of groups whose rewards are all equal (they give zero
advantage, so zero gradient), the truncation rate, the format-failure rate apart from the
wrong-answer rate, reward-function errors, and the mean |sampler log-prob - trainer log-prob| on the
sampled tokens, and how often the trained reward ranks a right answer above a wrong one of the same
group (``reward_answer_agreement``: 1.0 when the reward is the answer check itself; a learned reward
model being gamed falls to chance or below). ``HealthMonitor.update`` returns a one-paragraph
diagnosis, once per problem, when a condition holds for ``window`` consecutive steps (errors and
mismatch at once). With tools, ``tool_errors_per_rollout`` (``tools/errors_per_rollout`` works too)
at or above ``tool_error_threshold`` for ``window`` steps says the tools keep failing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PROBLEMS = ("zero_variance", "truncation", "format", "reward_errors", "tool_errors", "logprob_mismatch",
            "reward_disagreement")


class UnhealthyRunError(RuntimeError):
    pass


class NonFiniteWeightsError(RuntimeError):
    """An optimizer step left NaN or inf in the weights: the run stops before they are saved."""


@dataclass
class HealthMonitor:
    window: int = 5
    truncation_threshold: float = 0.5
    logprob_mismatch_threshold: float = 0.05
    tool_error_threshold: float = 0.5
    agreement_threshold: float = 0.5  # below: the reward prefers wrong answers to right ones more often than not
    stop_on_unhealthy: bool | tuple[str, ...] = False  # True: any problem stops the run; names: only those
    _streaks: dict[str, int] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)

    def _streak(self, name: str, condition: bool) -> int:
        self._streaks[name] = self._streaks.get(name, 0) + 1 if condition else 0
        return self._streaks[name]

    def update(self, m: dict[str, float]) -> list[str]:
        """``m`` holds this step's health figures (``health/*`` keys without the prefix)."""
        found: list[tuple[str, str]] = []
        if self._streak("zero_variance", m["zero_variance_group_fraction"] >= 1.0) >= self.window:
            if m["reward_mean"] <= 0.0:
                cause = ("every response in every group scored 0: the model never succeeds. Check that the prompt "
                         "template matches the reward's expected format (r1_zero needs the prompt to end in "
                         "'<think>' and the answer in '</think> <answer>...</answer>'), try reward "
                         "'r1_zero_lenient', warm the model up with SFT, or use easier questions.")
            else:
                cause = ("every group got identical rewards (all right or all wrong), so every advantage is 0 and "
                         "nothing is learned. Raise group_size or sampling_temperature, or use harder questions "
                         "if every answer is already right.")
            found.append(("zero_variance", f"No learning signal for {self.window} steps: {cause}"))
        if self._streak("truncation", m["truncation_rate"] > self.truncation_threshold) >= self.window:
            found.append(
                (
                    "truncation",
                    (f"{m['truncation_rate']:.0%} of responses hit sampling_max_tokens for {self.window} steps: "
                     "truncated responses never reach '</answer>' and score 0. Raise sampling_max_tokens, or check "
                     "the stop strings."),
                )
            )
        if self._streak("format", m["format_failure_rate"] >= 1.0) >= self.window:
            found.append(("format", (
                f"Format success has been 0 for {self.window} steps: no response matches the format the reward "
                "expects. Check prompt_template against the reward (r1_zero wants '</think> <answer>' with one "
                "space), or use reward 'r1_zero_lenient' / 'question_only'.")))
        if m.get("reward_errors", 0) > 0:
            found.append(("reward_errors", (
                f"The reward function failed on {int(m['reward_errors'])} responses this step (raised, timed out, or "
                "returned a non-number/NaN); those samples scored 0. Last error: "
                f"{m.get('last_reward_error') or 'unknown'}. Fix the reward function or raise reward_timeout_s.")))
        tool_errors = m.get("tool_errors_per_rollout", m.get("tools/errors_per_rollout"))
        failing = tool_errors is not None and tool_errors >= self.tool_error_threshold
        if self._streak("tool_errors", failing) >= self.window:
            found.append(("tool_errors", (
                f"Tool calls keep failing: {tool_errors:.2f} errors per rollout for {self.window} steps (a tool that "
                "raises, times out, runs out of memory or crashes, or malformed calls). The model reads "
                "'<result>error: ...</result>' instead of results: check the tool (run it on the logged queries), "
                "raise tool_timeout_s or worker_memory_limit_mb, or look at the calls in samples/.")))
        if m.get("logprob_mismatch", 0.0) > self.logprob_mismatch_threshold:
            found.append(("logprob_mismatch", (
                f"Sampler and trainer disagree on the sampled tokens' log-probs (mean |diff| "
                f"{m['logprob_mismatch']:.3f} nats): the importance ratios are off. Use the same dtype for rollout "
                "and training, and make sure the sampled token ids are what is trained on.")))
        agreement = m.get("reward_answer_agreement")
        if agreement is None:  # no (right, wrong) pair this step (e.g. every answer wrong): the streak stands
            streak = self._streaks.get("reward_disagreement", 0)
        else:
            streak = self._streak("reward_disagreement", agreement < self.agreement_threshold)
        if streak >= self.window and agreement is not None:
            found.append(("reward_disagreement", (
                f"The reward disagrees with the task's answer check: within groups it ranked a wrong answer above a "
                f"right one in {1 - agreement:.0%} of (right, wrong) pairs (ties count half) for {self.window} steps. "
                "This is what a learned reward being exploited looks like (reward hacking: the reward rises while "
                "answer accuracy falls). Add a KL penalty to the reference (kl_coef), train fewer steps, or retrain "
                "the reward model on the policy's own samples; watch eval/accuracy.")))
        messages, stopping = [], []
        for name, text in found:
            if name not in self.reported:
                self.reported.add(name)
                messages.append(text)
                if self.stop_on_unhealthy is True or (self.stop_on_unhealthy and name in self.stop_on_unhealthy):
                    stopping.append(text)
        if stopping:
            raise UnhealthyRunError(" ".join(stopping))
        return messages

    def state_dict(self) -> dict:
        """Streaks and what was reported survive a resume (the same diagnosis at the same step)."""
        return {"streaks": dict(self._streaks), "reported": sorted(self.reported)}

    def load_state_dict(self, state: dict) -> None:
        self._streaks = {k: int(v) for k, v in state["streaks"].items()}
        self.reported = set(state["reported"])


def rollout_health(raw_rewards: torch.Tensor, group_size: int, finish_reasons: list[str], format_rewards: torch.Tensor,
                   answer_rewards: torch.Tensor, sampler_log_probs: torch.Tensor, trainer_log_probs: torch.Tensor,
                   checked: torch.Tensor, answer_checked: bool = True) -> dict[str, float]:
    """A rollout batch's health figures: the share of zero-variance groups, the truncation rate,
    the format-failure and wrong-answer rates, the mean |sampler - trainer| log-prob on the
    sampled tokens whose trainer log-prob is known (``checked``, (batch, seq)) with their count
    (the mean is absent when no token was measured), and the reward's agreement with the answer
    check (absent when no group has both a right answer, ``answer_rewards >= 1``, and a wrong one, or
    when ``answer_checked`` is false: the answer rewards are the reward itself, which always agrees)."""
    grouped = raw_rewards.view(-1, group_size)
    mismatch = (sampler_log_probs - trainer_log_probs).abs()[checked]
    out = {
        "zero_variance_group_fraction": float((grouped.max(1).values == grouped.min(1).values).float().mean()),
        "truncation_rate": sum(r == "length" for r in finish_reasons) / len(finish_reasons),
        "format_failure_rate": float(1 - format_rewards.mean()),
        "wrong_answer_rate": float(((format_rewards > 0) & (answer_rewards <= 0)).float().mean()),
        "logprob_mismatch_tokens": int(mismatch.numel()),
    }
    if mismatch.numel():  # nothing measured (no row trained, no old log-probs) is no figure, not a perfect 0.0
        out["logprob_mismatch"] = float(mismatch.mean())
        out["logprob_mismatch_max"] = float(mismatch.max())  # the worst token (max over ranks too)
    if answer_checked:
        out.update(reward_answer_agreement(raw_rewards, answer_rewards, group_size))
    return out


def reward_answer_agreement(
    raw_rewards: torch.Tensor, answer_rewards: torch.Tensor, group_size: int
) -> dict[str, float]:
    """Over every (right, wrong) pair of responses to the same prompt: the share the trained reward
    ranks right above wrong (a tie counts half), and the number of pairs; nothing without a pair."""
    raw = raw_rewards.view(-1, group_size).double()
    right = (answer_rewards >= 1.0).view(-1, group_size)
    pairs = right.unsqueeze(2) & ~right.unsqueeze(1)  # [g, i, j]: i right, j wrong
    if not pairs.any():
        return {}
    diff = raw.unsqueeze(2) - raw.unsqueeze(1)
    score = (diff > 0).double() + 0.5 * (diff == 0).double()
    return {"reward_answer_agreement": float(score[pairs].mean()), "reward_answer_pairs": int(pairs.sum())}
