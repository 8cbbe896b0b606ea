"""The run's environment for ``env: {verifiers: NAME, args: {...}}`` (``build_vf_env``): a
``verifiers`` environment's dataset is the task (``grpolab.data.tasks.vf.VerifiersTask``) and its
rubric the reward (``grpolab.rewards.vf_rubric``); what runs between turns is built here:

- ``SingleTurnEnv``: nothing (None): the run samples one response per prompt;
- ``ToolEnv``: its Python tools by native function calling (``ChatToolEnv``, ``chat_tools.py``);
- a ``verifiers.v1`` taskset with toolsets: the same loop, its tools made per rollout
  (``vf_v1_tools.V1Tools``);
- any other ``MultiTurnEnv``: ``VerifiersDriver`` (``vf_rollouts.py``), the environment driving each
  rollout against grpolab's chat endpoint.
"""

from __future__ import annotations

from typing import Any

from ..rewards.vf_rubric import environment_kind, load_vf_environment, tool_functions, vf_source
from ..rewards.vf_v1 import V1Taskset
from .chat_rollouts import ChatToolEnv
from .chat_tools import CHAT_TEMPLATES, ChatRenderer
from .vf_rollouts import VerifiersDriver, vf_tool_schemas
from .vf_v1_tools import V1Tools

VERIFIERS_KEYS = ("verifiers", "args", "load_timeout_s")
# the env keys each kind takes beside VERIFIERS_KEYS (a tool's limits; the endpoint's template)
KIND_KEYS = {"single_turn": (), "tool": ("chat_template", "max_turns", "max_total_tokens", "max_observation_chars",
                                         "max_observation_tokens", "tool_timeout_s", "tool_format"),
             "multi_turn": ("chat_template", "max_total_tokens", "rollout_timeout_s")}


def build_vf_env(verifiers: str, args: dict[str, Any] | None = None, *, tokenizer=None, load_timeout_s=None,
                 **env_options):
    """The run's environment of ``env: {verifiers: ...}`` (a config's ``env`` keys, as ``build_env``
    takes them): None, a ``ChatToolEnv`` or a ``VerifiersDriver`` (see the module docstring). A key
    that does not apply to the environment's kind is one line."""
    env = load_vf_environment(vf_source(verifiers), args or {})
    kind = environment_kind(env)
    wrong = sorted(set(env_options) - set(KIND_KEYS[kind]))
    if wrong:
        takes = ", ".join(KIND_KEYS[kind]) or "no other key"
        raise ValueError(f"env key(s) {', '.join(wrong)} do not apply to the {kind.replace('_', '-')} verifiers "
                         f"environment {verifiers!r} ({type(env).__name__}; it takes {takes})")
    if kind == "single_turn":
        return None
    if tokenizer is None:
        raise ValueError(f"verifiers environment {verifiers!r}: its turns are rendered by the model's chat template; "
                         "a tokenizer is needed")
    template = env_options.get("chat_template")
    template = CHAT_TEMPLATES.get(template, template)
    max_total_tokens = int(env_options.get("max_total_tokens", 256))
    if kind == "tool":
        if env_options.get("tool_format", "chat_template") != "chat_template":
            raise ValueError("a verifiers ToolEnv's tools are called in the model's own format: tool_format: "
                             "chat_template (the default for it)")
        per_rollout = V1Tools(env) if isinstance(env, V1Taskset) else None
        renderer = ChatRenderer(tokenizer, per_rollout.schemas if per_rollout else vf_tool_schemas(env), template)
        renderer.check()
        turns = env_options.get("max_turns", env.max_turns if getattr(env, "max_turns", 0) > 0 else 4)
        return ChatToolEnv(renderer, tool_functions(env), per_rollout=per_rollout, max_turns=turns,
                           max_total_tokens=max_total_tokens,
                           max_observation_chars=env_options.get("max_observation_chars", 2000),
                           max_observation_tokens=env_options.get("max_observation_tokens"),
                           tool_timeout_s=env_options.get("tool_timeout_s", 10.0))
    return VerifiersDriver(verifiers, env, tokenizer, max_total_tokens=max_total_tokens, chat_template=template,
                           timeout_s=float(env_options.get("rollout_timeout_s", 120.0)))
