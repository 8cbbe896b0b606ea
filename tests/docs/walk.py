"""Reading the docs as test_docs_walk.py walks them: the pages in nav order, their ```bash command
lines, inline code, links and headings, and running a command as a page prints it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COLUMNS": "250"}
TIMEOUT = 240  # a hang guard only

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
REPO_PATH = re.compile(r"(?<![\w./-])((?:configs|benchmarks|scripts|docs|grpolab|tests)/[\w./*-]*)")
FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", re.M | re.S)
# ``grpolab COMMAND`` where COMMAND is a word not followed by ':' (``grpolab health: ...`` is output)
COMMAND = re.compile(r"(?:^|(?<=[\s/]))grpolab ([a-z][a-z-]*)\b(?![:-])")
LAYERS = "core|models|rewards|rollout|data|envs|eval|training|algorithms|experiments|viewer|cli"
DOTTED = re.compile(r"\bgrpolab(?:\.[A-Za-z_]\w*)+")
FILE_NAME = re.compile(r"\.(?:py|json|jsonl|yaml|md|png|html|txt)$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


# ---------------------------------------------------------------- the pages


def nav_pages() -> list[str]:
    """The pages of mkdocs.yml's nav, in order (paths under docs/)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    found: list[str] = []

    def walk(node) -> None:
        if isinstance(node, str):
            if node.endswith(".md"):
                found.append(node)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)

    walk(config.get("nav", []))
    return found


def pages() -> list[Path]:
    """README.md, then the pages of the nav that exist, in reading order."""
    return [README] + [DOCS / page for page in nav_pages() if (DOCS / page).exists()]


# ---------------------------------------------------------------- reading a page


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


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def code_spans(text: str) -> list[str]:
    """The inline code of the prose, a span that wraps a line read as one line."""
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+?)`", prose(text)) if "\n\n" not in s]


def links(text: str) -> list[str]:
    """The relative targets of the prose's links and images (not inside code)."""
    outside_code = re.sub(r"`[^`]+?`", "", prose(text))
    return [t for t in LINK.findall(outside_code) if not re.match(r"[a-z]+:", t)]


def heading_anchors(text: str) -> set[str]:
    """The anchors of a page's headings as mkdocs (Python-Markdown's toc) makes them."""
    anchors = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*#*$", prose(text), re.M):
        plain = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\s-]", "", plain.encode("ascii", "ignore").decode()).strip().lower()
        anchors.add(re.sub(r"[-\s]+", "-", slug))
    return anchors


def flags_after(words: str, command: str) -> list[str]:
    """The --flags after ``grpolab COMMAND`` in a piece of text (none when it does not name it)."""
    match = re.search(rf"grpolab {command}\b", words)
    return FLAG.findall(words[match.end():]) if match else []


def command_flags(texts: dict[str, str], command: str) -> set[str]:
    """Every --flag the pages give ``grpolab COMMAND``: on ```bash command lines, in inline code
    naming the command (``make demo ARGS="..."`` is ``grpolab demo ...``), and in the code of the
    command's own row of a commands table (the row whose first cell is `grpolab COMMAND ...`)."""
    flags = set()
    for text in texts.values():
        for argv in bash_commands(text):
            flags.update(flags_after(" ".join(argv), command))
        for span in code_spans(text):
            if command == "demo" and span.startswith("make demo ARGS="):
                span = "grpolab demo " + span[len("make demo ARGS="):].strip("\"'")
            flags.update(flags_after(span, command))
        for row in re.findall(rf"^\| `grpolab {command}\b.*$", text, re.M):
            flags.update(f for span in code_spans(row) for f in FLAG.findall(span))
    return flags


def named_commands(texts: dict[str, str]) -> dict[str, list[str]]:
    """``grpolab COMMAND`` on command lines and in inline code -> the pages naming it."""
    named: dict[str, list[str]] = {}
    for page, text in texts.items():
        pieces = [" ".join(argv) for argv in bash_commands(text)] + code_spans(text)
        for piece in pieces:
            for name in COMMAND.findall(piece):
                named.setdefault(name, [])
                if page not in named[name]:
                    named[name].append(page)
    return named


def repository_paths(text: str) -> set[str]:
    """configs/, benchmarks/, scripts/, docs/, grpolab/, tests/ paths in inline code and commands."""
    named = {p for span in code_spans(text) if "<" not in span for p in REPO_PATH.findall(span)}  # not patterns
    named |= {p for argv in bash_commands(text) for word in argv for p in REPO_PATH.findall(word)}
    return named


