"""How a rank writes its checkpoint files: megatron-core's save request, run here.

``dist_checkpointing.save(..., async_sharded_save=True)`` plans the save (collectives, and
``common.pt`` on rank 0) and returns the rest as an ``AsyncRequest``: the write of this
rank's files, then, on every rank, a barrier and the finalisation (PyTorch's ``.metadata``,
``metadata.json``). :func:`run` does with it what megatron-core's synchronous save does
(``AsyncRequest.execute_sync``), with two differences:

* On the CPU the rank writes its files in its own process, one after the other
  (:func:`write_in_process`), instead of in writer processes megatron-core forks for each
  save (``write_preloaded_data_multiproc``, ``fork`` start method). A rank runs dozens of
  threads by then (gloo's, the queues'), and a forked child inherits any lock one of them
  held at that moment, held for ever. On GPUs the forked writers stay: they write a
  rank's large files in parallel.
* The write is watched (:func:`~megatron.training.checkpoint.writer_watch.writers_watched`):
  a writer that dies, or makes no progress for ``stall_s`` seconds, ends the save with an
  error instead of a hang. Only the write: the collectives around it have the
  distributed timeout.
"""

from __future__ import annotations

import contextlib
import functools
import queue
from typing import Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from megatron.training.checkpoint.writer_watch import writers_watched
from megatron.training.cpu_shims import cuda_requests_on_cpu


def write_in_process(transform_list: list, use_msc: bool, rank: int, write_buckets: List,
                     results_queue) -> None:
    """megatron-core's ``write_preloaded_data_multiproc`` (same arguments) without its
    processes: this process writes each bucket's file with the function those processes
    run (``write_preloaded_data``: the file, fsync-ed), one after the other, then puts
    ``{bucket: write results}``, or the first bucket's error, on ``results_queue``."""
    del rank  # (megatron-core's processes only log it)
    results: Union[Dict[int, list], Exception] = {}
    done, count = queue.Queue(), queue.Queue()   # how write_preloaded_data reports
    extra = {"use_msc": True} if use_msc else {}
    for i, bucket in enumerate(write_buckets):
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, done, count,
                                                   True, **extra)
        _, written = done.get()
        if isinstance(written, Exception):
            results = written
            break
        results[i] = written
    results_queue.put(results)


def in_process(write: Callable) -> Optional[Callable]:
    """:func:`write_in_process` with the arguments megatron-core bound to its write function
    ``write``, or None when ``write`` is not that function (another megatron-core)."""
    if (isinstance(write, functools.partial) and not write.keywords and len(write.args) == 2
            and write.func is FileSystemWriterAsync.write_preloaded_data_multiproc):
        return functools.partial(write_in_process, *write.args)
    return None


def _server_pid(proxy) -> Optional[int]:
    """The pid of the multiprocessing ``Manager`` process serving ``proxy`` (megatron-core's
    results queue), None when it cannot be told."""
    process = getattr(getattr(proxy, "_manager", None), "_process", None)
    return getattr(process, "pid", None)


def run(request: AsyncRequest, own_process: bool, stall_s: Optional[float],
        last_words: Optional[Callable[[BaseException], str]] = None) -> None:
    """Write this rank's files of ``request`` (``own_process``: in this process when
    megatron-core's writer is the one :func:`in_process` knows), watched with ``stall_s``
    and ``last_words`` (:func:`writers_watched`), then the barrier and the finalisation.
    Collective. Without CUDA, megatron-core's staging and finalisation (written for a CUDA
    device) run in the CPU shims' mode, as its synchronous save does there (``cpu_shims``
    wraps ``dist_checkpointing.save``)."""
    cpu = not torch.cuda.is_available()
    with cuda_requests_on_cpu() if cpu else contextlib.nullcontext():
        args = list(request.async_fn_args)
        if request.preload_fn is not None:
            args[1] = request.preload_fn()   # the write buckets, their tensors in host memory
        if request.async_fn is not None:
            write = (in_process(request.async_fn) if own_process else None) or request.async_fn
            files = [bucket[0] for bucket in args[1]]
            server = _server_pid(args[2]) if len(args) > 2 else None
            with writers_watched(stall_s, files, [server] if server else [], dist.get_rank(),
                                 last_words):
                write(*args, **request.async_fn_kwargs)
        dist.barrier()
        for finalize in request.finalize_fns:
            finalize()


__all__ = ["in_process", "run", "write_in_process"]
