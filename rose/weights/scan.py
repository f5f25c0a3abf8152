"""Finding and writing the changed elements of a shard: numpy kernels for host buffers, torch
kernels for tensors that live on a device (the trainer's GPU).

Both sides of the weight stream spend their time here. The sender reads each shard once, in
L2-sized blocks: compare 8-byte words, refine only the changed words into units (elements of
the shard's narrowest dtype), update its view of the receiver and feed the checksum while the
block is in cache. The receiver writes the changed units back block by block and checksums each
block while it is in cache. Why this layout and what bounds its speed: docs/weights.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
BLOCK = 512 << 10  # shard bytes handled at a time: both sides and the temporaries stay in L2
_SHIFT = {1: 3, 2: 2, 4: 1, 8: 0}  # log2(units per 8-byte word)


def changed(
    old: np.ndarray, new: np.ndarray, unit: int, *, update: bool = False, digest=None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions (in units) of the elements of shard bytes `old` and `new` that differ, with
    their old and new units, in one pass in cache-sized blocks.

    Per block: feed `new` to `digest` (an xxh3 state), compare 8-byte words, refine only the
    changed words into units and, with `update`, copy the changed words into `old`.
    """
    wo, wn = old.view(np.uint64), new.view(np.uint64)
    kind, shift = UINT[unit], _SHIFT[unit]
    low = (1 << shift) - 1
    step = BLOCK // 8
    ne = np.empty(min(step, len(wo)), dtype=bool)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for s in range(0, len(wo), step):
        a, b = wo[s : s + step], wn[s : s + step]
        if digest is not None:
            digest.update(b)
        mask = ne[: len(a)]
        np.not_equal(a, b, out=mask)
        w = np.flatnonzero(mask)
        if not len(w):
            continue
        ow, nw = a[w], b[w]
        if update:
            a[w] = nw
        if shift:
            ou, nu = ow.view(kind), nw.view(kind)
            k = np.flatnonzero(ou != nu)
            w = w[k >> shift]
            w += s
            w <<= shift
            w |= k & low
            found.append((w, ou[k], nu[k]))
        else:
            w += s
            found.append((w, ow, nw))
    if not found:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=kind), np.zeros(0, dtype=kind)
    if len(found) == 1:
        return found[0]
    return tuple(np.concatenate(parts) for parts in zip(*found))  # type: ignore[return-value]


def write(buf: np.ndarray, unit: int, pos: np.ndarray, values: np.ndarray, combine, digest=None) -> None:
    """Set the units at sorted positions `pos` of shard bytes `buf` to `combine(old units,
    values)`; feed the result to `digest` block by block while the scatter has left each block
    in cache."""
    units = buf.view(UINT[unit])
    if digest is None:
        units[pos] = combine(units[pos], values)
        return
    step = BLOCK // unit
    cuts = np.searchsorted(pos, np.arange(0, len(units) + step, step)).tolist()
    for i, s in enumerate(range(0, len(units), step)):
        a, b = cuts[i], cuts[i + 1]
        if b > a:
            p = pos[a:b]
            units[p] = combine(units[p], values[a:b])
        digest.update(units[s : s + step])


# -- device tensors (torch) ---------------------------------------------------------------


def is_tensor(x: Any) -> bool:
    """A torch tensor (on any device) rather than a numpy buffer."""
    return not isinstance(x, np.ndarray) and type(x).__module__.startswith("torch")


def _units_t(t, unit: int):
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[unit])


def _host(t, unit: int) -> np.ndarray:
    return t.cpu().numpy().view(UINT[unit])


def changed_t(old, new, unit: int, *, update: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`changed` on uint8 tensors (one shard) on any device: the comparison, the index
    extraction and the gathers run there; only the changed elements come back to the host."""
    ou, nu = _units_t(old, unit), _units_t(new, unit)
    idx = (ou != nu).nonzero().squeeze(1)
    o, n = ou[idx], nu[idx]
    if update:
        ou[idx] = n
    return idx.cpu().numpy(), _host(o, unit), _host(n, unit)


def write_t(buf, unit: int, pos: np.ndarray, values: np.ndarray, combine) -> None:
    """`write` into a shard tensor on its device: the changed units come to the host, are
    combined there (the same code as for host buffers) and go back."""
    import torch

    units = _units_t(buf, unit)
    idx = torch.from_numpy(pos).to(units.device)
    new = combine(_host(units[idx], unit), values)
    units[idx] = torch.from_numpy(new.view(SINT[unit]) if unit > 1 else new).to(units.device)


def host_bytes(buf) -> np.ndarray:
    """A shard's bytes on the host: the buffer itself, or a copy of a device tensor."""
    return buf.cpu().numpy() if is_tensor(buf) else buf
