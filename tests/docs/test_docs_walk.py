"""The README walked as a reader walks it (issue 27).

README.md is parsed at test time, so a README edit that breaks a command breaks a test here:

- every command line of its ```bash blocks is either run (``RUN``: in the README's order, in a
  scratch directory holding a copy of ``configs/``; ``python -m grpolab`` stands for
  ``.venv/bin/grpolab`` and ``python -m torch.distributed.run`` for ``torchrun``; only the small
  step counts that turn minutes into seconds are appended) or named in ``NOT_RUN`` with the
  reason. A command in neither list fails ``test_every_readme_command_is_run_or_has_a_reason``:
  none is left out silently;
- every ``--flag`` the README gives ``grpolab eval``, ``compare`` or ``demo`` is in that command's
  ``--help``, and every ``--flag`` of a ``grpolab grpo``/``sft`` line is an option of the command
  or a field of its config class (``--field value``), the lines not run included;
- every repository path the README names (``configs/...``, ``benchmarks/...``, ...) exists.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COLUMNS": "250"}
TIMEOUT = 240  # a hang guard only

# Small step counts appended to a command whose run takes minutes (later overrides win).
SFT_SMALL = ["--n-sft-steps", "2", "--eval-examples", "4", "--task-train-size", "64"]
GRPO_SMALL = ["--n-grpo-steps", "2", "--eval-examples", "4"]
RESUME_SMALL = ["--n-grpo-steps", "3", "--eval-examples", "4"]  # one step past the shortened run: the resume trains

# Commands run, by the start of their argv (first match wins, after NOT_RUN): the small-step overrides.
RUN = [
    ((".venv/bin/grpolab", "sft"), SFT_SMALL),
    ((".venv/bin/grpolab", "grpo", "--resume"), RESUME_SMALL),
    ((".venv/bin/grpolab", "grpo"), GRPO_SMALL),
    (("torchrun", "--nproc_per_node", "2", "-m", "grpolab", "grpo"), GRPO_SMALL),
]
# Commands not run here, by the start of their argv (a last word ending in / or = is a prefix of
# the word): the reason.
REAL_MODEL = ("the real model (SmolLM2-135M-Instruct, `make real-model`): minutes of CPU even shortened; "
              "its flags are checked by test_readme_flags_exist / test_readme_training_flags_exist")
NOT_RUN = [
    (
        ("make", "demo"),
        "the full demo, 3-4 minutes (and make installs .venv); tests/cli/test_demo_cli.py runs it shortened",
    ),
    (("make", "test-all"), "the test suites themselves"),
    (
        ("grpolab", "view"),
        "reads the demo's run directory (and --serve runs until Ctrl-C); tests/viewer/test_viewer.py and "
        "tests/browser run it on real runs",
    ),
    (("torchrun", "--nproc_per_node", "8"), "8 GPUs (nccl) and Qwen2.5-Math-1.5B's weights on disk"),
    (("torchrun", "--nnodes", "2"), "two machines and the reader's own my.yaml"),
    (
        (
            "torchrun",
            "--nproc_per_node",
            "2",
            "-m",
            "grpolab",
            "grpo",
            "--config",
            "configs/grpo_tiny.yaml",
            "--distributed",
            "fsdp2",
            "--rollout-backend",
            "vllm",
        ),
        "vLLM (.venv-vllm): tests/vllm/test_scale_vllm.py runs this set-up",
    ),
    (
        ("grpolab", "plan", "--config", "configs/scale/"),
        "prints the plans quoted below it; tests/scale/test_scale_recipes.py runs them",
    ),
    (
        ("grpolab", "plan", "--config", "configs/grpo_tiny.yaml"),
        "tests/training/test_memory_plan.py plans the tiny model",
    ),
    (
        (".venv/bin/grpolab", "eval", "--model", "runs/rg_arith/"),
        "needs the rg_arith run above; tests/data/test_gym_tasks.py evaluates rg tasks",
    ),
    ((".venv/bin/grpolab", "grpo", "--task", "rg:gsm_symbolic", "--model", "~/.cache/grpolab/"), REAL_MODEL),
    (
        (".venv/bin/grpolab", "grpo", "--reward"),
        "needs runs/rm/final from grpolab rm (not run here); "
        "tests/rewards/test_reward_model.py runs GRPO and PPO on a reward model",
    ),
    (
        (".venv/bin/grpolab", "rm"),
        "minutes of CPU (the reader's own pairs.jsonl for the second); tests/rewards/test_reward_model.py "
        "and tests/experiments/test_rm_chain.py run grpolab rm shortened, with --resume",
    ),
    (("HEAD=",), "the SLURM recipe: a cluster (tests/scale runs a two-node job on one machine)"),
    (("export", "HEAD"), "the SLURM recipe: a cluster"),
    (("srun",), "the SLURM recipe: a cluster"),
    (
        ("grpolab", "grpo", "--config", "my.yaml"),
        "the reader's own my.yaml; its flags are checked by test_readme_training_flags_exist",
    ),
    (("OMP_NUM_THREADS=1", ".venv/bin/grpolab", "grpo", "--config", "configs/real/"), REAL_MODEL),
    (("SP=",), REAL_MODEL),  # the evaluation loop of the same section
    (("for",), REAL_MODEL),
    (("OMP_NUM_THREADS=1", ".venv/bin/grpolab", "eval"), REAL_MODEL),
    (("done",), REAL_MODEL),
]

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
REPO_PATH = re.compile(r"(?<![\w./-])((?:configs|benchmarks|scripts|docs|grpolab|tests)/[\w./*-]*)")


# ---------------------------------------------------------------- reading the README


def bash_commands(text: str) -> list[list[str]]:
    """Every command line of the ```bash blocks, in order, as argv (continuations joined, comments dropped)."""
    commands = []
    for block in re.findall(r"^[ \t]*```bash[ \t]*\n(.*?)^[ \t]*```", text, re.M | re.S):
        line = ""
        for raw in block.splitlines():
            if raw.rstrip().endswith("\\"):
                line += raw.rstrip()[:-1] + " "
                continue
            argv = shlex.split(line + raw, comments=True)
            line = ""
            if argv:
                commands.append(argv)
    return commands


def _starts(argv: list[str], prefix: tuple[str, ...]) -> bool:
    head, last = prefix[:-1], prefix[-1]
    if len(argv) < len(prefix) or tuple(argv[:len(head)]) != head:
        return False
    word = argv[len(head)]
    return word == last or (last.endswith(("/", "=")) and word.startswith(last))


def classify(argv: list[str]) -> tuple[str, object]:
    """("not run", reason), ("run", small-step overrides) or ("unclassified", None): NOT_RUN's
    entries are the exceptions (a real model, vLLM) to RUN's broad prefixes, so they are checked first."""
    for prefix, reason in NOT_RUN:
        if _starts(argv, prefix):
            return "not run", reason
    for prefix, small in RUN:
        if _starts(argv, prefix):
            return "run", small
    return "unclassified", None


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def flags_after(words: str, command: str) -> list[str]:
    """The --flags after ``grpolab COMMAND`` in a piece of text (none when it does not name it)."""
    match = re.search(rf"grpolab {command}\b", words)
    return FLAG.findall(words[match.end():]) if match else []


def readme_flags(text: str, command: str) -> set[str]:
    """Every --flag the README gives ``grpolab COMMAND``: on ```bash command lines, in inline code
    naming the command (``make demo ARGS="..."`` is ``grpolab demo ...``), and in the code of the
    command's own row of the commands table (the row whose first cell is `grpolab COMMAND ...`)."""
    flags = set()
    for argv in bash_commands(text):
        flags.update(flags_after(" ".join(argv), command))
    for span in code_spans(text):
        if command == "demo" and span.startswith("make demo ARGS="):
            span = "grpolab demo " + span[len("make demo ARGS="):]
        flags.update(flags_after(span, command))
    for row in re.findall(rf"^\| `grpolab {command}\b.*$", text, re.M):
        flags.update(f for span in code_spans(row) for f in FLAG.findall(span))
    return flags


