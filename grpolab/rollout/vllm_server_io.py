"""The vLLM server backend's plumbing (``rollout.vllm_server``): HTTP calls with a timeout and no
proxy, a free local port, stopping a process group, the server's CPU threads, the per-run secret
the server's routes require, and the two weight senders of the trainer's side — grpolab's
shared-memory engine (the CPU) and vLLM's NCCL engine (CUDA).

Trust: a server's weight routes change what every later batch is sampled from, so they are
the trainer's alone. The server ``vllm_serve`` runs refuses every route but ``/health`` without
the header ``SECRET_HEADER`` holding its secret (``SECRET_ENV``): the trainer makes one per run
and puts it in the environment of the server it starts (never on the command line, which every
local user can read); a server started apart makes its own and leaves it in a file only its user
can read (``secret_file``), where a trainer of the same user finds it by the server's port. The
weights cross in a memfd (no name in ``/dev/shm``, freed with the last process that holds it,
even after SIGKILL) that the server opens as ``/proc/<trainer pid>/fd/<n>``, which only the
trainer's user may."""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .base import RolloutBackendError
from .vllm import vllm_unavailable_reason

CHUNK_BYTES = 64 << 20  # the shared-memory buffer: one chunk of parameters per /update_weights
SECRET_ENV = "GRPOLAB_VLLM_SERVER_SECRET"  # the server's secret, in its environment (module docstring)
SECRET_HEADER = "X-Grpolab-Secret"
OPEN_ROUTES = ("/health", "/ping")  # answered without the secret: liveness only
WEIGHTS_PREFIX = "grpolab-weights-"  # /dev/shm files of earlier releases: grpolab-weights-<pid>-<hex>


def new_secret() -> str:
    return secrets.token_hex(32)


def secret_file(port: int | str) -> Path:
    """Where a server started apart (``python -m grpolab.rollout.vllm_serve serve``) leaves its
    secret for the trainers of its user: ``~/.cache/grpolab/vllm-servers/port-<port>.secret``
    (the folder 0700, the file 0600)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "grpolab" / "vllm-servers" / f"port-{port}.secret"


def write_secret_file(port: int | str, secret: str) -> Path:
    path = secret_file(port)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    os.replace(tmp, path)
    return path


def find_secret(server_url: str) -> str | None:
    """The secret for a server reached by URL: ``$GRPOLAB_VLLM_SERVER_SECRET``, else the file a
    server of this user started apart left for its port (``secret_file``), else None."""
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    match = re.match(r"https?://[^/:]+:(\d+)", server_url)
    path = secret_file(match.group(1) if match else 80)
    try:
        st = path.stat()
        if st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return path.read_text().strip() or None
    except OSError:
        pass
    return None


def secret_digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def remove_stale_weight_files(folder: str = "/dev/shm") -> list[str]:
    """Remove this user's ``grpolab-weights-<pid>-*`` files whose process is gone (a trainer of an
    earlier release killed outright left them: 64 MB or more of RAM each); the removed paths."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = re.fullmatch(WEIGHTS_PREFIX + r"(\d+)-[0-9a-f]+(\.probe)?", name)
        if match is None:
            continue
        path = os.path.join(folder, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
        except OSError:  # alive under another user (PermissionError), or gone meanwhile
            continue
    return removed


class VLLMServerError(RolloutBackendError):
    """The vLLM server died or stopped answering (one line: its URL, and for a server grpolab
    started, its exit code and the end of its log)."""


def check_vllm_server_options(server_url: str | None = None, enable_sleep_mode: bool = False,
                              tensor_parallel_size: int = 1, **_) -> None:
    """What can be known before any server starts: a URL that is one, and for a server grpolab
    starts, vLLM importable here (it runs with this Python), sleep mode only with CUDA, no more
    tensor-parallel ranks than GPUs. A one-line ValueError otherwise."""
    if server_url is not None:
        if not server_url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_server_url must be an http(s) URL such as http://127.0.0.1:8000, "
                             f"got {server_url!r}")
        return
    reason = vllm_unavailable_reason()
    if reason:
        raise ValueError(f"rollout_backend 'vllm_server': {reason}")
    cuda = torch.cuda.is_available()
    if enable_sleep_mode and not cuda:
        raise ValueError("vllm_enable_sleep_mode needs a CUDA GPU (vLLM's CPU backend has no sleep mode); "
                         "set it to false")
    if cuda and tensor_parallel_size > torch.cuda.device_count():
        raise ValueError(f"vllm_tensor_parallel_size ({tensor_parallel_size}) exceeds the {torch.cuda.device_count()} "
                         "GPU(s) of this machine")


