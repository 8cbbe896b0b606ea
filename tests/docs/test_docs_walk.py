"""The docs walked as a reader walks them (issues 27 and 33): README.md, then every page of docs/ in
the order of mkdocs.yml's nav.

The pages are parsed at test time, so an edit that breaks a command breaks a test here:

- every command line of their ```bash blocks is either run (``RUN``: in reading order, each distinct
  command once however many pages print it, in a scratch directory holding a copy of ``configs/``;
  ``python -m grpolab`` stands for ``.venv/bin/grpolab`` and ``python -m torch.distributed.run``
  for ``torchrun``; only the small step counts that turn minutes into seconds are appended) or named
  in ``NOT_RUN`` with the reason. A command in neither list fails ``test_every_command_is_run_or_has_a_reason``:
  none is left out silently;
- every ``grpolab COMMAND`` they name is a command, and every ``--flag`` they give it is in its
  ``--help`` or, for a command that takes ``--field value`` (the training commands, ``plan``), a
  field of its config class — the lines not run included;
- every repository path they name (``configs/...``, ``benchmarks/...``, ...), every relative link
  and image (with its ``#anchor``), and every ``grpolab.x.y`` name in their code exists;
- every page of docs/ is in the nav and every page of the nav exists.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from tests.docs.walk import (
    DOCS,
    README,
    ROOT,
    bash_commands,
    chains,
    code_spans,
    command_flags,
    dotted_names,
    heading_anchors,
    links,
    named_commands,
    nav_pages,
    pages,
    repository_paths,
    run_commands,
)

# Small step counts appended to a command whose run takes minutes (later values win).
SFT_SMALL = ["--n-sft-steps", "2", "--eval-examples", "4", "--task-train-size", "64"]
GRPO_SMALL = ["--n-grpo-steps", "2", "--eval-examples", "4"]
RESUME_SMALL = ["--n-grpo-steps", "3", "--eval-examples", "4"]  # one step past the shortened run: the resume trains
EVAL_SMALL = ["--n", "10"]

# CS336's commands (docs/guides/cs336.md) on the tiny CS336 layout (walk.make_data_roots): the CPU and
# the HF sampler for the GPUs and vLLM of the configs, tiny batches and short responses.
CS336_CPU = ["--device", "cpu", "--dtype", "float32", "--rollout-backend", "hf", "--vllm-device", "null",
             "--eval-examples", "4", "--sampling-max-tokens", "16"]
CS336_SMALL = {
    "eval": ["--backend", "hf", "--n", "4", "--max-tokens", "16", "--no-entropy"],
    "sft": CS336_CPU + ["--n-sft-steps", "2", "--train-batch-size", "2", "--gradient-accumulation-steps", "1"],
    "ei": CS336_CPU + ["--n-ei-steps", "1", "--ei-batch-size", "2", "--group-size", "2", "--train-batch-size", "2",
                       "--gradient-accumulation-steps", "1"],
    "grpo": CS336_CPU + ["--n-grpo-steps", "2", "--rollout-batch-size", "4", "--group-size", "2",
                         "--train-batch-size", "4", "--gradient-accumulation-steps", "2"],
}

# Commands run, by the start of their argv (first match wins, after NOT_RUN): the small-step overrides.
RUN = [((".venv/bin/grpolab", "eval", "--model", "/data/a5-alignment/"), CS336_SMALL["eval"]),
       *(((".venv/bin/grpolab", command, "--config", "configs/cs336/"), small)
         for command, small in CS336_SMALL.items() if command != "eval"),
       ((".venv/bin/grpolab", "sft"), SFT_SMALL), ((".venv/bin/grpolab", "grpo", "--resume"), RESUME_SMALL),
       ((".venv/bin/grpolab", "grpo"), GRPO_SMALL), ((".venv/bin/grpolab", "eval"), EVAL_SMALL),
       ((".venv/bin/grpolab", "view"), []), ((".venv/bin/grpolab", "config"), []),
       (("torchrun", "--nproc_per_node", "2", "-m", "grpolab", "grpo"), GRPO_SMALL),
       ((".venv/bin/grpolab", "serve"), []), (("curl",), []), (("kill", "%1"), [])]  # a server: walk._server_line
# Commands not run here, by the start of their argv (a last word ending in / or = is a prefix of
# the word): the reason.
REAL_MODEL = ("the real model (SmolLM2-135M-Instruct, `make real-model`): minutes of CPU even shortened; "
              "its flags are checked by test_flags_exist")
NOT_RUN = [
    (("make", "demo"), "the full demo, 3-4 minutes (and make installs .venv); tests/cli/test_demo_cli.py runs it "
                       "shortened, tests/experiments/test_demo_tools.py the tool demo"),
    (("make", "test-all"), "the test suites themselves"),
    (("grpolab", "view"), "reads the demo's run directories (and --serve runs until Ctrl-C); the quick start's "
                          ".venv/bin/grpolab view is run, tests/viewer/test_viewer.py and tests/browser run it "
                          "on real runs"),
    (("torchrun", "--nproc_per_node", "8"), "8 GPUs (nccl) and Qwen2.5-Math-1.5B's weights on disk"),
    (("torchrun", "--nnodes", "2"), "two machines and the reader's own my.yaml"),
    (("torchrun", "--nproc_per_node", "2", "-m", "grpolab", "grpo", "--config", "configs/grpo_tiny.yaml",
      "--distributed", "fsdp2", "--rollout-backend", "vllm"), "vLLM (.venv-vllm): tests/vllm/test_scale_vllm.py "
                                                              "runs this set-up"),
    (("grpolab", "plan", "--config", "configs/scale/"), "prints the plans quoted below it; "
                                                       "tests/scale/test_scale_recipes.py runs them"),
    (("grpolab", "plan", "--config", "configs/grpo_tiny.yaml"), "tests/training/test_memory_plan.py plans the "
                                                                "tiny model"),
    ((".venv/bin/grpolab", "eval", "--model", "runs/rg_arith/"), "needs the rg_arith run above trained in full; "
                                                                 "tests/data/test_gym_tasks.py evaluates rg tasks"),
    ((".venv/bin/grpolab", "grpo", "--task", "rg:gsm_symbolic", "--model", "~/.cache/grpolab/"), REAL_MODEL),
    ((".venv/bin/grpolab", "grpo", "--reward"), "needs runs/rm/final from grpolab rm (not run here); tests/rewards/"
                                                "test_reward_model.py runs GRPO and PPO on a reward model"),
    ((".venv/bin/grpolab", "rm"), "minutes of CPU (the reader's own pairs.jsonl for the second); "
                                  "tests/rewards/test_reward_model.py and tests/experiments/test_rm_chain.py run "
                                  "grpolab rm shortened, with --resume"),
    (("grpolab", "demo", "--run-dir", "runs/demo"), "the full demo, 3-4 minutes; tests/cli/test_demo_cli.py runs it "
                                                    "shortened"),
    (("grpolab", "distill", "--config", "configs/distill_tiny.yaml"), "needs runs/demo from the full demo; "
                                                                     "tests/algorithms/test_distill.py and "
                                                                     "tests/training/test_run.py run grpolab distill"),
    (("HEAD=",), "the SLURM recipe: a cluster (tests/scale runs a two-node job on one machine)"),
    (("export", "HEAD"), "the SLURM recipe: a cluster"),
    (("srun",), "the SLURM recipe: a cluster"),
    (("grpolab", "grpo", "--config", "my.yaml"), "the reader's own my.yaml; its flags are checked by test_flags_exist"),
    (("OMP_NUM_THREADS=1", ".venv/bin/grpolab", "grpo", "--config", "configs/real/"), REAL_MODEL),
    (("OMP_NUM_THREADS=2", ".venv/bin/grpolab", "sft", "--config", "configs/real/"), REAL_MODEL),
    (("OMP_NUM_THREADS=2", ".venv/bin/grpolab", "grpo", "--config", "configs/real/"), REAL_MODEL),
    (("OMP_NUM_THREADS=2", ".venv/bin/grpolab", "grpo", "--config", "configs/envs/"), REAL_MODEL),
    (("OMP_NUM_THREADS=2", ".venv/bin/grpolab", "eval"), REAL_MODEL),
    (("python3", "-m", "venv", ".venv"), "the GPU install: a fresh .venv on a CUDA machine (here .venv is the CPU "
                                         "one make set up)"),
    ((".venv/bin/pip", "install"), "the GPU install (vLLM for CUDA, from PyPI); the CPU's vLLM is make test-vllm's "
                                   ".venv-vllm"),
    (("bash", "benchmarks/gpu_check.sh"), "needs a CUDA GPU (and minutes); without one it prints one line and runs "
                                          "nothing"),
    (("hf", "download"), "downloads 3 GB of weights from the Hugging Face Hub (no network here); the walk runs the "
                         "CS336 commands on a tiny model at the path it names (walk.make_data_roots)"),
    (("PYTHONPATH=../assignment5-alignment",), "the official grader is CS336's starter code, not in this repository; "
                                               "tests/rewards/test_rewards.py loads a pkg.mod:fn reward"),
    (("SP=",), REAL_MODEL),  # the evaluation loop of the same page
    (("for",), REAL_MODEL),
    (("OMP_NUM_THREADS=1", ".venv/bin/grpolab", "eval"), REAL_MODEL),
    (("done",), REAL_MODEL),
]


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


@cache
def _texts() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in pages()}


# ---------------------------------------------------------------- the pages and the nav


def test_every_page_is_in_the_nav_and_every_nav_page_exists():
    listed = nav_pages()
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert "index.md" in listed and len(listed) >= 20, f"mkdocs.yml's nav was not read: {listed}"
    assert not sorted(set(on_disk) - set(listed)), "pages of docs/ missing from mkdocs.yml's nav"
    generated = {"reference/config.md", "reference/cli.md"}  # written by their generator, not by hand
    missing = sorted(set(listed) - set(on_disk) - generated)
    assert not missing, f"mkdocs.yml's nav names pages docs/ does not have: {missing}"


# ---------------------------------------------------------------- the commands


def _runnable() -> list[tuple[list[str], list[str], str]]:
    """(argv, small-step overrides, page) of the commands run, in reading order, each distinct one once."""
    seen: dict[tuple[str, ...], str] = {}
    for page, text in _texts().items():
        for argv in bash_commands(text):
            if classify(argv)[0] == "run":
                seen.setdefault(tuple(argv), page)
    return [(list(argv), classify(list(argv))[1], page) for argv, page in seen.items()]


def test_every_command_is_run_or_has_a_reason():
    commands = [(page, argv) for page, text in _texts().items() for argv in bash_commands(text)]
    assert len(commands) >= 20, "the pages' ```bash blocks were not found"
    unclassified = [f"{page}: {' '.join(argv)}" for page, argv in commands if classify(argv)[0] == "unclassified"]
    assert not unclassified, ("commands neither run by test_commands_work_as_printed nor listed in NOT_RUN "
                              f"with a reason: {unclassified}")
    assert len(_runnable()) >= 10, "the pages' quick commands were not found"


def test_chains_keep_a_run_with_the_commands_that_read_it():
    """The split of test_commands_work_as_printed: a --resume, --model or view of an earlier run runs
    after that run, in its scratch; a server's curl and kill go with it; unrelated runs are apart."""
    sft = [".venv/bin/grpolab", "sft", "--config", "configs/sft_tiny.yaml"]
    grpo = [".venv/bin/grpolab", "grpo", "--config", "configs/grpo_tiny.yaml", "--model", "runs/sft_tiny/final"]
    resume = [".venv/bin/grpolab", "grpo", "--resume", "runs/grpo_tiny"]
    other = [".venv/bin/grpolab", "grpo", "--config", "configs/grpo_tiny.yaml", "--run-dir", "runs/other"]
    serve, curl, kill = [".venv/bin/grpolab", "serve", "embedded:tiny", "&"], ["curl", "-sf", "URL"], ["kill", "%1"]
    commands = [(argv, [], "page.md") for argv in (sft, other, serve, grpo, curl, resume, kill)]
    assert [[argv for argv, _, _ in chain] for chain in chains(commands)] == [[sft, grpo, resume], [other],
                                                                             [serve, curl, kill]]


