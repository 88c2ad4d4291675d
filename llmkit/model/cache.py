"""The KV cache: per-layer key/value buffers written in place, and the decoding position."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from llmkit.model.transformer import Transformer

__all__ = ["KVCache", "LayerCache"]


class LayerCache:
    """Keys and values of one layer in preallocated buffers (B, Hkv, capacity, D).

    Without a window the buffers grow geometrically (doubling) and usually never grow at
    all: :meth:`Transformer.new_cache` takes a ``capacity`` hint. With a ``window`` W the
    layer keeps only the last W keys in a rolling buffer of W + S slots: new keys are
    written after the kept ones, and when the buffer is full the last W are moved to the
    front (one O(W) copy every S tokens, S = min(W, 128)). Keys therefore stay in
    chronological order, as the kernel contract (bottom-right alignment, distance biases,
    padding masks) requires, and memory never grows with the generated length.

    An optional boolean ``mask`` buffer (B, capacity), True = real token, follows the keys
    once any update brings a key padding mask (left-padded batches).
    """

    #: Free slots a windowed buffer keeps beyond its window (at most; ≤ W).
    WINDOW_SLACK = 128

    def __init__(self, window: int | None = None, capacity: int | None = None) -> None:
        self.window = window
        self.capacity_hint = capacity
        self.k: Tensor | None = None  # buffers; valid entries are [start, end)
        self.v: Tensor | None = None
        self.mask: Tensor | None = None
        self.start = 0
        self.end = 0

    @property
    def length(self) -> int:
        """Keys kept (at most ``window`` for a windowed layer)."""
        return self.end - self.start

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def keys(self) -> tuple[Tensor, Tensor]:
        """Views of the kept keys and values (B, Hkv, length, D)."""
        if self.k is None or self.v is None:
            raise ValueError("the cache is empty")
        return self.k[:, :, self.start : self.end], self.v[:, :, self.start : self.end]

    def _initial_capacity(self, t: int) -> int:
        if self.window is not None:
            cap = self.window + min(self.window, self.WINDOW_SLACK)
            if self.capacity_hint is not None:
                cap = min(cap, max(self.capacity_hint, self.window))
            return cap
        return max(t, self.capacity_hint or 0, 16)

    def _allocate(self, like: Tensor, capacity: int, rows: int | None = None) -> None:
        b, h, _, d = like.shape
        shape = (rows or b, h, capacity, d)
        k = like.new_empty(shape)
        v = like.new_empty(shape)
        mask = None
        if self.mask is not None:
            mask = torch.ones(shape[0], capacity, dtype=torch.bool, device=like.device)
        n = self.length
        if self.k is not None and n:
            k[:, :, :n] = self.k[:, :, self.start : self.end]
            v[:, :, :n] = self.v[:, :, self.start : self.end]
            if mask is not None and self.mask is not None:
                mask[:, :n] = self.mask[:, self.start : self.end]
        self.k, self.v, self.mask = k, v, mask
        self.start, self.end = 0, n

    def _compact(self) -> None:
        """Move the kept keys to the front of the buffers (windowed layers)."""
        n, s = self.length, self.start
        if s == 0:
            return
        for buf in (self.k, self.v):
            src = buf[:, :, s : s + n]
            buf[:, :, :n] = src.clone() if s < n else src  # overlapping ranges need a copy
        if self.mask is not None:
            src = self.mask[:, s : s + n]
            self.mask[:, :n] = src.clone() if s < n else src
        self.start, self.end = 0, n

    def _ensure_mask(self, rows: int, device: torch.device) -> Tensor:
        if self.mask is None:
            self.mask = torch.ones(rows, self.capacity, dtype=torch.bool, device=device)
        return self.mask

    def update(
        self, k: Tensor, v: Tensor, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store new keys/values (B, Hkv, T, D) and, optionally, their padding mask (B, T).

        Returns every key the new queries may see, the new ones last, with the matching
        padding mask (None when no mask was ever given)."""
        t = k.shape[2]
        if self.k is None:
            self._allocate(k, self._initial_capacity(t))
        assert self.k is not None and self.v is not None
        if self.window is not None and self.length + t > self.capacity:
            return self._update_wide(k, v, mask)
        if self.end + t > self.capacity:
            if self.window is not None:
                self._compact()
            else:
                self._allocate(k, max(2 * self.capacity, self.end + t))
        lo, s, e = self.start, self.end, self.end + t
        self.k[:, :, s:e] = k
        self.v[:, :, s:e] = v
        if mask is not None or self.mask is not None:
            buf = self._ensure_mask(k.shape[0], k.device)
            buf[:, s:e] = True if mask is None else mask
        self.end = e
        if self.window is not None:
            self.start = max(lo, e - self.window)
        out_mask = None if self.mask is None else self.mask[:, lo:e]
        return self.k[:, :, lo:e], self.v[:, :, lo:e], out_mask

    def _update_wide(
        self, k: Tensor, v: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """A chunk too large for a windowed buffer: attend over kept + new, keep the last W."""
        assert self.k is not None and self.v is not None and self.window is not None
        old_k, old_v = self.keys()
        k_all, v_all = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        m_all = None
        if mask is not None or self.mask is not None:
            b, t = k.shape[0], k.shape[2]
            old_m = (
                self.mask[:, self.start : self.end]
                if self.mask is not None
                else torch.ones(b, self.length, dtype=torch.bool, device=k.device)
            )
            new_m = (
                mask if mask is not None else torch.ones(b, t, dtype=torch.bool, device=k.device)
            )
            m_all = torch.cat([old_m, new_m.to(torch.bool)], dim=1)
        n = min(self.window, k_all.shape[2])
        self.k[:, :, :n] = k_all[:, :, -n:]
        self.v[:, :, :n] = v_all[:, :, -n:]
        if m_all is not None:
            self._ensure_mask(k.shape[0], k.device)[:, :n] = m_all[:, -n:]
        self.start, self.end = 0, n
        return k_all, v_all, m_all

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (B',) in that order (beam search, finished rows)."""
        if self.k is None or self.v is None:
            return
        self.k = self.k.index_select(0, index)
        self.v = self.v.index_select(0, index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)

    @property
    def rows(self) -> int:
        return 0 if self.k is None else self.k.shape[0]

    def trim(self) -> None:
        """Forget the leading kept columns that are padding in every row (rows that left a
        continuous batch held them): later steps read fewer keys."""
        if self.mask is None or self.length == 0:
            return
        live = self.mask[:, self.start : self.end].any(0)
        self.start += int(live.numel()) if not bool(live.any()) else int(live.int().argmax())

    @classmethod
    def concatenate(cls, parts: list[LayerCache]) -> LayerCache:
        """One layer cache holding the rows of ``parts`` (each non-empty, one kind of layer)
        in order, their kept keys right-aligned: a shorter part is left-padded (masked)."""
        first = parts[0]
        if any(p.k is None or p.v is None for p in parts):
            raise ValueError("only caches that hold keys can be concatenated")
        n = max(p.length for p in parts)
        out = cls(first.window, first.capacity_hint)
        like = first.k
        assert like is not None
        capacity = out._initial_capacity(n) if first.window is not None else n
        if first.window is None:
            capacity = max(capacity, max(p.capacity for p in parts), 16)
        _, h, _, d = like.shape
        rows = sum(p.rows for p in parts)
        # zeros, not empty memory: a masked key's value is multiplied by a zero weight, and
        # NaN garbage would survive that
        k = like.new_zeros((rows, h, capacity, d))
        v = like.new_zeros((rows, h, capacity, d))
        ragged = any(p.mask is not None or p.length != n for p in parts)
        mask = torch.zeros(rows, capacity, dtype=torch.bool, device=like.device) if ragged else None
        r = 0
        for p in parts:
            assert p.k is not None and p.v is not None
            b, length = p.rows, p.length
            k[r : r + b, :, n - length : n] = p.k[:, :, p.start : p.end]
            v[r : r + b, :, n - length : n] = p.v[:, :, p.start : p.end]
            if mask is not None:
                if p.mask is None:
                    mask[r : r + b, n - length : n] = True
                else:
                    mask[r : r + b, n - length : n] = p.mask[:, p.start : p.end]
            r += b
        out.k, out.v, out.mask, out.start, out.end = k, v, mask, 0, n
        return out

    def nbytes(self) -> int:
        """Bytes of the allocated buffers."""
        total = 0
        for buf in (self.k, self.v, self.mask):
            if buf is not None:
                total += buf.numel() * buf.element_size()
        return total


class KVCache:
    """Per-layer caches plus the position of the next token.

    ``position`` counts every token fed so far (padding included); ``seen`` (B,) counts
    each row's real tokens once a key padding mask has been given (left padding), so the
    next token of row b sits at position ``seen[b]``.
    """

    def __init__(self, model: Transformer, capacity: int | None = None) -> None:
        self.layers = [
            LayerCache(attn.kernel.cache_window, capacity) for attn in model.attention_modules
        ]
        self.position = 0
        self.seen: Tensor | None = None

    @property
    def key_padding_mask(self) -> Tensor | None:
        """The padding mask of the keys the first layer keeps (True = real token)."""
        layer = self.layers[0] if self.layers else None
        if layer is None or layer.mask is None:
            return None
        return layer.mask[:, layer.start : layer.end]

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` in that order, in every layer."""
        for layer in self.layers:
            layer.reorder(index)
        if self.seen is not None:
            self.seen = self.seen.index_select(0, index)

    @property
    def rows(self) -> int:
        """Batch rows held (0 before the first update)."""
        return self.layers[0].rows if self.layers else 0

    def row_positions(self) -> Tensor:
        """(rows,) the position of each row's next token."""
        if self.seen is not None:
            return self.seen
        device = self.layers[0].k.device if self.layers and self.layers[0].k is not None else None
        return torch.full((self.rows,), self.position, dtype=torch.long, device=device)

    def select(self, index: Tensor) -> None:
        """Keep rows ``index`` and forget the leading columns left holding only padding
        (a continuous batch after some rows finished)."""
        self.reorder(index)
        for layer in self.layers:
            layer.trim()

    @classmethod
    def concatenate(cls, caches: list[KVCache]) -> KVCache:
        """The rows of ``caches`` (of one model, each fed at least one token) as one cache:
        each row keeps its own positions, shorter contexts are left-padded and masked, so
        one batched step continues every row as if it were alone (continuous batching)."""
        if not caches:
            raise ValueError("nothing to concatenate")
        if len({len(c.layers) for c in caches}) != 1:
            raise ValueError("caches of different models cannot be concatenated")
        out = cls.__new__(cls)
        out.layers = [
            LayerCache.concatenate([c.layers[j] for c in caches])
            for j in range(len(caches[0].layers))
        ]
        out.position = max(c.position for c in caches)
        out.seen = torch.cat([c.row_positions() for c in caches])
        return out

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)
