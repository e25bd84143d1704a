"""Slot key/value storage: one row per request slot, each at its own length, in buffers that grow on demand.

`SlotKV` holds, per layer, keys and values of shape (slots, kv_heads, capacity, head_dim). A batched forward
over slots [lo, hi) writes its new keys/values at each row's own positions (`plan`) and attends over the
first `width` positions of those rows — a view, never a copy; the 4-D mask hides what a row must not see.
`TargetKV` plugs the same storage into a Hugging Face model forward as its `cache`.
`StaticSlotKV` is the compiled step core's: reserved once, addresses fixed for the engine's life.
"""

from __future__ import annotations

import ctypes
import functools
import mmap

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from jetflow.errors import InvalidSettingError
from jetflow.stepcore.buckets import key_window

# Capacity grows in steps of this many positions, for every slot at once (the buffers are (slots, ..)). 128
# rather than 256: the engine benchmark's 16 requests (prompts up to 276 tokens, 64 new) fit 384 positions
# instead of 512, a replica's peak RSS falls with it (BENCHMARKS.md), and a running stream's gaps while a
# 2,048-token prompt grows the buffers did not change (HISTORY, "Replica memory").
GROW = 128
RELEASE_ABOVE = 512  # an idle engine gives back buffers grown past this many positions


def return_freed_memory(device: torch.device) -> None:
    """Hand the heap's free pages back to the OS after the buffers were regrown or released (CPU, glibc).
    Slot buffers of a few MB come from the heap once glibc has raised its mmap threshold (it does after the
    first large free), and a freed buffer in the middle of the heap stays in the process's RSS until
    `malloc_trim`; without it a replica's RSS is its peak forever, whatever `release` gives back."""
    if device.type != "cpu":
        return
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc():
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (macOS, musl without the symbol)
        return None


