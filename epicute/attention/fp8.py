"""fp8 attention's layouts and scales: what the fp8 forward needs that the bf16 one does not.

FP8 WGMMA reads both operands K-major. For ``S = Q K^T`` that is Q's and K's own layout (head_dim contiguous);
for ``O = P V`` the reduction runs over the keys, so V must be read keys-contiguous, and P's accumulator
registers are not where the register A operand wants them:

- in an ``m64nN`` fp32 accumulator a lane of quad position ``q`` holds, per row and per 16 columns, columns
  ``2q, 2q+1, 8+2q, 9+2q``; an 8-bit A operand wants that lane to hold keys ``4q .. 4q+3`` of each 16;
- rather than shuffle P between lanes on every block, the kernel hands P over *as it lies* (register ``i`` of
  the accumulator becomes slot ``i`` of the operand: no instruction), so slot ``k`` of each 16 carries column
  :func:`key_of_slot` ``(k)``; the value tile's keys are stored in the same order, which costs nothing in the
  one pass that makes V keys-contiguous anyway (:func:`value_layout`).

So V reaches the kernel as ``(batch, heads_kv, head_dim, keys)`` with keys contiguous, padded to a multiple of 16
and permuted within each 16 (:data:`VALUE_SLOT_KEYS`); packed sequences (varlen) each start at a 16-aligned
slot, :func:`value_starts`. On the GPU one kernel makes it (:mod:`epicute.attention.value_layout_sm90`).
``epicute.attention(..., v_layout="slots")`` takes values already in this layout (:func:`value_layout`'s result,
or a paged cache's pages ``(num_pages, page_size, heads_kv, head_dim)`` with the page's slots contiguous), which
is how an fp8 KV cache stores them from the start (``epicute.nn.PagedKVCache(..., dtype=torch.float8_e4m3fn)``: no
pass per call).

Scales follow FlashAttention-3: ``q_descale``, ``k_descale``, ``v_descale`` multiply the dequantized operands,
one per tensor or one per (sequence, key/value head); the kernel folds Q's and K's into the softmax scale and V's
into the final normalization.
"""

from __future__ import annotations

import numbers

import torch

from epicute.errors import ConfigError, DeviceError, DtypeError, ShapeError

#: Input dtypes the fp8 forward takes, and O's default stored dtype for them (FlashAttention-3's).
FP8_INPUT_DTYPES = ("fp8e4m3",)
FP8_OUT_DTYPE = "bf16"
#: Why an fp8 call has no backward (eager and traced calls refuse one with it).
NO_BACKWARD = "fp8 q, k, v: the fp8 forward is for inference"
#: Keys per group of the value permutation (two 8-column chunks of the accumulator, the 16 keys of a
#: quad's operand slots).
KEY_GROUP = 16


def key_of_slot(slot: int) -> int:
    """The score column (key within its 16) that operand slot ``slot`` of the PV WGMMA carries when P is handed
    over register for register: slot ``v0 + 2 j0 + 4 q`` holds accumulator column ``v0 + 2 q + 8 j0``."""
    v0, j0, q = slot & 1, (slot >> 1) & 1, (slot >> 2) & 3
    return v0 + 2 * q + 8 * j0


#: Slot k of every 16 keys in the kernel's value tile holds key ``VALUE_SLOT_KEYS[k]`` of those 16.
VALUE_SLOT_KEYS = tuple(key_of_slot(k) for k in range(KEY_GROUP))


def stored_dtype(dtype: str) -> str:
    """O's stored dtype for inputs of ``dtype`` when nothing else is asked: bf16 for fp8 inputs, else theirs."""
    return FP8_OUT_DTYPE if dtype in FP8_INPUT_DTYPES else dtype