# ---------------------------------------------------------------- the commands


def test_every_readme_command_is_run_or_has_a_reason():
    commands = bash_commands(README.read_text(encoding="utf-8"))
    assert len(commands) >= 10, "the README's ```bash blocks were not found"
    unclassified = [shlex.join(argv) for argv in commands if classify(argv)[0] == "unclassified"]
    assert not unclassified, ("README commands neither run by test_readme_quick_commands_work_as_printed nor listed "
                              f"in NOT_RUN with a reason: {unclassified}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_run(argv: list[str], small: list[str], cwd: Path) -> tuple[list[str], dict, list[str]]:
    """The README's command as this test runs it -> (argv, environment, what was appended): its
    VAR=value words go to the environment, ``.venv/bin/grpolab`` -> ``python -m grpolab``,
    ``torchrun`` -> ``python -m torch.distributed.run`` (on a free port), the small step counts
    appended. A run that checkpoints (``checkpoint_every`` > 0 in its config or on its line)
    checkpoints every step of the shortened run, so a later ``--resume`` finds a checkpoint exactly
    where the full-length run would; one that does not checkpoint still does not."""
    env = dict(ENV, PET_MASTER_PORT=str(_free_port()))
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        key, value = argv[0].split("=", 1)
        env[key] = value
        argv = argv[1:]
    if argv[0] == ".venv/bin/grpolab":
        argv = [sys.executable, "-m", "grpolab", *argv[1:]]
    elif argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    extra = list(small)
    if "--config" in argv and "--resume" not in argv:
        config = yaml.safe_load((cwd / argv[argv.index("--config") + 1]).read_text(encoding="utf-8")) or {}
        every = (argv[argv.index("--checkpoint-every") + 1] if "--checkpoint-every" in argv
                 else config.get("checkpoint_every") or 0)
        if int(every) > 0:
            extra += ["--checkpoint-every", "1"]
    return argv + extra, env, extra


def test_readme_quick_commands_work_as_printed(tmp_path):
    """The README's quick commands in its order, each as printed plus only the small step counts:
    exit code 0, and the run directory, final model and metrics it prints exist. Every failing
    command is reported, not only the first."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    failures, ran = [], 0
    for argv in bash_commands(README.read_text(encoding="utf-8")):
        kind, small = classify(argv)
        if kind != "run":
            continue
        cmd, env, extra = _as_run(argv, small, tmp_path)
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                              stdin=subprocess.DEVNULL)
        ran += 1
        printed = f"{shlex.join(argv)}   [run with {shlex.join(extra)} appended]"
        if proc.returncode != 0:
            errors = ([ln for ln in proc.stderr.splitlines() if ln.startswith("grpolab: ")]
                      or proc.stderr.strip().splitlines()[-3:])
            failures.append(f"{printed}\n    exit {proc.returncode}: {' | '.join(dict.fromkeys(errors))}")
            continue
        paths = re.findall(r"^(?:run directory|final model|metrics):\s+(\S+)$", proc.stdout, re.M)
        missing = [p for p in paths if not (tmp_path / p).exists()]
        if not paths or missing:
            failures.append(f"{printed}\n    printed paths {paths}; missing: {missing}")
    assert ran >= 4, "the README's quick commands were not found"
    assert not failures, f"{len(failures)} of {ran} README commands failed:\n" + "\n".join(failures)


# ---------------------------------------------------------------- flags and paths


def _help_flags(command: str) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "grpolab", command, "--help"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    return set(FLAG.findall(proc.stdout))


@pytest.mark.parametrize("command", ["eval", "compare", "demo"])
def test_readme_flags_exist(command):
    flags = readme_flags(README.read_text(encoding="utf-8"), command)
    assert flags, f"the README names no flag of grpolab {command}: the parser lost them"
    missing = sorted(flags - _help_flags(command))
    assert not missing, f"README.md gives `grpolab {command}` flags its --help does not have: {missing}"


@pytest.mark.parametrize("command", ["grpo", "sft"])
def test_readme_training_flags_exist(command):
    """``--field value`` on a training command: a config field, or --config/--resume/--overwrite."""
    from grpolab.algorithms.grpo import GRPOConfig
    from grpolab.algorithms.sft import SFTConfig

    config_cls = {"grpo": GRPOConfig, "sft": SFTConfig}[command]
    flags = readme_flags(README.read_text(encoding="utf-8"), command)
    assert flags, f"the README names no flag of grpolab {command}: the parser lost them"
    known = {"--config", "--resume", "--overwrite", "--help"} | {"--" + f.replace("_", "-")
                                                                 for f in config_cls.model_fields}
    missing = sorted(flags - known)
    assert not missing, f"README.md gives `grpolab {command}` flags that are no option and no config field: {missing}"


def test_readme_repository_paths_exist():
    """configs/, benchmarks/, scripts/, docs/, grpolab/, tests/ paths in code, commands and images."""
    text = README.read_text(encoding="utf-8")
    named = {p for span in code_spans(text) if "<" not in span for p in REPO_PATH.findall(span)}  # not patterns
    named |= {p for argv in bash_commands(text) for word in argv for p in REPO_PATH.findall(word)}
    named |= set(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text))
    assert any(p.startswith("configs/") for p in named)
    missing = sorted(p for p in named if not glob.glob(str(ROOT / p.rstrip("."))))
    assert not missing, f"README.md names paths the repository does not have: {missing}"
