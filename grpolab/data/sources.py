"""Where examples come from: a file (``load_examples`` picks GSM8K, MATH or plain JSONL) or a Hugging
Face ``datasets`` name, ``hf:NAME[:CONFIG][@SPLIT]`` (an evaluation set without ``@SPLIT`` reads the
test split, else the validation split: never the training questions)."""

from __future__ import annotations

from pathlib import Path

from .datasets import (
    DataError,
    Example,
    Loaded,
    gsm8k_final_answer,
    last_boxed_answer,
    load_gsm8k,
    load_jsonl,
    load_math,
    prompt_conversation,
    require_field,
)

EVAL_SPLITS = ("test", "validation", "valid", "dev")  # an hf: evaluation set's split when none is named


def parse_hf_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``hf:NAME[:CONFIG][@SPLIT]`` (or the same without ``hf:``) -> (name, config or None, split or None):
    ``hf:openai/gsm8k:main@test``. NAME may be a Hub id or a local dataset folder."""
    body = spec[3:] if spec.startswith("hf:") else spec
    body, at, split = body.rpartition("@") if "@" in body else (body, "", "")
    name, colon, config = body.partition(":")
    if not name or (at and not split) or (colon and not config):
        raise DataError(f"{spec!r}: expected hf:NAME[:CONFIG][@SPLIT], e.g. hf:openai/gsm8k:main@test")
    return name, config or None, split or None


def hf_split(name: str, config: str | None, default: str | None) -> str:
    """The split to read: ``default`` ("train" for training data), or — None, an evaluation set — the
    dataset's test split, else its validation split (never the training questions)."""
    if default is not None:
        return default
    import datasets

    try:
        names = datasets.get_dataset_split_names(name, config)
    except Exception as exc:  # noqa: BLE001 - offline, unknown name, ...
        raise DataError(f"dataset {name!r} could not be read: {type(exc).__name__}: {exc}") from None
    split = next((s for s in EVAL_SPLITS if s in names), None)
    if split is None:
        raise DataError(f"dataset {name!r} has no test or validation split (it has {', '.join(names)}): name the "
                        f"evaluation split, e.g. hf:{name}{':' + config if config else ''}@{names[-1]}")
    return split


def load_hf_dataset(
    name: str,
    split: str | None = "train",
    config: str | None = None,
    question_field: str = "question",
    answer_field: str = "answer",
    answer_format: str = "raw",
) -> Loaded:
    """Examples from a Hugging Face ``datasets`` name (``answer_format``: raw | gsm8k | math_boxed);
    ``split`` None: the test split, else the validation split (``hf_split``).

    ``datasets`` is imported here, lazily; a missing library or an unreachable hub is one clear error.
    """
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise DataError(
            f"dataset {name!r}: the 'datasets' library is not installed (pip install -e '.[datasets]'), "
            "or give a local JSONL file instead"
        ) from None
    split = hf_split(name, config, split)
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # noqa: BLE001 - offline, unknown name, ...
        raise DataError(
            f"dataset {name!r} (split {split!r}) could not be loaded: {type(exc).__name__}: {exc}"
        ) from None
    out = Loaded()
    for i, row in enumerate(ds):
        where = f"{name}[{split}]:{i}"
        try:
            q, a = require_field(row, question_field), require_field(row, answer_field)
            if answer_format == "gsm8k":
                a = gsm8k_final_answer(str(a))
            elif answer_format == "math_boxed":
                a = last_boxed_answer(str(a))
            if isinstance(q, list):
                q = prompt_conversation(q, question_field)
        except (KeyError, ValueError) as exc:
            raise DataError(f"{where}: {exc.args[0]}") from None
        out.append(Example(q if isinstance(q, list) else str(q), a, meta={"source": where}))
    return out


def load_examples(
    spec: str,
    format: str = "auto",
    question_field: str = "question",
    answer_field: str | None = "answer",
    on_error: str = "raise",
    split: str | None = "train",
) -> Loaded:
    """Examples from a file or ``hf:NAME[:CONFIG][@SPLIT]`` (``parse_hf_spec``; without ``@SPLIT`` the
    ``split`` given: "train" for training data, None for evaluation data — the test split, else the
    validation split). ``format``: ``gsm8k``, ``math``, ``jsonl`` (the named fields), or ``auto`` — a
    path containing "gsm8k" is GSM8K, one containing "math" is MATH, any other is plain JSONL."""
    if format not in ("auto", "gsm8k", "math", "jsonl"):
        raise ValueError(f"unknown data format {format!r}; expected auto, gsm8k, math or jsonl")
    if spec.startswith("hf:"):
        name, config, named_split = parse_hf_spec(spec)
        return load_hf_dataset(name, split=named_split or split, config=config, question_field=question_field,
                               answer_field=answer_field,
                               answer_format={"gsm8k": "gsm8k", "math": "math_boxed"}.get(format, "raw"))
    name = str(Path(spec)).lower()
    if format == "gsm8k" or (format == "auto" and "gsm8k" in name):
        return load_gsm8k(spec, on_error=on_error)
    if format == "math" or (format == "auto" and "math" in name):
        return load_math(spec, on_error=on_error)
    return load_jsonl(spec, question_field=question_field, answer_field=answer_field, on_error=on_error)
