"""Reading checkpoint files that another process wrote, without running code from them.

A sharded checkpoint's pieces are pickles: DCP's ``.metadata`` and the non-tensor items of FSDP2's
optimizer state, and every DeepSpeed file. A crafted run directory could make ``pickle`` call
anything, so nothing here unpickles with code execution: DCP metadata goes through
``SafeUnpickler`` (an allow-list of DCP's own dataclasses, sizes, dtypes and paths), everything else
through ``torch.load(weights_only=True)`` with only DeepSpeed's own types allowed. A file that names
anything else is refused in one line (``UnsafeCheckpointError``).
"""

from __future__ import annotations

from pathlib import Path

import torch


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks to run code (a pickle naming a callable outside the allow-list)."""


def _dcp_allowed(module: str, name: str):
    """The globals a DCP ``.metadata`` pickle may name: its own dataclasses, sizes, dtypes, layouts
    and paths — nothing that runs code."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    if module == "torch.distributed.checkpoint.metadata" and not name.startswith("__"):
        obj = getattr(metadata, name, None)
        return obj if isinstance(obj, type) else None
    if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
        return filesystem._StorageInfo
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj if name == "Size" or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout
    if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        return getattr(pathlib, name)
    if (module, name) in (("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                          ("builtins", "slice"), ("builtins", "complex")):
        import builtins
        import collections

        return getattr(collections if module == "collections" else builtins, name)
    return None


class SafeUnpickler:
    """``pickle.Unpickler`` whose ``find_class`` resolves only ``_dcp_allowed`` globals."""

    @staticmethod
    def load(file, what: str):
        import pickle

        class _Restricted(pickle.Unpickler):
            def find_class(self, module, name):
                found = _dcp_allowed(module, name)
                if found is None:
                    raise UnsafeCheckpointError(f"{what}: refused to load: it names {module}.{name}, which a "
                                                "checkpoint never holds (a crafted or foreign file?)")
                return found

        try:
            return _Restricted(file).load()
        except UnsafeCheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - truncated, corrupt: one line
            raise UnsafeCheckpointError(f"{what}: cannot be read ({type(exc).__name__}: {exc})") from None


def safe_dcp_reader(path: Path):
    """A ``FileSystemReader`` whose metadata is unpickled by ``SafeUnpickler``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            meta_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(meta_path, "rb") as f:
                metadata = SafeUnpickler.load(f, str(meta_path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(str(path))


def safe_dcp_planner():
    """DCP's default load planner, reading non-tensor items with ``weights_only=True``."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _SafePlanner()


def _deepspeed_safe_globals() -> list:
    """The few non-tensor types DeepSpeed's checkpoint files hold."""
    found = []
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

        found += [LossScaler, DynamicLossScaler]
    except ImportError:  # pragma: no cover
        pass
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum

        found.append(ZeroStageEnum)
    except ImportError:  # pragma: no cover
        pass
    try:
        from deepspeed.utils.tensor_fragment import fragment_address

        found.append(fragment_address)
    except ImportError:  # pragma: no cover
        pass
    import argparse
    import collections

    return [*found, collections.OrderedDict, argparse.Namespace]


def safe_torch_load(path, map_location=None):
    """``torch.load(weights_only=True)`` with DeepSpeed's own types allowed; a file that names
    anything else is refused in one line (``UnsafeCheckpointError``), never executed."""
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - pickle.UnpicklingError and friends: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "Unsupported global" in str(exc) or "weights_only" in str(exc):
            raise UnsafeCheckpointError(
                f"{path}: refused to load: it holds objects a checkpoint never does "
                f"({_unsupported_global(str(exc)) or first}); a crafted or foreign file?"
            ) from None
        raise UnsafeCheckpointError(f"{path}: cannot be read ({first})") from None


def _unsupported_global(message: str) -> str | None:
    import re

    m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", message)
    return m.group(1) if m else None