class SlotKV:
    """Keys/values of `num_layers` layers for `slots` rows."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_len: int):
        self.num_layers, self.slots, self.kv_heads, self.head_dim = num_layers, slots, kv_heads, head_dim
        self.dtype, self.device, self.max_len = dtype, device, max_len
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.reserve(min(GROW, max_len))

    def reserve(self, length: int) -> None:
        """Make room for `length` positions per row (rounded up to GROW, at most max_len)."""
        if length <= self.capacity:
            return
        if length > self.max_len:
            raise ValueError(f"slot length {length} exceeds max_len {self.max_len}")
        cap = min(self.max_len, -(-length // GROW) * GROW)
        shape = (self.slots, self.kv_heads, cap, self.head_dim)
        # one buffer at a time, each old one dropped once copied: growing holds one layer twice, not all
        for bufs in (self.keys, self.values):
            for i in range(self.num_layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(bufs):
                    new[:, :, : self.capacity] = bufs[i]
                    bufs[i] = new
                else:
                    bufs.append(new)
        self.capacity = cap
        return_freed_memory(self.device)

    def release(self) -> None:
        """Shrink back to the initial capacity (all slots free): a long prompt does not pin memory forever."""
        self.capacity, self.keys, self.values = 0, [], []
        self.reserve(min(GROW, self.max_len))  # which hands the dropped buffers back (return_freed_memory)

    def rows(self, layer: int, lo: int, hi: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of rows [lo, hi), positions [0, width)."""
        return self.keys[layer][lo:hi, :, :width], self.values[layer][lo:hi, :, :width]

    def write(self, layer: int, lo: int, hi: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (b, kv_heads, n, head_dim) into rows [lo, hi) at positions (b, n)."""
        index = positions[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
        self.keys[layer][lo:hi].scatter_(2, index, k)
        self.values[layer][lo:hi].scatter_(2, index, v)

    def keep(self, lo: int, starts: torch.Tensor, src: torch.Tensor, dst_count: int) -> None:
        """Compaction after acceptance, for rows lo .. lo + len(starts): row i keeps its positions
        starts[i] + src[i, j] as starts[i] + j (src (b, m) long, ascending per row; a row that keeps fewer than m
        repeats its last position, which lands beyond its new length)."""
        hi = lo + starts.shape[0]
        gather = (starts[:, None] + src)[:, None, :, None].expand(-1, self.kv_heads, -1, self.head_dim)
        put = (starts[:, None] + torch.arange(dst_count, device=starts.device))[:, None, :, None].expand_as(gather)
        for buf in self.keys + self.values:
            rows = buf[lo:hi]
            rows.scatter_(2, put, rows.gather(2, gather))

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        for buf in self.keys + self.values:
            buf[dst, :, :length] = buf[src, :, :length]

    def swap_slots(self, a: int, b: int, length: int) -> None:
        for buf in self.keys + self.values:
            tmp = buf[a, :, :length].clone()
            buf[a, :, :length] = buf[b, :, :length]
            buf[b, :, :length] = tmp

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class StaticSlotKV(SlotKV):
    """Slot KV reserved once for the engine's life (the compiled step core's), so every buffer keeps its address
    across all steps, as the compiled graphs' writes into it expect.

    Capacity: `max_len` rounded up to 256 positions (`jetflow.stepcore.buckets.key_window`), plus one scratch position
    (index `capacity`) where padding rows and nodes write and no row reads. On a CPU the buffers are anonymous
    memory maps: the kernel hands out zero pages as positions are first written, so the resident size follows
    the tokens actually held, not the reservation (a read of a never-written position maps the shared zero page;
    the maps opt out of transparent huge pages, so residency grows by 4 KiB pages),
    and `release` gives the pages back (madvise DONTNEED: zeros again, same addresses). On a GPU the reservation
    is the memory: size `max_len` (the engine's max_model_len) to the card."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_len: int):
        self.num_layers, self.slots, self.kv_heads, self.head_dim = num_layers, slots, kv_heads, head_dim
        self.dtype, self.device, self.max_len = dtype, device, max_len
        self.capacity = key_window(max_len)
        shape = (slots, kv_heads, self.capacity + 1, head_dim)
        if device.type == "cuda":
            need, free = self.resident_hint * slots * (self.capacity + 1), torch.cuda.mem_get_info(device)[0]
            if need > free:
                raise InvalidSettingError(
                    f"graphs=compile reserves the slot KV once: {need / 2**30:.1f} GiB for {slots} slots × "
                    f"{self.capacity} positions, more than the {free / 2**30:.1f} GiB free on this GPU; set "
                    "max_model_len (Serve: max_prompt_tokens + max_tokens) or fewer slots")
        self.keys = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.values = [_zeros(shape, dtype, device) for _ in range(num_layers)]

    @property
    def scratch(self) -> int:
        """The position padding writes to: one past the capacity, outside every attention window."""
        return self.capacity

    def reserve(self, length: int) -> None:
        if length > self.max_len:
            raise ValueError(f"slot length {length} exceeds max_len {self.max_len}")

    def release(self) -> None:
        """Give the resident pages back (CPU); the buffers stay where they are, zeroed."""
        if self.device.type != "cpu":
            return
        libc = _libc()
        if libc is None or not hasattr(libc, "madvise"):
            return
        for buf in self.keys + self.values:
            libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(buf.numel() * buf.element_size()),
                         _MADV_DONTNEED)

    @property
    def resident_hint(self) -> int:
        """Bytes of one position of one slot over all layers (keys and values): what a held token costs."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize


_MADV_DONTNEED = 4


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of `shape`; on a CPU an anonymous private map, page-aligned and resident only where written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # where THP is `always`, one written position would make 2 MB resident
        area.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(area, dtype=dtype).view(shape)  # the tensor keeps the map alive


class _PlannedLayer(DynamicLayer):
    """A cache layer of a HF model that writes into / reads from `SlotKV` rows as the step's plan says."""

    def __init__(self, owner: "TargetKV", index: int):
        super().__init__()
        self.owner, self.index = owner, index

    def update(self, key_states, value_states, *args, **kwargs):
        o = self.owner
        o.store.write(self.index, o.lo, o.hi, o.positions, key_states, value_states)
        self.keys, self.values = o.store.rows(self.index, o.lo, o.hi, o.width)
        return self.keys, self.values


class TargetKV(DynamicCache):
    """The target's slot KV as a Hugging Face cache: `plan(lo, hi, positions, width)` before each forward."""

    def __init__(self, store: SlotKV):
        super().__init__()
        self.store = store
        self.layers = [_PlannedLayer(self, i) for i in range(store.num_layers)]
        self.lo = self.hi = self.width = 0
        self.positions: torch.Tensor | None = None

    def plan(self, lo: int, hi: int, positions: torch.Tensor, width: int) -> "TargetKV":
        """The next forward covers rows [lo, hi); its n tokens per row go to `positions` (b, n) and attention
        reads positions [0, width)."""
        if width > self.store.capacity:
            for layer in self.layers:  # the last forward's views would keep the old buffers alive while growing
                layer.keys = layer.values = None
        self.store.reserve(width)
        self.lo, self.hi, self.positions, self.width = lo, hi, positions, width
        return self