# Each chain of commands (walk.chains: those sharing a run directory) is one test, so that xdist's workers
# share the walk (one test of ~140 s before).
CHAINS = chains(_runnable())


def _chain_id(chain) -> str:
    argv, _, page = chain[0]
    return f"{Path(page).stem}:{Path(argv[argv.index('--config') + 1]).stem if '--config' in argv else argv[1]}"


# Chains of 15 s or more besides the README's own (torchrun's two ranks, two CS336 runs and a view, a
# reasoning-gym run): make test-slow (test-all), not make test.
SLOW_CHAINS = {"scaling:grpo_tiny", "cs336:grpo_learning_rate", "reasoning-gym:grpo"}
assert SLOW_CHAINS <= {_chain_id(chain) for chain in CHAINS}, "a slow chain's name no longer names a chain"


@pytest.mark.parametrize("chain", [pytest.param(chain, marks=[pytest.mark.slow] * (_chain_id(chain) in SLOW_CHAINS))
                                   for chain in CHAINS], ids=[_chain_id(chain) for chain in CHAINS])
def test_commands_work_as_printed(chain, tmp_path):
    """The pages' commands in reading order, each distinct one once, as printed plus only the small
    step counts: exit code 0, and the run directory, final model, metrics or files it prints exist.
    Every failing command of the chain is reported, not only the first."""
    ran, failures = run_commands(chain, tmp_path)
    assert not failures, f"{len(failures)} of {ran} commands of the docs failed:\n" + "\n".join(failures)


