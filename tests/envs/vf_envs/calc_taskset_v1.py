"""A multi-turn environment in verifiers' current API (``verifiers.v1``, 0.4): a ``Taskset`` whose tasks
have a ``vf.Toolset`` (``Task.toolsets``) with one ``@vf.tool``, ``calculate`` (``TOOL_PREFIX = None``:
advertised bare, the name the function-calling tests' taught model calls). The tool counts its calls
in the rollout's state (``CalcState.calls``, the toolset's ``self.state``, the trace's ``state``).

``correct`` (weight 1.0): the last assistant message is the answer; ``tool_calls`` (a metric): the
state's count; ``tool_results`` (a metric): how many ``tool`` messages the trace holds.
"""

import verifiers.v1 as vf


class CalcState(vf.State):
    calls: int = 0


class Calculator(vf.Toolset[vf.ToolsetConfig, CalcState]):
    TOOL_PREFIX = None

    @vf.tool
    async def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression such as 12+30."""
        self.state.calls += 1
        a, op, b = next(expression.partition(o) for o in "+-*" if o in expression)
        return str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData, CalcState]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply == task.answer else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(trace.state.calls)

    @vf.metric
    async def tool_results(self, trace: vf.Trace) -> float:
        return float(sum(node.message.role == "tool" for node in trace.nodes))


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for question in ("12+30", "50-8"):
            yield CalcTask(CalcData(prompt=f"What is {question}?", answer="42"), self.config.task)


__all__ = ["CalcTaskset"]