def padded_keys(seqlen: int) -> int:
    """Key slots a value tile of ``seqlen`` keys takes: a whole number of permutation groups."""
    return -(-seqlen // KEY_GROUP) * KEY_GROUP


def value_starts(first_keys: torch.Tensor) -> torch.Tensor:
    """Where packed sequence ``b``'s value slots start: its first key rounded up to a group, plus a group per
    earlier sequence (``pad16(cu[b]) + 16 b``), so every sequence starts aligned and the padded sequences do
    not overlap (``pad16(x) + pad16(y) <= pad16(x + y) + 16``)."""
    batch = torch.arange(first_keys.numel(), device=first_keys.device)
    return (first_keys + KEY_GROUP - 1) // KEY_GROUP * KEY_GROUP + KEY_GROUP * batch


def value_slots(total: int, batch: int) -> int:
    """Slots of a packed value buffer: every sequence's start (:func:`value_starts`) and padding fit."""
    return padded_keys(total) + KEY_GROUP * batch


def value_layout(
    v: torch.Tensor, cu_seqlens_k: torch.Tensor | None = None, max_seqlen_k: int | None = None
) -> torch.Tensor:
    """V ``(batch, seqlen, heads, head_dim)`` (packed: ``(total, heads, head_dim)`` with ``cu_seqlens_k``) in the
    fp8 kernel's layout, returned as a ``(batch, slots, heads, head_dim)`` view (packed: batch 1) whose slots
    are contiguous: keys padded to whole groups (zeros), permuted within each group (:data:`VALUE_SLOT_KEYS`);
    packed sequences start at :func:`value_starts`, the slots between them zero. On a GPU, one kernel
    (``max_seqlen_k``: the longest packed sequence, read from the offsets when not given); elsewhere torch."""
    if v.is_cuda:
        from epicute.attention.launch import lay_out_values

        return lay_out_values(v, cu_seqlens_k, max_seqlen_k)
    slot_keys = torch.tensor(VALUE_SLOT_KEYS, device=v.device)
    if cu_seqlens_k is None:
        batch, seqlen, heads, dim = v.shape
        slots = padded_keys(seqlen)
        padded = torch.nn.functional.pad(v.view(torch.uint8), (0, 0, 0, 0, 0, slots - seqlen)).view(v.dtype)
        groups = padded.view(batch, slots // KEY_GROUP, KEY_GROUP, heads, dim)[:, :, slot_keys]
        physical = groups.permute(0, 3, 4, 1, 2).contiguous().view(batch, heads, dim, slots)
        return physical.permute(0, 3, 1, 2)
    total, heads, dim = v.shape
    batch = cu_seqlens_k.numel() - 1
    slots = value_slots(total, batch)
    # Slot s of the buffer holds the key of sequence b at offset k from its start, where s = value_starts[b]
    # + group(k) + VALUE_SLOT_KEYS^-1 (k): gathered per slot (no sync: the offsets stay on the device).
    cu = cu_seqlens_k.to(torch.int64)
    slot = torch.arange(slots, device=v.device)
    starts = value_starts(cu[:-1])
    seq = (torch.searchsorted(starts, slot, right=True) - 1).clamp(min=0)
    local = slot - starts[seq]
    key = cu[seq] + (local // KEY_GROUP) * KEY_GROUP + slot_keys[local % KEY_GROUP]
    valid = (key < cu[seq + 1]) & (local >= 0)
    rows = v.view(torch.uint8)[key.clamp(max=max(total - 1, 0))] if total else v.view(torch.uint8)[:0]
    rows = torch.where(valid.view(-1, 1, 1), rows, 0) if total else rows.new_zeros(slots, heads, dim)
    physical = rows.view(v.dtype).permute(1, 2, 0).contiguous()  # (heads, dim, slots)
    return physical.unsqueeze(0).permute(0, 3, 1, 2)


def values_of_slots(v_slots: torch.Tensor, seqlen: int) -> torch.Tensor:
    """The inverse of :func:`value_layout` for batched (or paged: ``seqlen`` = page size) values: ``(batch, slots,
    heads, head_dim)`` in the value layout back to ``(batch, seqlen, heads, head_dim)`` in key order (a copy)."""
    return v_slots[:, slot_of_position(torch.arange(seqlen, device=v_slots.device))]


def slot_of_key(key):
    """The slot of key ``key`` within its group of 16, :func:`key_of_slot` inverted: key ``v0 + 2 q + 8 j0`` sits
    in slot ``v0 + 2 j0 + 4 q``. Bit operations only, so the same function serves Python ints, torch integer
    tensors and the value pass kernel's device integers."""
    return (key & 1) | (((key >> 3) & 1) << 1) | (((key >> 1) & 3) << 2)


def slot_of_position(position: torch.Tensor) -> torch.Tensor:
    """The value-layout slot of key ``position`` (counted from a 16-aligned start: a sequence's or a page's)."""
    return position // KEY_GROUP * KEY_GROUP + slot_of_key(position % KEY_GROUP)


_ONES: dict[torch.device, torch.Tensor] = {}


def _descale(value, name: str, batch: int, heads_kv: int, device: torch.device) -> torch.Tensor:
    """One descale as an fp32 ``(batch, heads_kv)`` tensor: a tensor of that shape, or a broadcast view of one
    value (a one-element tensor, a number, or 1 when left out: one cached tensor per device, no launch)."""
    if value is None:
        ones = _ONES.get(device)
        if ones is None:
            ones = _ONES.setdefault(device, torch.ones((1, 1), dtype=torch.float32, device=device))
        return ones.expand(batch, heads_kv)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return torch.full((1, 1), float(value), dtype=torch.float32, device=device).expand(batch, heads_kv)
    if not isinstance(value, torch.Tensor):
        raise DtypeError(f"{name} must be a number or an fp32 tensor, got {type(value).__name__}")
    if value.dtype != torch.float32:
        raise DtypeError(f"{name} has dtype {value.dtype}; pass fp32 scales ({name}.float())")
    if value.device != device:
        raise DeviceError(f"{name} is on {value.device}; move it to q's device {device}")
    if value.numel() == 1:
        return value.reshape(1, 1).expand(batch, heads_kv)
    if tuple(value.shape) != (batch, heads_kv):
        raise ShapeError(
            f"{name} has shape {tuple(value.shape)}; pass one scale (a number or a one-element tensor) or one per "
            f"sequence and key/value head, shape (batch, heads_kv) = {(batch, heads_kv)} (FlashAttention-3's)"
        )
    return value


def descales(q_descale, k_descale, v_descale, batch: int, heads_kv: int, device: torch.device) -> tuple:
    """The three descales (Q's, K's, V's) as fp32 ``(batch, heads_kv)`` tensors, what the kernel reads element by
    element (broadcast views need no copy)."""
    return tuple(
        _descale(x, n, batch, heads_kv, device)
        for x, n in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale"))
    )


def check_no_descales(dtype: str, **given) -> None:
    """Descales belong to fp8 inputs: refuse them for others (they would be silently ignored)."""
    named = sorted(name for name, value in given.items() if value is not None)
    if named and dtype not in FP8_INPUT_DTYPES:
        raise ConfigError(
            f"{', '.join(named)} given with {dtype} inputs: descales dequantize fp8 (float8_e4m3fn) q, k and v; "
            "drop them or pass fp8 tensors"
        )


__all__ = [
    "FP8_INPUT_DTYPES",
    "FP8_OUT_DTYPE",
    "KEY_GROUP",
    "NO_BACKWARD",
    "VALUE_SLOT_KEYS",
    "check_no_descales",
    "descales",
    "key_of_slot",
    "padded_keys",
    "slot_of_key",
    "slot_of_position",
    "stored_dtype",
    "value_layout",
    "value_slots",
    "value_starts",
    "values_of_slots",
]