# ---------------------------------------------------------------- commands and flags


def test_every_named_command_exists():
    import typer

    from grpolab.cli import app

    commands = set(typer.main.get_command(app).commands)
    named = named_commands(_texts())
    assert {"grpo", "sft", "eval", "compare", "demo", "view", "plan"} <= set(named), named
    unknown = {name: where for name, where in named.items() if name not in commands}
    assert not unknown, f"the docs name grpolab commands that do not exist (command: pages): {unknown}"


def _help_flags(command: str) -> set[str]:
    import subprocess
    import sys

    from tests.docs.walk import ENV, FLAG

    proc = subprocess.run([sys.executable, "-m", "grpolab", command, "--help"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(FLAG.findall(proc.stdout))


def _field_flags(command: str) -> set[str]:
    """``--field value`` flags: the fields of a training command's config (``plan``, ``config``: of
    every method)."""
    from grpolab.algorithms import METHODS

    methods = ([METHODS[command]] if command in METHODS
               else list(METHODS.values()) if command in ("plan", "config") else [])
    return {"--" + f.replace("_", "-") for method in methods for f in method.load()[0].model_fields}


@pytest.mark.parametrize("command", sorted(named_commands(_texts())))
def test_flags_exist(command):
    flags = command_flags(_texts(), command)
    if command in ("grpo", "sft", "eval", "compare", "demo", "view", "plan"):
        assert flags, f"the docs name no flag of grpolab {command}: the parser lost them"
    missing = sorted(flags - _help_flags(command) - _field_flags(command))
    assert not missing, f"the docs give `grpolab {command}` flags that are no option and no config field: {missing}"


# ---------------------------------------------------------------- paths, links and names


def test_repository_paths_exist():
    """configs/, benchmarks/, scripts/, docs/, grpolab/, tests/ paths in code and commands."""
    named = {p: page for page, text in _texts().items() for p in repository_paths(text)}
    assert any(p.startswith("configs/") for p in named)
    missing = sorted(f"{page}: {p}" for p, page in named.items() if not any(ROOT.glob(p.rstrip(".").rstrip("/"))))
    assert not missing, f"the docs name paths the repository does not have: {missing}"


def test_links_and_images_resolve():
    """Every relative link and image of every page: the file exists, and so does its #anchor (a
    heading of that page, as mkdocs spells its anchors). mkdocs build --strict checks the pages of
    docs/ too; this test also covers README.md, which the site does not build."""
    broken = []
    for page, text in _texts().items():
        base = (ROOT / page).parent
        for target in links(text):
            path, _, anchor = target.partition("#")
            file = (base / path).resolve() if path else ROOT / page
            if not file.exists():
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text(encoding="utf-8")):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, f"broken links: {broken}"


def test_grpolab_names_exist():
    """``grpolab.x.y`` in code (a module, or a name in one): an old module path fails here."""
    import importlib

    missing = []
    for page, text in _texts().items():
        for name in sorted(dotted_names(text)):
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                except ModuleNotFoundError as exc:
                    if exc.name and not exc.name.startswith("grpolab") and i == len(parts):
                        break  # the module exists and needs an optional package (vllm) this venv lacks
                    continue
                except ImportError:
                    continue
                try:
                    for attr in parts[i:]:
                        obj = getattr(obj, attr)
                except AttributeError:
                    missing.append(f"{page}: {name}")
                break
            else:
                missing.append(f"{page}: {name}")
    assert not missing, f"the docs name grpolab modules or names that do not exist: {missing}"


def test_code_spans_are_read():
    """The parser sees inline code that wraps a line (Markdown allows it) and skips fenced blocks."""
    spans = code_spans("a `grpolab eval --model\nDIR` b\n```bash\nx `y` z\n```\n`c`")
    assert spans == ["grpolab eval --model DIR", "c"]
    assert README.exists()
