"""What a forward reads on the device, and how it gets there: the slot pool's copies and the slot map.

DeviceSlots owns the expert cache's device side: the copy stream that fills slots (one event a batch, waited for
by the compute that reads them), the last compute that read each layer's slots (a copy evicting one waits for it),
and the device state a forward reads: per layer, the slot map (expert -> slot of the experts ready to compute, -1:
not), so that a layer's hits are computed without the host, then the capture table (the slots a mapped forward may
write its misses into). The host keeps a mirror of that state; between forwards it writes the whole state in one
copy when it changed, and inside an offloaded forward a layer's row of the slot map (sync).
Staging holds the reused host and device buffers that activations and slot lists cross PCIe through.
"""
from __future__ import annotations

import numpy as np
import torch

from .residency import Residency
from .store import ExpertStore
from .timer import Sections


class Staging:
    """Reused buffers by name: pinned host ones (on CUDA: no pageable copy in the hot path) and int64 device ones."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.buffers: dict[str, torch.Tensor] = {}

    def host(self, name: str, shape, dtype) -> torch.Tensor:
        """Reused host buffers for activations crossing PCIe (pinned on CUDA: no pageable copy in the hot path)."""
        numel = int(np.prod(shape))
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=self.cuda)
            self.buffers[name] = buf
        return buf[:numel].view(*shape)

    def device_int64(self, name: str, numel: int) -> torch.Tensor:
        """A reused int64 device buffer (the eager path's first-wave slots)."""
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name] = torch.empty(numel, dtype=torch.int64, device=self.device)
        return buf[:numel]


