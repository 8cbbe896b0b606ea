"""``verifiers`` environments as a run's environment (``env: {verifiers: NAME}``).

What each kind becomes:

- ``SingleTurnEnv``: no environment at all — the dataset is the task and the rubric the reward
  (``data/tasks/vf.py``, ``rewards/vf_rubric.py``), sampled as any prompt.
- ``ToolEnv``: its Python tools through native function calling (``ChatToolEnv``): their
  ``tool_defs`` are the schemas, the chat template renders them, ``max_turns`` is the
  environment's; the rubric reads the conversation (``Rollout.messages``).
- any other ``MultiTurnEnv``: the environment drives each rollout itself — ``env.rollout`` against
  grpolab's chat endpoint (``chat_server.ChatServer``, one per backend, on 127.0.0.1) with
  verifiers' own OpenAI client — and is scored by its rubric on the live state, inside one
  ``timeout_s``. Each rollout calls the endpoint under a model name of its own, so its turns are
  known exactly: the trained sequence is the last turn's prompt and sampled ids, the earlier turns'
  sampled ids trained (with their sampler log-probs), the environment's messages between them
  masked. A turn the conversation did not continue (an environment that rewrote its history) is left
  out of the loss and counted (``unchained_turns``). An environment that raises or runs past the
  timeout gives a rollout with no trained token, reward 0, and one warning line naming the
  environment and the error (``env_errors``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import secrets
import sys
import uuid
from typing import Any

from ..rewards.vf_reward import score_counting_errors
from ..rollout import Rollout, SamplingParams
from .chat_server import ChatServer
from .chat_tools import ChatRenderer


def vf_tool_schemas(vf_env) -> list[dict]:
    """A ToolEnv's ``tool_defs`` as OpenAI function schemas (what chat templates render)."""
    out = []
    for tool in getattr(vf_env, "tool_defs", None) or []:
        get = tool.get if isinstance(tool, dict) else (lambda k, t=tool: getattr(t, k, None))
        out.append({"type": "function", "function": {"name": get("name"), "description": get("description") or "",
                                                     "parameters": get("parameters") or {"type": "object",
                                                                                         "properties": {}}}})
    return out


