"""The one door to NVML: a process-wide NVML session, worker threads, and typed errors.

NVML calls block (a GPU that fell off the bus can hang a call for seconds), so they never run
on the event loop: reads and collection share a small pool, and each GPU's mutations get a
single thread of their own, so a hung GPU cannot starve the others.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from agent.errors import GpuLost, NvmlError
from agent.gpu.backend import Nvml

T = TypeVar("T")
log = logging.getLogger("agent.gpu")

NVML_ERROR_GPU_IS_LOST = 15


def nvml_error_name(nvml: Any, code: int) -> str:
    """``NVML_ERROR_IN_USE`` for 19: the constant's name, which is what operators search for."""
    for name in _ERROR_NAMES:
        if getattr(nvml, name, None) == code:
            return name
    return f"NVML_ERROR_{code}"


_ERROR_NAMES = (
    "NVML_ERROR_UNINITIALIZED", "NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_ALREADY_INITIALIZED", "NVML_ERROR_NOT_FOUND",
    "NVML_ERROR_INSUFFICIENT_SIZE", "NVML_ERROR_INSUFFICIENT_POWER",
    "NVML_ERROR_DRIVER_NOT_LOADED", "NVML_ERROR_TIMEOUT", "NVML_ERROR_IRQ_ISSUE",
    "NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_CORRUPTED_INFOROM", "NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED",
    "NVML_ERROR_OPERATING_SYSTEM", "NVML_ERROR_LIB_RM_VERSION_MISMATCH", "NVML_ERROR_IN_USE",
    "NVML_ERROR_MEMORY", "NVML_ERROR_NO_DATA", "NVML_ERROR_INSUFFICIENT_RESOURCES",
    "NVML_ERROR_NOT_READY", "NVML_ERROR_GPU_NOT_FOUND", "NVML_ERROR_INVALID_STATE",
    "NVML_ERROR_UNKNOWN",
)


class NvmlSession:
    """Owns NVML initialisation for the process lifetime and runs every NVML call.

    ``nvml`` is the ``pynvml`` module or an object with the same call surface (the simulator).
    Calls go through :meth:`call`, which turns ``NVMLError`` into :class:`NvmlError` naming the
    function and GPU, and remembers GPUs that answered ``GPU_IS_LOST``.
    """

    def __init__(self, nvml: Nvml, *, read_workers: int = 4,
                 on_error: Callable[[NvmlError], None] | None = None) -> None:
        self.nvml = nvml
        self._reads = ThreadPoolExecutor(read_workers, thread_name_prefix="nvml-read")
        self._mutators: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._lost: dict[str, str] = {}
        self._handles: dict[str, Any] = {}
        self._fixed: dict[Hashable, Any] = {}
        self._initialised = False
        self._on_error = on_error

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def initialised(self) -> bool:
        return self._initialised

    async def initialise(self) -> None:
        """Initialise NVML once (in a worker thread); raise :class:`NvmlError` on failure."""
        if not self._initialised:
            await self.read(lambda: self.call("nvmlInit"))
            self._initialised = True

    def close(self) -> None:
        """Shut NVML down and stop the worker threads (hung calls are abandoned, not joined)."""
        if self._initialised:
            try:
                self.call("nvmlShutdown")
            except NvmlError as err:
                log.warning("nvml shutdown failed", extra={"error": err.name})
            self._initialised = False
        with self._lock:
            self._fixed.clear()
        self._reads.shutdown(wait=False, cancel_futures=True)
        for pool in self._mutators.values():
            pool.shutdown(wait=False, cancel_futures=True)

    # -- running calls ---------------------------------------------------------------------

    async def read(self, fn: Callable[[], T]) -> T:
        """Run a function of NVML reads in the read pool."""
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        return await loop.run_in_executor(self._reads, ctx.run, fn)

    async def mutate(self, gpu_uuid: str, fn: Callable[[], T]) -> T:
        """Run a function of NVML mutations on this GPU's own thread, one at a time."""
        with self._lock:
            pool = self._mutators.get(gpu_uuid)
            if pool is None:
                pool = ThreadPoolExecutor(1, thread_name_prefix=f"nvml-{gpu_uuid[:12]}")
                self._mutators[gpu_uuid] = pool
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        return await loop.run_in_executor(pool, ctx.run, fn)

    def call(self, function: str, *args: Any, gpu: str | None = None) -> Any:
        """Call one NVML function (from a worker thread); errors become :class:`NvmlError`."""
        try:
            return getattr(self.nvml, function)(*args)
        except self.nvml.NVMLError as err:
            code = int(err.value)
            name = nvml_error_name(self.nvml, code)
            error: NvmlError
            if code == NVML_ERROR_GPU_IS_LOST:
                error = GpuLost(function=function, code=code, name=name, gpu=gpu)
                if gpu is not None:
                    self.mark_lost(gpu, f"{function} returned {name}")
            else:
                error = NvmlError(function=function, code=code, name=name, gpu=gpu)
            if self._on_error is not None:
                self._on_error(error)
            raise error from err

    def total_energy_mj(self, gpu_uuid: str) -> int:
        """The GPU's total energy counter in mJ (from a worker thread); it counts from zero
        again whenever the driver loads. NvmlError where the GPU has none."""
        return int(self.call("nvmlDeviceGetTotalEnergyConsumption", self.gpu_handle(gpu_uuid),
                             gpu=gpu_uuid))

    def gpu_handle(self, gpu_uuid: str) -> Any:
        """The device handle of a GPU, cached by UUID: a GPU's handle stays valid while NVML is
        initialised, and looking one up can take long on a busy node. (GPU-instance, compute-
        instance and MIG device handles are never cached: they go stale on any change.)"""
        with self._lock:
            handle = self._handles.get(gpu_uuid)
        if handle is None:
            handle = self.call("nvmlDeviceGetHandleByUUID", gpu_uuid, gpu=gpu_uuid)
            with self._lock:
                self._handles[gpu_uuid] = handle
        return handle

    def fixed(self, key: Hashable, read: Callable[[], T]) -> T:
        """What ``read`` returns for ``key`` (from a worker thread), read once while NVML is
        initialised: for facts the driver never changes then, such as a GPU's profiles."""
        with self._lock:
            if key in self._fixed:
                return cast(T, self._fixed[key])
        value = read()
        with self._lock:
            self._fixed.setdefault(key, value)
        return value

    # -- GPU health seen through NVML errors -----------------------------------------------

    def mark_lost(self, gpu_uuid: str, reason: str) -> None:
        with self._lock:
            first = gpu_uuid not in self._lost
            self._lost[gpu_uuid] = reason
        if first:
            log.error("gpu lost", extra={"gpu": gpu_uuid, "reason": reason})

    def lost_reason(self, gpu_uuid: str) -> str | None:
        with self._lock:
            return self._lost.get(gpu_uuid)

    def clear_lost(self, gpu_uuid: str) -> None:
        with self._lock:
            self._lost.pop(gpu_uuid, None)
