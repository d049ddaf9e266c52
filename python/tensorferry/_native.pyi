"""Type stubs of the native extension (glue only; see tensorferry/_core.py for the API)."""
from typing import Any, Callable

__version__: str

class NativeLoader:
    def __init__(
        self,
        engine: str | None = None,
        threads: int | None = None,
        slot_size: int | None = None,
        slots: int | None = None,
        uring_depth: int | None = None,
        storage_options: dict[str, str] | None = None,
    ) -> None: ...
    def options(self) -> dict[str, Any]: ...
    def read_into(
        self,
        files: list[str],
        extents: list[tuple[int, int, int, int, int]],
        targets: list[tuple[str, int, int, int]],
        stream: int | None = None,
        progress: Callable[[int, int], None] | None = None,
        verify: list[str | None] | None = None,
    ) -> dict[str, Any]: ...

# (name, dtype, shape, kind "cpu" | "cuda", device, address, nbytes)
TensorSpec = tuple[str, str, list[int], str, int, int, int]

class NativeSaver:
    def __init__(
        self,
        threads: int | None = None,
        slot_size: int | None = None,
        slots: int | None = None,
        direct: str | None = None,
        streams: int | None = None,
        storage_options: dict[str, str] | None = None,
    ) -> None: ...
    def options(self) -> dict[str, Any]: ...
    def save_safetensors(
        self,
        path: str,
        tensors: list[TensorSpec],
        metadata: dict[str, str] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]: ...
    def save_sharded(
        self,
        directory: str,
        tensors: list[TensorSpec],
        max_shard_size: int,
        metadata: dict[str, str] | None = None,
        index_metadata: dict[str, str] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]: ...
    def write_at(self, path: str, offset: int, source: tuple[str, int, int, int]) -> int: ...

def open_checkpoint(path: str, storage_options: dict[str, str] | None = None) -> dict[str, Any]: ...
def parse_header(
    data: bytes,
) -> tuple[int, list[tuple[str, str, list[int], int, int]], dict[str, str] | None]: ...
def serialize_header(
    tensors: list[tuple[str, str, list[int]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[tuple[str, int, int]]]: ...
def raw_range(
    path: str,
    dtype: str,
    num_elements: int | None = None,
    offset: int = 0,
    storage_options: dict[str, str] | None = None,
) -> tuple[int, int]: ...
def drop_cache(path: str) -> None: ...
def doctor() -> dict[str, Any]: ...
