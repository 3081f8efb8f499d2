"""Run the heavy per-chunk steps in process or on a Dask cluster, same code either way.

``ChunkMapper.map(fn, chunks, **shared)`` calls ``fn(chunk, **shared)`` for each chunk and
returns the results in chunk order, so the in-process and Dask paths make identical
decisions. On Dask the shared arguments are scattered once and every chunk is a task.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def chunked(items: Sequence, size: int) -> list:
    return [items[i:i + size] for i in range(0, len(items), size)]


class LocalMapper:
    kind = "local"

    def map(self, fn: Callable, chunks: Sequence, **shared: Any) -> list:
        return [fn(chunk, **shared) for chunk in chunks]

    def close(self) -> None:
        pass


class DaskMapper:
    """Maps on a dask.distributed client: a running scheduler's, or a LocalCluster we start."""
    kind = "dask"

    def __init__(self, client=None, address: str | None = None, n_workers: int = 2,
                 threads_per_worker: int = 1, processes: bool = True):
        from dask.distributed import Client, LocalCluster
        self._owned = []
        if client is None:
            if address:
                client = Client(address)
            else:
                cluster = LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker,
                                       processes=processes, dashboard_address=None)
                self._owned.append(cluster)
                client = Client(cluster)
            self._owned.insert(0, client)
        self.client = client

    def map(self, fn: Callable, chunks: Sequence, **shared: Any) -> list:
        if not chunks:
            return []
        scattered = {k: self.client.scatter(v, broadcast=True) for k, v in shared.items()}
        futures = [self.client.submit(fn, chunk, pure=False, **scattered) for chunk in chunks]
        return self.client.gather(futures)

    def close(self) -> None:
        for obj in self._owned:
            obj.close()
        self._owned = []


def mapper_for(task_runner: str, dask_settings=None, processes: bool = True):
    """LocalMapper for ``task_runner: local``; DaskMapper from the profile's ``dask`` settings."""
    if task_runner == "local":
        return LocalMapper()
    if task_runner == "dask":
        s = dask_settings
        return DaskMapper(address=getattr(s, "address", None), n_workers=getattr(s, "n_workers", 2),
                          threads_per_worker=getattr(s, "threads_per_worker", 1), processes=processes)
    raise ValueError(f"task_runner must be 'local' or 'dask', not {task_runner!r}")
