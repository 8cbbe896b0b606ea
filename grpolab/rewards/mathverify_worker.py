"""Child side of the math-verify worker; run as ``python -I mathverify_worker.py``, never imported
by grpolab. It imports nothing from grpolab so that it can run with a path the parent chose (see
``isolation.py``): the first stdin line is that ``sys.path`` as JSON; then one JSON ``[gold, pred]``
request per line, one ``1``/``0`` verdict per stdout line. The parent bounds the time of each call
and kills this process when a call runs over (math-verify's own ``signal.alarm`` timeout works only
on a main thread and cannot interrupt a long C-level big-integer operation)."""

import json
import sys


def math_verify_equal(gold: str, pred: str) -> bool:
    """math-verify's verdict without its signal-based timeouts (the parent bounds the time)."""
    from math_verify import parse, verify

    try:
        g = parse(f"${gold}$", parsing_timeout=None)
        p = parse(f"${pred}$", parsing_timeout=None)
        return bool(g) and bool(p) and bool(verify(g, p, timeout_seconds=None))
    except Exception:
        return False


def main() -> None:  # pragma: no cover - runs in the child process
    import logging

    sys.path[:] = json.loads(sys.stdin.readline())
    logging.disable(logging.WARNING)  # math-verify warns on every call without a timeout
    math_verify_equal("1", "1")  # import and warm up before saying ready
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        gold, pred = json.loads(line)
        out.write("1\n" if math_verify_equal(gold, pred) else "0\n")
        out.flush()


if __name__ == "__main__":
    main()