class VerifiersDriver:
    """A run's environment for a verifiers multi-turn environment (see the module docstring)."""

    call_cost = 0.0

    def __init__(self, spec: str, vf_env, tokenizer, *, max_total_tokens: int, chat_template: str | None = None,
                 timeout_s: float = 120.0, batch_wait_s: float = 0.02):
        self.spec, self.vf_env, self.tokenizer = spec, vf_env, tokenizer
        self.rows = {}  # a row's prompt messages -> the row (plain data), over both datasets
        for data in (vf_env.build_dataset(), vf_env.build_eval_dataset()):
            for row in data or []:
                plain = json.loads(json.dumps(dict(row), default=str))
                self.rows.setdefault(_key(plain.get("prompt") or []), plain)
        vf_env.set_max_total_completion_tokens(max_total_tokens)
        self.max_total_tokens, self.chat_template, self.timeout_s = max_total_tokens, chat_template, timeout_s
        self.batch_wait_s = batch_wait_s
        self._servers: dict[int, ChatServer] = {}
        self.template = None  # the run's prompt template: a prompt's text -> its dataset row
        ChatRenderer(tokenizer, [], chat_template).render([{"role": "user", "content": "Q"}], True, with_tools=False)

    def bind(self, template) -> None:
        self.template = template

    def stop_strings(self, extra=()) -> list[str]:
        return list(dict.fromkeys(extra))

    def _server(self, backend) -> ChatServer:
        if id(backend) not in self._servers:
            server = ChatServer(backend, self.tokenizer, chat_template=self.chat_template,
                                max_tokens=self.max_total_tokens, batch_wait_s=self.batch_wait_s,
                                api_key=secrets.token_urlsafe(24))  # C02: only this run's client holds the key
            self._servers[id(backend)] = server.__enter__()
        return self._servers[id(backend)]

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()

    def _row(self, prompt: str) -> dict:
        """The dataset row a prompt was rendered from (the run's chat template remembers each text's question)."""
        question = (getattr(self.template, "rendered", None) or {}).get(prompt)
        row = self.rows.get(_key(question)) if isinstance(question, list) else None
        if row is None:
            raise ValueError(f"env.verifiers {self.spec}: a prompt that is not one of the environment's rows (the "
                             "run's prompts must be rendered by its chat template from the dataset)")
        return row

    def rollouts(self, backend, prompts, n: int, sampling: SamplingParams, prompt_ids=None, tokenizer=None,
                 rows: list[dict] | None = None) -> list[Rollout]:
        """``n`` rollouts per prompt, prompt-major, each driven by the environment."""
        server = self._server(backend)
        rows = rows if rows is not None else [self._row(p) for p in prompts]
        args = {"temperature": sampling.temperature, "top_p": sampling.top_p,  # the endpoint refuses more
                "max_tokens": min(sampling.max_tokens, self.max_total_tokens)}
        if sampling.stop:  # kept in the answer, as grpolab's sampler keeps it (the rubric reads <answer>...</answer>)
            args.update(stop=list(sampling.stop), include_stop_str_in_output=True)
        if sampling.min_tokens:
            args["min_tokens"] = sampling.min_tokens
        jobs = [(i, rows[i], f"policy@{uuid.uuid4().hex[:16]}", None if sampling.seed is None else sampling.seed + k)
                for k, i in enumerate(i for i in range(len(prompts)) for _ in range(n))]
        with cf.ThreadPoolExecutor(1) as pool:  # a fresh event loop, whatever the caller runs in
            states = pool.submit(asyncio.run, self._run_all(server, [job[1:] for job in jobs], args)).result()
        return [self._rollout(prompts[i], i, server.exchanges(key, pop=True), state, error)
                for (i, _, key, _), (state, error) in zip(jobs, states)]

    async def _run_all(self, server: ChatServer, jobs, args) -> list[tuple[Any, str | None]]:
        from openai import AsyncOpenAI
        from verifiers.legacy.clients import OpenAIChatCompletionsClient

        client = OpenAIChatCompletionsClient(AsyncOpenAI(base_url=server.url, api_key=server.api_key, max_retries=0))

        async def one(row, key, seed):
            sampling_args = dict(args, **({"seed": seed} if seed is not None else {}))
            try:
                state = await asyncio.wait_for(self._scored(row, client, key, sampling_args), self.timeout_s)
                return state, None
            except asyncio.TimeoutError:
                return None, f"timed out after {self.timeout_s}s"
            except Exception as exc:  # noqa: BLE001 - an environment's failure costs its rollout
                return None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"

        try:
            return await asyncio.gather(*(one(*job) for job in jobs))
        finally:
            await client.client.close()

    async def _scored(self, row, client, key, sampling_args):
        state = await self.vf_env.rollout(row, client, key, sampling_args)
        if state.get("error") is not None:
            raise RuntimeError(f"the environment's rollout failed: {_why(state['error'])}")
        if not self.vf_env.rubric.has_group_rewards:  # a group rubric scores the group later, from the messages
            state["grpolab_rubric_errors"] = await score_counting_errors(self.vf_env.rubric, state)
        return state

    def _rollout(self, prompt: str, index: int, exchanges, state, error: str | None) -> Rollout:
        eos = self.tokenizer.eos_token_id
        if error is not None or not exchanges:
            why = error or "the environment made no model call"
            print(f"grpolab: env.verifiers {self.spec}: rollout failed ({why}); it scores 0 and trains nothing",
                  file=sys.stderr)
            ids = exchanges[0].prompt_ids if exchanges else \
                self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            return Rollout(prompt, "", list(ids), [eos], [0.0], "length", index, loss_mask=[False],
                           info={"env_errors": 1, "vf_score": {"reward": 0.0}}, model_response="", messages=[])
        last = exchanges[-1]
        full = last.prompt_ids + last.completion_ids
        start = len(exchanges[0].prompt_ids)
        mask, logprobs, unchained, texts = [False] * (len(full) - start), [0.0] * (len(full) - start), 0, []
        for ex in exchanges:
            end = len(ex.prompt_ids) + len(ex.completion_ids)
            if full[:end] != ex.prompt_ids + ex.completion_ids or len(ex.prompt_ids) < start:
                unchained += 1
                continue
            for k, lp in enumerate(ex.logprobs):
                mask[len(ex.prompt_ids) - start + k], logprobs[len(ex.prompt_ids) - start + k] = True, lp
            texts.append(ex.text)
        response_ids = full[start:]
        finish = {"length": "length", "stop": "eos", "tool_calls": "eos"}.get(last.finish_reason, "eos")
        if len(response_ids) > self.max_total_tokens:
            response_ids, mask, logprobs = (x[: self.max_total_tokens] for x in (response_ids, mask, logprobs))
            finish = "length"
        info = {"turns": len(exchanges), "unchained_turns": unchained, "env_errors": 0,
                "template_mismatches": sum(not e.exact for e in exchanges),
                "model_tokens": sum(mask), "observation_tokens": len(mask) - sum(mask)}
        if state.get("reward") is not None:  # scored on the live state (not for a group rubric)
            info["vf_score"] = {"reward": float(state["reward"]), **{k: float(v) for k, v in
                                                                     (state.get("metrics") or {}).items()}}
        if state.get("grpolab_rubric_errors"):  # V04: counted as a reward error by VfRubric, not a silent 0
            info["vf_score_error"] = state["grpolab_rubric_errors"][0]
        messages = json.loads(json.dumps(_plain(state.get("completion") or []), default=str))
        return Rollout(prompt, self.tokenizer.decode(response_ids, skip_special_tokens=True), list(full[:start]),
                       list(response_ids), logprobs, finish, index, loss_mask=mask, info=info,
                       model_response="\n".join(texts), messages=messages)


def _why(err) -> str:
    """An environment's error as one line: its type and text, then its cause's (verifiers' ``ModelError``
    has no text of its own: C13's lost rollouts read "rollout failed:" and nothing more)."""
    if not isinstance(err, BaseException):
        return str(err)
    parts = []
    while err is not None and len(parts) < 3:
        parts.append(f"{type(err).__name__}: {' '.join(str(err).split())}".rstrip(": "))
        err = err.__cause__ or err.__context__
    return " <- ".join(parts)


def _key(messages: list[dict]) -> str:
    return json.dumps([[m.get("role"), m.get("content")] for m in messages])


def _plain(value):
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
