"""Health checks that speak up when a run cannot learn.

Every step the trainer reports: the fraction of groups whose rewards are all equal (they give
zero advantage, so zero gradient), the truncation rate, the format-failure rate apart from the
wrong-answer rate, reward-function errors, and the mean |sampler log-prob - trainer log-prob| on
the sampled tokens. ``HealthMonitor.update`` returns a one-paragraph diagnosis, once per problem,
when a condition holds for ``window`` consecutive steps (errors and mismatch at once). With tools,
``tool_errors_per_rollout`` (``tools/errors_per_rollout`` works too) at or above
``tool_error_threshold`` for ``window`` steps says the tools keep failing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


PROBLEMS = ("zero_variance", "truncation", "format", "reward_errors", "tool_errors", "logprob_mismatch")


class UnhealthyRunError(RuntimeError):
    pass


@dataclass
class HealthMonitor:
    window: int = 5
    truncation_threshold: float = 0.5
    logprob_mismatch_threshold: float = 0.05
    tool_error_threshold: float = 0.5
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
            found.append(("truncation", (
                f"{m['truncation_rate']:.0%} of responses hit sampling_max_tokens for {self.window} steps: truncated "
                "responses never reach '</answer>' and score 0. Raise sampling_max_tokens, or check the stop strings.")))
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
                   checked: torch.Tensor) -> dict[str, float]:
    """A rollout batch's health figures: the share of zero-variance groups, the truncation rate,
    the format-failure and wrong-answer rates, and the mean |sampler - trainer| log-prob on the
    sampled tokens whose trainer log-prob is known (``checked``, (batch, seq)) with their count;
    the mean is absent when no token was measured."""
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
    return out
