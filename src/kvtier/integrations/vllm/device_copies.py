"""The worker's copies when vLLM's KV cache is on a CUDA device: off the compute stream, no device-wide sync.

Saves (device -> host): when the forward leaves layer l, an event is recorded on the compute stream; a side
stream waits for it, gathers the step's blocks of that layer on the device (`index_select` into a reused
device buffer), and copies them into the step's pinned host slab (`non_blocking`); `finish_saves` waits for
the last layer's copy event only, before the slab goes to the writer thread.
Loads (host -> device): verified blocks are packed into a reused pinned buffer (a CPU memcpy on the loader
thread), copied up on the side stream (`non_blocking`) and scattered into the cache (`index_put_`) there; an
event per layer is recorded, and the compute stream waits for layer l's event just before its attention
(`wait_layer`: a stream wait, the host does not block). An async load's block goes up the same way, every
layer at once (`copy_block_in`), the loader thread waiting for it. Nothing here calls `.numpy()` or `.item()` on a
device tensor. On a CPU cache the same calls run synchronously (used by the tests here).
"""

from __future__ import annotations

import torch


class DeviceCopies:
    def __init__(self, device: torch.device, num_layers: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._save_events = [None] * num_layers
        self._load_events = [None] * num_layers
        self._device_buf = torch.empty(0, dtype=torch.uint8, device=device)  # gathers, reused
        self._pinned_buf = torch.empty(0, dtype=torch.uint8, pin_memory=self.cuda)  # loads, reused

    def host_slab(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor the device copies into (pinned on CUDA, so the copies are asynchronous; torch's
        caching host allocator hands the same pinned blocks out again once a step's slab is freed)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    # -- saves ----------------------------------------------------------------------------------
    def copy_out(self, view: torch.Tensor, index: torch.Tensor, out: torch.Tensor, layer: int) -> None:
        """out[i] = view[index[i]] (out on the host), ordered after what the compute stream did so far."""
        if not self.cuda:
            torch.index_select(view, 0, index, out=out)
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            gathered = self._scratch(out.shape, out.dtype)
            torch.index_select(view, 0, index.to(self.device, non_blocking=True), out=gathered)
            out.copy_(gathered, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._save_events[layer] = done

    def finish_saves(self) -> None:
        """Every `copy_out` of the step has landed in host memory (waits for those copies only)."""
        for event in self._save_events:
            if event is not None:
                event.synchronize()
        self._save_events = [None] * len(self._save_events)

    def _scratch(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        num_bytes = torch.Size(shape).numel() * dtype.itemsize
        if self._device_buf.numel() < num_bytes:
            self._device_buf = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        return self._device_buf[:num_bytes].view(dtype).view(shape)

    # -- loads ----------------------------------------------------------------------------------
    def copy_in(self, view: torch.Tensor, index: torch.Tensor, blocks: list[torch.Tensor], layer: int) -> None:
        """view[index[i]] = blocks[i] (host tensors); on CUDA asynchronous, `wait_layer(layer)` orders a use."""
        if not self.cuda:  # each block straight into its device block (a stack first copies twice: 1.4x slower)
            for block_id, block in zip(index.tolist(), blocks):
                view[block_id].copy_(block)
            return
        shape, dtype = (len(blocks), *blocks[0].shape), blocks[0].dtype
        num_bytes = torch.Size(shape).numel() * dtype.itemsize
        if self._pinned_buf.numel() < num_bytes:  # every earlier upload from it has completed (below)
            self._pinned_buf = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(self.stream):
            staged = self._pinned_buf[:num_bytes].view(dtype).view(shape)
            torch.stack(blocks, out=staged)
            device_blocks = staged.to(self.device, non_blocking=True)
            view[index.to(self.device, non_blocking=True)] = device_blocks  # index_put_: a strided view too
            done = torch.cuda.Event()
            done.record(self.stream)
            done.synchronize()  # the loader thread (not the forward) waits: the next layer reuses the buffer
        self._load_events[layer] = done

    def copy_block_in(self, views: list[torch.Tensor], block_id: int, block: torch.Tensor) -> None:
        """views[l][block_id] = block[l] for every layer (an async load: nothing reads the block before
        the load is reported, so this returns once its copies have landed)."""
        if not self.cuda:
            for layer, view in enumerate(views):
                view[block_id].copy_(block[layer])
            return
        num_bytes = block.numel() * block.dtype.itemsize
        if self._pinned_buf.numel() < num_bytes:
            self._pinned_buf = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(self.stream):
            staged = self._pinned_buf[:num_bytes].view(block.dtype).view(block.shape)
            staged.copy_(block)
            device_block = staged.to(self.device, non_blocking=True)
            for layer, view in enumerate(views):
                view[block_id].copy_(device_block[layer], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
            done.synchronize()  # the loader thread waits (the next block reuses the buffer), not the forward

    def wait_layer(self, layer: int) -> None:
        """The compute stream waits for layer `layer`'s load (no host wait)."""
        event = self._load_events[layer]
        if self.cuda and event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