# ---------------------------------------------------------------- HTTP

# ---------------------------------------------------------------- the backend


class _Refused(Exception):
    """The server answered with an HTTP error (a bad request, an engine error)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local server: no proxy


def _http(url: str, body: dict | None, timeout: float, method: str | None = None, secret: str | None = None):
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if secret:
        headers[SECRET_HEADER] = secret
    request = urllib.request.Request(url, data=data, method=method or ("GET" if data is None else "POST"),
                                     headers=headers)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            parsed = json.loads(detail)
            detail = parsed.get("error", {}).get("message") or parsed.get("detail") or parsed.get("error") or detail
        except (ValueError, AttributeError):
            pass
        raise _Refused(exc.code, " ".join(str(detail).split())[:500]) from None
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError:  # e.g. an HTML page: not a vLLM server
        text = " ".join(raw[:200].decode(errors="replace").split())
        raise _Refused(200, f"an answer that is not JSON ({text!r}): not a vLLM server") from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop the server's whole process group (its engine and workers too): SIGTERM, then SIGKILL."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid  # the leader is gone (reaped); its group may still hold the engine
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            continue
        break
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def server_visible_devices(device: str) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a server placed on ``device`` (``vllm_device``): cuda:N is this
    process's N-th visible GPU, named as this process's own ``CUDA_VISIBLE_DEVICES`` names it; cpu:
    none ("")."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return ""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    n = int(index or 0)
    return visible[n] if n < len(visible) else str(n)


def _server_threads_env(env: dict, threads: int) -> None:
    """The server's OpenMP threads: ``threads`` of them, bound to the last cores this process may use."""
    env["OMP_NUM_THREADS"] = str(threads)
    if "VLLM_CPU_OMP_THREADS_BIND" in env:
        return
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return
    chosen = cores[-threads:] if threads <= len(cores) else cores
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in chosen)


# ---------------------------------------------------------------- weight senders


def _start_update(post) -> None:
    """``/start_weight_update``; a session a killed trainer left open (the server refuses to start
    another, and refuses every later trainer: reliability case S13) is finished first, once: this
    update then loads every weight anew."""
    try:
        post("/start_weight_update", None, "start_weight_update")
    except Exception as exc:
        if "already active" not in str(exc):
            raise
        post("/finish_weight_update", None, "finish_weight_update (of a killed trainer's update)")
        post("/start_weight_update", None, "start_weight_update")


