"""Retrieval over a local corpus with a BM25 index (``bm25s``), cached on disk, as a tool
(``<search>query</search>``) and as retrieval-augmented prompts (``{context}`` in a template).

Why ``bm25s`` rather than ``rank-bm25``: it scores with precomputed sparse matrices (numpy only),
so the batch of queries of a rollout turn costs milliseconds even on a large corpus, where
rank-bm25 rescores every document in Python per query; and it saves and loads its index as plain
``.npy``/JSON files (``allow_pickle=False``), so a cached index is reloaded without unpickling
anything.

The cache: ``<cache_dir>/<key>/`` where the key is a hash of the passages and of every setting
that changes the index (BM25 method, k1, b, stop words, the bm25s version). An unchanged corpus
reloads; a changed one (or changed settings) gets a new key and is rebuilt. The directory is
written under a temporary name and renamed, so an interrupted build is never loaded.

The cache is disposable: a damaged one (an emptied or truncated file, a marker that does not
match) is rebuilt, with one warning naming its directory; a location that cannot be written (a
read-only disk, a path under a file) keeps the index in memory, with one warning. Neither is ever
an error: the corpus is the truth, the cache a copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .base import ToolOutput

CACHE_FORMAT = 1


class CorpusError(ValueError):
    """A corpus that cannot be read; the message names the file (and line)."""


def _bm25s():
    try:
        import bm25s
    except ImportError:  # pragma: no cover - depends on the installation
        raise ImportError("retrieval needs the 'bm25s' package: pip install bm25s") from None
    return bm25s


def load_corpus(path: str | Path, text_field: str = "text") -> list[str]:
    """The passages of a corpus: a JSONL file (one passage per line, in ``text_field``) or a
    directory of ``.txt`` files (each split into passages at blank lines), in sorted file order."""
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"{path}: no such corpus file or directory")
    if path.is_dir():
        passages = []
        for file in sorted(path.rglob("*.txt")):
            try:
                text = file.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise CorpusError(f"{file}: not valid UTF-8 (byte {exc.start})") from None
            passages.extend(p.strip() for p in text.split("\n\n") if p.strip())
        if not passages:
            raise CorpusError(f"{path}: no .txt file with any text")
        return passages
    return _load_jsonl(path, text_field)


def _load_jsonl(path: Path, text_field: str) -> list[str]:
    passages = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CorpusError(f"{path}:{lineno}: not valid UTF-8 (byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict) or text_field not in obj:
                raise CorpusError(f"{path}:{lineno}: no {text_field!r} field")
            if not isinstance(obj[text_field], str) or not obj[text_field].strip():
                raise CorpusError(f"{path}:{lineno}: {text_field!r} is not a non-empty string")
            passages.append(obj[text_field].strip())
    if not passages:
        raise CorpusError(f"{path}: no passage in the corpus")
    return passages


@dataclass(frozen=True)
class BM25Settings:
    """Everything that changes the index (and so its cache key)."""

    method: str = "lucene"
    k1: float = 1.5
    b: float = 0.75
    stopwords: str | None = "en"


class BM25Index:
    """A BM25 index over ``passages``; ``search(queries, k)`` -> the top passages per query (those
    with a positive score only: a query sharing no term with the corpus finds nothing)."""

    def __init__(self, passages: Sequence[str], settings: BM25Settings = BM25Settings(),
                 cache_dir: str | Path | None = None):
        if not passages:
            raise CorpusError("an index needs at least one passage")
        self.passages, self.settings = list(passages), settings
        self.cache_path: Path | None = None
        self.loaded_from_cache = False
        bm25s = _bm25s()
        if cache_dir is None:
            self.retriever = self._build(bm25s)
            return
        self.cache_path = Path(cache_dir) / self.cache_key()
        self.retriever = self._load(bm25s)
        if self.retriever is not None:
            self.loaded_from_cache = True
            return
        self.retriever = self._build(bm25s)
        self._save_or_fall_back()

    def _load(self, bm25s):
        """The cached index, or None when there is none; a damaged one is removed (one warning)."""
        marker = self.cache_path / "grpolab_index.json"
        try:
            if not marker.is_file():
                return None
            saved = json.loads(marker.read_text(encoding="utf-8"))
            if not isinstance(saved, dict) or saved.get("passages") != len(self.passages):
                raise ValueError("its marker does not match the corpus")
            retriever = bm25s.BM25.load(str(self.cache_path), show_progress=False)
            if int(retriever.scores["num_docs"]) != len(self.passages):
                raise ValueError("it indexes a different number of passages")
            retriever.retrieve([["probe"]], k=1, show_progress=False)  # a truncated array fails here, not mid-run
        except Exception as exc:  # noqa: BLE001 - anything unreadable (EOFError, ValueError, OSError, ...) is damage
            warnings.warn(f"BM25 cache {self.cache_path} is damaged ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split()) or 'unreadable'}); rebuilding it", RuntimeWarning, stacklevel=3)
            shutil.rmtree(self.cache_path, ignore_errors=True)
            if self.cache_path.is_file() or self.cache_path.is_symlink():
                try:
                    self.cache_path.unlink()
                except OSError:
                    pass
            return None
        return retriever

    def _save_or_fall_back(self) -> None:
        """Save to the cache; where it cannot be written, keep the index in memory only (one
        warning: the next run builds it again, in milliseconds to seconds)."""
        try:
            self._save()
        except OSError as exc:
            warnings.warn(f"BM25 cache {self.cache_path.parent} cannot be written ({type(exc).__name__}: "
                          f"{exc.strerror or exc}); the index is kept in memory only", RuntimeWarning, stacklevel=3)
            self.cache_path = None

    def cache_key(self) -> str:
        """A hash of the passages and the settings (and the bm25s version and cache format)."""
        h = hashlib.sha256(json.dumps([CACHE_FORMAT, _bm25s().__version__, self.settings.__dict__]).encode())
        for p in self.passages:
            h.update(p.encode("utf-8"))
            h.update(b"\0")
        return h.hexdigest()[:24]

    def _tokenize(self, texts: Sequence[str]) -> list[list[str]]:
        return _bm25s().tokenize(list(texts), stopwords=self.settings.stopwords, return_ids=False, show_progress=False)

    def _build(self, bm25s):
        s = self.settings
        retriever = bm25s.BM25(method=s.method, k1=s.k1, b=s.b)
        retriever.index(self._tokenize(self.passages), show_progress=False)
        return retriever

    def _save(self) -> None:
        """Write the index under a temporary name, then rename: readers never see half an index."""
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.cache_path.parent))
        try:
            self.retriever.save(str(tmp), show_progress=False)
            marker = {"passages": len(self.passages), **self.settings.__dict__}
            (tmp / "grpolab_index.json").write_text(json.dumps(marker))
            os.replace(tmp, self.cache_path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (self.cache_path / "grpolab_index.json").is_file():  # not another writer's finished copy
                raise

    def search(self, queries: Sequence[str], k: int) -> list[list[str]]:
        """The top-``k`` passages of each query, best first (fewer when fewer score above 0)."""
        tokens = self._tokenize(queries)
        k = min(k, len(self.passages))
        out: list[list[str]] = [[] for _ in queries]
        rows = [i for i, t in enumerate(tokens) if t]  # a query of stop words only finds nothing
        if not rows:
            return out
        docs, scores = self.retriever.retrieve([tokens[i] for i in rows], k=k, show_progress=False)
        for i, d, s in zip(rows, docs, scores):
            out[i] = [self.passages[int(j)] for j, score in zip(d, s) if score > 0]
        return out


def open_index(corpus: str | Path, text_field: str = "text", cache_dir: str | Path | None = None,
               settings: BM25Settings = BM25Settings()) -> BM25Index:
    """The index of a corpus file or directory, cached in ``cache_dir`` (default: a
    ``.grpolab_bm25`` directory next to the corpus)."""
    corpus = Path(corpus)
    passages = load_corpus(corpus, text_field)
    if cache_dir is None:
        cache_dir = (corpus if corpus.is_dir() else corpus.parent) / ".grpolab_bm25"
    return BM25Index(passages, settings, cache_dir)


def truncate(passage: str, max_chars: int | None = None, max_tokens: int | None = None, tokenizer=None) -> str:
    """``passage`` cut to ``max_chars`` characters and/or ``max_tokens`` tokens of ``tokenizer``."""
    if max_chars is not None and len(passage) > max_chars:
        passage = passage[:max_chars]
    if max_tokens is not None:
        if tokenizer is None:
            raise ValueError("max_tokens truncation needs a tokenizer")
        ids = tokenizer(passage, add_special_tokens=False)["input_ids"]
        if len(ids) > max_tokens:
            passage = tokenizer.decode(ids[:max_tokens], skip_special_tokens=True)
    return passage


@dataclass
class SearchTool:
    """``<search>query</search>`` -> the top-``top_k`` passages, each truncated, joined by
    ``separator``; ``no results`` when nothing matches."""

    index: BM25Index
    top_k: int = 1
    max_chars: int | None = 200
    max_tokens: int | None = None
    tokenizer: object = None
    separator: str = " | "
    name: str = "search"

    def __post_init__(self):
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")

    def passages(self, queries: Sequence[str]) -> list[list[str]]:
        return [[truncate(p, self.max_chars, self.max_tokens, self.tokenizer) for p in hits]
                for hits in self.index.search(queries, self.top_k)]

    def run(self, queries: Sequence[str]) -> list[ToolOutput]:
        return [ToolOutput(self.separator.join(hits) if hits else "no results") for hits in self.passages(queries)]


def fill_template(template_text: str, question: str, context: str) -> str:
    """Substitute ``{question}`` and ``{context}`` in one pass (a passage containing
    ``{question}`` is left as it is)."""
    if "{context}" not in template_text:
        raise ValueError("a retrieval-augmented template needs a {context} placeholder")
    parts = {"question": question, "context": context}
    return re.sub(r"\{(question|context)\}", lambda m: parts[m.group(1)], template_text)


def retrieval_augmented_prompts(template, questions: Sequence[str], tool: SearchTool) -> list[str]:
    """Prompts with the top passages for each question in the template's ``{context}`` (the simple
    RAG variant: retrieval happens once, before sampling, with the question as the query).
    ``template``: a ``PromptTemplate`` or its text."""
    text = getattr(template, "text", template)
    return [fill_template(text, q, tool.separator.join(hits) if hits else "no results")
            for q, hits in zip(questions, tool.passages(questions))]


class RetrievalAugmentedTemplate:
    """A template whose ``format(question)`` fills ``{context}`` with the top passages for the
    question: anything that formats prompts with a template (``eval.evaluate``, a trainer) gets
    retrieval-augmented prompts unchanged."""

    def __init__(self, template, tool: SearchTool):
        self.text, self.tool = getattr(template, "text", template), tool
        self.name = f"{getattr(template, 'name', 'template')}+retrieval"
        fill_template(self.text, "", "")  # a template without {context} is refused here, not at sampling

    def format(self, question: str) -> str:
        return retrieval_augmented_prompts(self.text, [question], self.tool)[0]

    __call__ = format
