"""The vLLM server backend's plumbing (``rollout.vllm_server``): HTTP calls with a timeout and no
proxy, a free local port, stopping a process group, the server's CPU threads, and the two weight
senders of the trainer's side — grpolab's shared-memory engine (the CPU) and vLLM's NCCL engine
(CUDA)."""

from __future__ import annotations

import json
import os
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


def _http(url: str, body: dict | None, timeout: float, method: str | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method or ("GET" if data is None else "POST"),
                                     headers={"Content-Type": "application/json"})
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
    return json.loads(raw) if raw.strip() else None


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


class _SharedMemorySender:
    """The trainer side of ``grpolab_shm`` (``vllm_serve``): parameters copied one by one into a
    file in ``/dev/shm``, posted as a chunk whenever the next one would not fit."""

    ALIGN = 64

    def __init__(self, post, chunk_bytes: int = CHUNK_BYTES):
        self.post, self.chunk_bytes = post, chunk_bytes
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.path = os.path.join(folder, f"grpolab-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self.capacity, self.buffer, self.chunks_sent = 0, None, 0
        probe, token = self.path + ".probe", uuid.uuid4().hex
        Path(probe).write_text(token)
        try:
            self.post("/init_weight_transfer_engine", {"init_info": {"probe_path": probe, "token": token}},
                      "the weight-transfer handshake")
        finally:
            os.unlink(probe)

    def _reserve(self, nbytes: int) -> None:
        """The file and its mapping hold at least ``nbytes`` (grown only for one parameter larger
        than a chunk; the server maps the file at each chunk, whatever its size)."""
        if nbytes <= self.capacity:
            return
        self.buffer = None
        self.capacity = max(nbytes, self.chunk_bytes)
        with open(self.path, "ab") as f:
            f.truncate(self.capacity)
        self.buffer = torch.from_file(self.path, shared=True, size=self.capacity, dtype=torch.uint8)

    def send(self, weights) -> None:
        self.post("/start_weight_update", None, "start_weight_update")
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
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


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
        self.post("/start_weight_update", None, "start_weight_update")
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