class _SharedMemorySender:
    """The trainer side of ``grpolab_shm`` (``vllm_serve``): parameters copied one by one into a
    shared buffer, posted as a chunk whenever the next one would not fit. The buffer is a memfd
    (Linux): it has no name in ``/dev/shm``, so nothing is left there when either side is killed,
    and the server opens it as ``/proc/<this pid>/fd/<n>``, which only this user's processes can.
    Elsewhere it is a 0600 file in a 0700 folder of its own."""

    ALIGN = 64

    def __init__(self, post, chunk_bytes: int = CHUNK_BYTES):
        self.post, self.chunk_bytes = post, chunk_bytes
        self.capacity, self.buffer, self.chunks_sent, self._dir = 0, None, 0, None
        remove_stale_weight_files()
        self.fd, self.path = self._open("weights")
        probe_fd, probe = self._open("probe")
        token = uuid.uuid4().hex
        try:
            os.write(probe_fd, token.encode())
            self.post("/init_weight_transfer_engine",
                      {"init_info": {"probe_path": probe, "token": token, "weights_path": self.path}},
                      "the weight-transfer handshake")
        except BaseException:
            self.close()
            raise
        finally:
            os.close(probe_fd)
            if self._dir is not None and os.path.exists(probe):
                os.unlink(probe)

    def _open(self, name: str) -> tuple[int, str]:
        """A new shared file for this user alone: (its descriptor, the path the server opens)."""
        if hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd"):
            fd = os.memfd_create(f"grpolab-{name}", getattr(os, "MFD_CLOEXEC", 0))
            return fd, f"/proc/{os.getpid()}/fd/{fd}"
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="grpolab-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                         else None)  # 0700
        path = os.path.join(self._dir, name)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600), path

    def _reserve(self, nbytes: int) -> None:
        """The file and its mapping hold at least ``nbytes`` (grown only for one parameter larger
        than a chunk; the server maps the file at each chunk, whatever its size)."""
        if nbytes <= self.capacity:
            return
        self.buffer = None
        self.capacity = max(nbytes, self.chunk_bytes)
        os.ftruncate(self.fd, self.capacity)
        self.buffer = torch.from_file(f"/proc/self/fd/{self.fd}" if self._dir is None else self.path, shared=True,
                                      size=self.capacity, dtype=torch.uint8)

    def send(self, weights) -> None:
        _start_update(self.post)
        chunk: dict[str, list] = {"names": [], "dtype_names": [], "shapes": [], "offsets": []}
        used, self.chunks_sent = 0, 0
        for name, tensor in weights:
            t = tensor.detach()
            t = (t if t.device.type == "cpu" else t.cpu()).contiguous()
            nbytes = t.numel() * t.element_size()
            if chunk["names"] and used + nbytes > self.chunk_bytes:
                self._flush(chunk)
                used = 0
            self._reserve(used + nbytes)
            self.buffer[used:used + nbytes].copy_(t.reshape(-1).view(torch.uint8))
            chunk["names"].append(name)
            chunk["dtype_names"].append(str(t.dtype).removeprefix("torch."))
            chunk["shapes"].append(list(t.shape))
            chunk["offsets"].append(used)
            used += -(-nbytes // self.ALIGN) * self.ALIGN
            del t, tensor  # the stream's tensor (a gathered shard) can go now
        if chunk["names"]:
            self._flush(chunk)
        self.post("/finish_weight_update", None, "finish_weight_update")

    def _flush(self, chunk: dict) -> None:
        self.post("/update_weights", {"update_info": dict(chunk, path=self.path)}, "update_weights")
        self.chunks_sent += 1
        for v in chunk.values():
            v.clear()

    def close(self) -> None:
        self.buffer = None
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None
        if self._dir is not None:
            import shutil

            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class _NcclSender:
    """The trainer side of vLLM's NCCL engine: this process is rank 0 of a group with the server's
    workers; each parameter is broadcast while the workers receive it in ``/update_weights``."""

    def __init__(self, post, pool: ThreadPoolExecutor, workers: int, local: bool):
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo,
            worker_init_payload,
        )
        from vllm.distributed.weight_transfer.nccl_common import trainer_init as open_endpoint

        self.post, self.pool = post, pool
        address = "127.0.0.1" if local else socket.gethostbyname(socket.gethostname())
        port = _free_port()
        info = NCCLWeightTransferInitInfo(master_address=address, master_port=port, rank_offset=1,
                                          world_size=workers + 1, packed=False)
        future = pool.submit(post, "/init_weight_transfer_engine", {"init_info": worker_init_payload(info)},
                             "the NCCL weight-transfer handshake")
        self.group = open_endpoint({"master_address": address, "master_port": port, "world_size": workers + 1})
        future.result()

    def send(self, weights) -> None:
        _start_update(self.post)
        stream = torch.cuda.current_stream()
        for name, tensor in weights:
            t = tensor.detach().to("cuda").contiguous()
            info = {"names": [name], "dtype_names": [str(t.dtype).removeprefix("torch.")], "shapes": [list(t.shape)]}
            future = self.pool.submit(self.post, "/update_weights", {"update_info": info}, "update_weights")
            self.group.broadcast(t, src=0, stream=stream)
            stream.synchronize()
            future.result()
            del t, tensor
        self.post("/finish_weight_update", None, "finish_weight_update")

    def close(self) -> None:
        if getattr(self, "group", None) is not None:
            self.group.destroy()
            self.group = None