class DeviceSlots:
    def __init__(self, store: ExpertStore, residency: Residency, device: torch.device, sections: Sections,
                 capture: int):
        """capture: the capture table's slots a layer (0: no capture table)."""
        self.store, self.residency, self.cache = store, residency, residency.cache
        self.device, self.cuda, self.sections = device, device.type == "cuda", sections
        self.layer_pos = store.layer_pos
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.layer_done: dict[int, torch.cuda.Event] = {}      # last compute that read a layer's slots
        self.pending_copy: dict[int, torch.cuda.Event] = {}    # slot -> copy event not yet waited for
        self.last_copy: torch.cuda.Event | None = None         # the copy stream's last event: covers every copy
        self.changed: set[int] = set()     # layers whose residency or readiness changed since their row of the
                                           # device slot map was last written
        self.place_initial()
        E, layers = store.config.num_experts, len(store.layers)
        # The host's mirror (`ready`, `capture_host`: views of `state_host`) and the device state, in one tensor so
        # that one copy writes it between forwards (write)
        self.state_host = np.full((layers, E + capture), -1, dtype=np.int64)
        self.ready, self.capture_host = self.state_host[:, :E], self.state_host[:, E:]
        self.ready[...] = self.cache.table        # the initial placement's copies were waited for
        self.device_state = torch.tensor(self.state_host, device=self.device)     # a copy, on the CPU too
        self.slot_map = self.device_state[:, :E]
        self.capture_table = self.device_state[:, E:] if capture else None
        # two pinned copies of the state used in turn, each with the event of its last copy, waited for before the
        # copy is written again (two writes later: long done, so a guard rather than a wait)
        self.state_staging = (torch.empty((2, *self.state_host.shape), dtype=torch.int64, pin_memory=True)
                              if self.cuda else None)
        self.state_copied = [torch.cuda.Event() for _ in range(2)] if self.cuda else None
        self.state_flip = 0
        self.dirty = False                        # the mirror differs from what the device state was last written
        self.slot_staging = (torch.empty((layers, 2, E), dtype=torch.int64, pin_memory=True) if self.cuda else None)
        self.slot_flip = [0] * layers
        self.changed.clear()                      # the map was just built from the tables

    # ----------------------------------------------------------------------------------------------- copies
    def place_initial(self) -> None:
        for layer, experts, slots in self.residency.place_initial():
            self.copy(layer, experts, slots, wait_layer=False)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
            self.pending_copy.clear()

    def copy(self, layer: int, experts: list[int], slots: list[int], wait_layer: bool = True) -> None:
        """Copy experts' blobs into slots on the copy stream; one event covers the batch."""
        if not experts:
            return
        self.changed.add(layer)                   # slots were taken for them (evicting others)
        if not self.cuda:
            for e, s in zip(experts, slots):
                self.cache.pool[s].copy_(self.store.blob(layer, e))
            return
        with torch.cuda.stream(self.copy_stream):
            if wait_layer and layer in self.layer_done:   # a victim slot may still be read by an earlier compute
                self.copy_stream.wait_event(self.layer_done[layer])
            with self.sections("h2d_copy"):               # events on the copy stream: the copy path's own time
                for e, s in zip(experts, slots):
                    self.cache.pool[s].copy_(self.store.blob(layer, e), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self.last_copy = event
        for s in slots:
            self.pending_copy[s] = event

    def wait_copies(self, slots: np.ndarray) -> None:
        if not self.pending_copy:
            return
        events = {id(ev): ev for s in slots.tolist() if (ev := self.pending_copy.pop(s, None)) is not None}
        if events:
            with self.sections("copy_wait"):
                stream = torch.cuda.current_stream(self.device)
                for ev in events.values():
                    stream.wait_event(ev)

    def mark_layer_done(self, layer) -> None:
        """The last compute that reads this layer's slots, so that a copy evicting one of them waits for it."""
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
            self.layer_done[layer] = done

    def pool(self, layer) -> tuple[int, torch.Tensor]:
        """The layer's first slot and its slots' rows of the pool."""
        base = self.layer_pos[layer] * self.cache.capacity
        return base, self.cache.pool[base:base + self.cache.capacity]

    # ----------------------------------------------------------------------------------- the device state
    def prepare(self, mapped: bool, armed: set[int] | None = None) -> None:
        """The device state a forward reads: the slot map settled, and the capture table armed for a mapped one,
        written in one copy when it changed (capture changes most layers' rows every forward, so one copy per changed
        layer would cost host time a forward). armed: the layers armed for this forward already (a mapped forward's
        decisions arm each as they go); None: every layer is armed here."""
        self.settle()
        if self.capture_table is not None:
            rest = None if armed is None else [layer for layer in self.residency.layers if layer not in armed]
            self.arm_capture(self.residency.arm_capture(mapped, rest))
        if self.dirty:
            self.write()

    def write(self) -> None:
        """The host's mirror of the device state (slot map and capture table) copied to the device in one copy,
        queued on the current stream: the next forward reads it, the forward before it read the old state."""
        self.dirty = False
        if not self.cuda:
            self.device_state.copy_(torch.from_numpy(self.state_host))
            return
        self.state_flip ^= 1
        staging, copied = self.state_staging[self.state_flip], self.state_copied[self.state_flip]
        copied.synchronize()
        staging.numpy()[...] = self.state_host
        self.device_state.copy_(staging, non_blocking=True)
        copied.record()

    def arm_capture(self, armed: dict[int, list[int]]) -> None:
        """The capture table's mirror for the next forward: the rows of the layers armed (Residency.arm_capture),
        each its armed slots then -1; the others' rows as they were. Not on the mapped path: nothing reads it."""
        for layer, slots in armed.items():
            row = self.capture_host[self.layer_pos[layer]]
            n = len(slots)
            if row[:n].tolist() != slots or (row[n:] != -1).any():
                row[:n] = slots
                row[n:] = -1
                self.dirty = True

    def settle(self) -> None:
        """Before a forward: the compute waits for the copies decided since the last one, then the slot map's mirror
        is brought up to date for every layer that changed, so each forward starts with the slot tables and the map
        equal (once prepare writes it)."""
        if self.cuda and self.pending_copy:       # the copy stream runs in order: its last event covers the others
            torch.cuda.current_stream(self.device).wait_event(self.last_copy)
        self.pending_copy.clear()
        # every resident is ready now: the map is the tables (kept as an array beside them, ExpertCache.table)
        if self.changed and not np.array_equal(self.cache.table, self.ready):
            self.ready[...] = self.cache.table
            self.dirty = True
        self.changed.clear()

    def slot_row(self, layer) -> np.ndarray:
        """The slot map's row of `layer` as the tables have it: its resident experts whose copies the compute has
        waited for (a prefetched expert is listed once a layer's compute waited for its copy)."""
        row = self.cache.table[self.layer_pos[layer]].copy()
        if self.pending_copy:
            row[np.isin(row, np.fromiter(self.pending_copy, np.int64, len(self.pending_copy)))] = -1
        return row

    def sync(self, layer) -> None:
        """Inside an offloaded forward: the device slot map's row of `layer`, copied when it changed."""
        if layer not in self.changed:
            return
        self.changed.discard(layer)
        pos = self.layer_pos[layer]
        row = self.slot_row(layer)
        if np.array_equal(row, self.ready[pos]):
            return
        self.ready[pos] = row
        if not self.cuda:
            self.slot_map[pos].copy_(torch.from_numpy(row))
            return
        # Two pinned rows per layer, used in turn: a row is written again only after the host waited for a later
        # read-back on the same stream (at most two updates of a layer's row come between two such waits: its own
        # decisions and finish), so its previous copy has completed.
        self.slot_flip[pos] ^= 1
        staging = self.slot_staging[pos, self.slot_flip[pos]]
        staging.copy_(torch.from_numpy(row))
        self.slot_map[pos].copy_(staging, non_blocking=True)