def dotted_names(text: str) -> set[str]:
    """``grpolab.x.y`` in inline code, and a span that is a dotted name in a layer (``core.kl``)."""
    names = set()
    for span in code_spans(text):
        names.update(DOTTED.findall(span))
        if re.fullmatch(rf"(?:{LAYERS})(?:\.[A-Za-z_]\w*)+", span) and not FILE_NAME.search(span):
            names.add("grpolab." + span)
    return names


# ---------------------------------------------------------------- running a command as printed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_run(argv: list[str], small: list[str], cwd: Path) -> tuple[list[str], dict, list[str]]:
    """A page's command as the test runs it -> (argv, environment, what was appended): its
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


def printed_paths(stdout: str) -> list[str]:
    """The files a command says it wrote: ``run directory:``, ``final model:``, ``metrics:`` (the
    trainers), ``written: A, B`` (eval), ``wrote A`` (view)."""
    paths = re.findall(r"^(?:run directory|final model|metrics):\s+(\S+)$", stdout, re.M)
    for listed in re.findall(r"^written: (.+)$", stdout, re.M):
        paths += [p.strip() for p in listed.split(",")]
    return paths + re.findall(r"^wrote (\S+)$", stdout, re.M)


# Absolute folders the pages name that the test makes in its scratch directory (``make_data_roots``):
# CS336's data and model layout, read as these relative folders in the commands and in the copy of configs/.
DATA_ROOTS = {"/data/a5-alignment/": "a5-alignment/"}
MATH_PROBLEMS = [("What is 2+3?", "5"), ("What is 7-4?", "3"), ("What is 2*6?", "12"), ("What is 9-9?", "0")]


def make_data_roots(scratch: Path) -> None:
    """CS336's layout at tiny scale under ``scratch/a5-alignment/``: MATH/{train,validation,sft}.jsonl
    (MATH records; sft.jsonl's prompts in the r1_zero template, verbatim, as the handout's) and
    models/Qwen2.5-Math-1.5B, a tiny Llama with a character tokenizer and a chat template (as
    Qwen2.5-Math's tokenizer has one)."""
    import json

    from grpolab.data import load_template
    from tests.helpers.chat_models import chat_model_dir

    root = scratch / "a5-alignment"
    (root / "MATH").mkdir(parents=True)
    records = [{"problem": q, "solution": f"{q[8:-1]} is \\boxed{{{a}}}.", "answer": a} for q, a in MATH_PROBLEMS]
    for name in ("train", "validation"):
        (root / "MATH" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    r1_zero = load_template("r1_zero")
    sft = [{"prompt": r1_zero.format(q), "response": f" {q[8:-1]} is {a}. </think> <answer>{a}</answer>",
            "ground_truth": a} for q, a in MATH_PROBLEMS]
    (root / "MATH" / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft), encoding="utf-8")
    chat_model_dir(root / "models" / "Qwen2.5-Math-1.5B")


def _in_scratch(text: str) -> str:
    for absolute, relative in DATA_ROOTS.items():
        text = text.replace(absolute, relative)
    return text


def _server_line(argv: list[str], small: list[str], page: str, scratch: Path, servers: list) -> list[str]:
    """A server's lines (``grpolab serve``): ``... &`` starts it in the background, ready once it prints
    its ``serving`` line; ``curl`` (with ``-f``: an HTTP error fails) must exit 0; ``kill %1`` sends
    SIGTERM to the last one started, which must exit 0. Returns the failures (none or one)."""
    printed = f"{page}: {shlex.join(argv)}"
    if argv[-1] == "&":
        cmd, env, _ = as_run(argv[:-1], small, scratch)
        proc = subprocess.Popen(cmd, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, stdin=subprocess.DEVNULL)
        line = proc.stdout.readline()  # ``serving URL ...``, or nothing when it exited
        if line.startswith("serving "):
            servers.append(proc)
            return []
        proc.kill()
        _, err = proc.communicate(timeout=TIMEOUT)
        return [f"{printed}\n    printed no serving line: {line.strip()} {' | '.join(err.strip().splitlines()[-1:])}"]
    if argv[0] == "curl":
        proc = subprocess.run(argv, cwd=scratch, capture_output=True, text=True, timeout=TIMEOUT,
                              stdin=subprocess.DEVNULL)
        return [] if proc.returncode == 0 else [f"{printed}\n    exit {proc.returncode}: {proc.stderr.strip()[-300:]}"]
    if not servers:
        return [f"{printed}\n    no server was started before it"]
    proc = servers.pop()
    proc.terminate()
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return [f"{printed}\n    the server did not stop on SIGTERM within 60 s"]
    return [] if proc.returncode == 0 else [f"{printed}\n    the server exited {proc.returncode} on SIGTERM"]


def _strings(value) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def run_paths(argv: list[str]) -> set[str]:
    """The ``runs/...`` paths a command reads or writes: its words, and its config's (``run_dir``, unless
    the line gives ``--run-dir``; a ``model``, ``teacher``, corpus... under runs/)."""
    paths = {w.rstrip("/") for w in argv if w.startswith("runs/")}
    if "--config" in argv:
        config = yaml.safe_load((ROOT / argv[argv.index("--config") + 1]).read_text(encoding="utf-8")) or {}
        if "--run-dir" in argv:
            config.pop("run_dir", None)
        paths |= {s.rstrip("/") for s in _strings(config) if s.startswith("runs/")}
    return paths


def chains(commands: list[tuple[list[str], list[str], str]]) -> list[list[tuple[list[str], list[str], str]]]:
    """The commands (reading order) split into chains that can run apart, each in its own scratch
    directory: two commands naming the same run directory (one path inside or equal to the other:
    ``runs/sft_tiny`` and ``runs/sft_tiny/final``) are in one chain, in reading order; a server's ``curl``
    and ``kill %1`` lines go with the last server started. A command that needs an earlier one's run
    therefore always runs after it, in its scratch."""
    parent = list(range(len(commands)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    paths, server = [run_paths(argv) for argv, _, _ in commands], None
    for i, (argv, _, _) in enumerate(commands):
        if argv[-1] == "&":
            server = i
        elif (argv[0] == "curl" or argv == ["kill", "%1"]) and server is not None:
            parent[root(i)] = root(server)
        for j in range(i):
            if any(a == b or a.startswith(b + "/") or b.startswith(a + "/") for a in paths[i] for b in paths[j]):
                parent[root(i)] = root(j)
    grouped: dict[int, list] = {}  # in the order of each chain's first command
    for i, command in enumerate(commands):
        grouped.setdefault(root(i), []).append(command)
    return list(grouped.values())


def run_commands(commands: list[tuple[list[str], list[str], str]], scratch: Path) -> tuple[int, list[str]]:
    """Run (argv, small-step overrides, page) in order in ``scratch`` (a copy of ``configs/`` beside
    them) -> (how many ran, the failures): exit code 0, and the printed paths exist (``grpolab
    config``: what it prints loads as a YAML mapping). The ``DATA_ROOTS`` a page or a config names
    are read as the scratch folders ``make_data_roots`` fills."""
    shutil.copytree(ROOT / "configs", scratch / "configs")
    for config in (scratch / "configs").rglob("*.yaml"):
        config.write_text(_in_scratch(config.read_text(encoding="utf-8")), encoding="utf-8")
    named = [word for argv, _, _ in commands for word in argv]  # and the configs they read
    named += [(ROOT / argv[argv.index("--config") + 1]).read_text(encoding="utf-8")
              for argv, _, _ in commands if "--config" in argv]
    if any(absolute in text for text in named for absolute in DATA_ROOTS):
        make_data_roots(scratch)
    failures, servers = [], []
    for argv, small, page in commands:
        if argv[-1] == "&" or argv == ["kill", "%1"] or argv[0] == "curl":  # a server, a request to it, its stop
            failures += _server_line(argv, small, page, scratch, servers)
            continue
        cmd, env, extra = as_run([_in_scratch(word) for word in argv], small, scratch)
        proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                              stdin=subprocess.DEVNULL)
        printed = f"{page}: {shlex.join(argv)}   [run with {shlex.join(extra)} appended]"
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            errors = ([ln for ln in lines if ln.startswith("grpolab: ")]  # a one-line error, else the exception
                      or [ln for ln in lines if re.search(r"\b\w+(Error|Exception)\b:", ln)][-3:] or lines[-3:])
            failures.append(f"{printed}\n    exit {proc.returncode}: {' | '.join(dict.fromkeys(errors))}")
            continue
        if "config" in argv[1:3]:  # grpolab config prints a config: it must load as one
            try:
                loaded = yaml.safe_load(proc.stdout)
            except yaml.YAMLError as exc:
                loaded = exc
            if not isinstance(loaded, dict) or not loaded:
                failures.append(f"{printed}\n    printed no YAML mapping: {str(loaded)[:200]}")
            continue
        paths = printed_paths(proc.stdout)
        missing = [p for p in paths if not (scratch / p).exists()]
        if not paths or missing:
            failures.append(f"{printed}\n    printed paths {paths}; missing: {missing}")
    for proc in servers:  # a page that left its server running
        proc.kill()
        proc.communicate()
    return len(commands), failures
