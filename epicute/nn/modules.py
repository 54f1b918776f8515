"""Layers with ``torch.nn``'s conventions over :mod:`epicute.nn.functional`.

- :class:`Linear`: ``nn.Linear``'s parameters and state dict, any leading dimensions, an optional fused epilogue
  after the bias.
- :class:`GatedMLP`: a Llama/Qwen/Mistral MLP (``down(act(gate(x)) * up(x))``). It holds the gate and up weights as
  the one interleaved weight the gated GEMM reads (built once, when weights are loaded, and trained as such), and
  its state dict has the checkpoint's layout: separate ``gate_proj.weight``/``up_proj.weight``, or a concatenated
  ``gate_up_proj.weight`` (``[gate; up]``, as Phi-3-style checkpoints store it) on load.
- :class:`MoEExperts`: a mixture-of-experts layer's experts (transformers' ``MixtralExperts``/``Qwen3MoeExperts``
  call: ``experts(hidden_states, top_k_index, top_k_weights)``), two grouped GEMMs. Like :class:`GatedMLP` it holds
  gate and up interleaved, and its state dict has transformers' ``gate_up_proj`` ``(E, 2I, H)`` (``[gate; up]``)
  and ``down_proj`` ``(E, H, I)``. :func:`top_k_routing` turns router logits into its ``top_k_index`` and
  ``top_k_weights``.
- :class:`Attention`: Llama-style attention (GQA, rotary embeddings, no biases by default) over
  :func:`epicute.attention` when training or prefilling without a cache, and over a
  :class:`~epicute.nn.kv_cache.PagedKVCache` (appending the new keys and values) when serving.

Example:
    >>> import torch
    >>> from epicute.nn import GatedMLP
    >>> mlp = GatedMLP(64, 128, activation="silu", dtype=torch.bfloat16)
    >>> sorted(mlp.state_dict())
    ['down_proj.weight', 'gate_proj.weight', 'up_proj.weight']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from epicute.attention.api import attention
from epicute.epilogue.gated import interleave_gate_up, split_gate_up
from epicute.errors import ConfigError, EpilogueError, ShapeError
from epicute.nn import functional as EF
from epicute.nn.fp8 import RECIPES as FP8_RECIPES
from epicute.nn.fp8 import fp8_gated_mlp, fp8_linear, fp8_moe_experts
from epicute.nn.kv_cache import PagedKVCache, attention_with_kvcache


class Linear(nn.Linear):
    """``nn.Linear`` on epicute's GEMM: ``epilogue(x @ weight.T + bias, **operands)``.

    An ``nn.Linear`` (a subclass: its parameters, initialization and state dict, so a checkpoint loads either way,
    and what recognizes an ``nn.Linear`` recognizes it: torch.distributed's ``ColwiseParallel``/``RowwiseParallel``
    shard it, :func:`epicute.nn.functional.linear` then runs each rank's shard, :mod:`epicute.nn.parallel`).
    ``epilogue`` (optional) is fused after the bias; its operands are passed to ``forward``.
    ``fp8="blockwise"`` (or ``"rowwise"``) trains it in fp8: the forward and both gradients as fp8 GEMMs, the
    weight kept in its dtype (:func:`epicute.nn.fp8.fp8_linear`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        epilogue: Callable | None = None,
        fp8: str | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if fp8 is not None and (fp8 not in FP8_RECIPES or epilogue is not None):
            raise ConfigError(f"fp8={fp8!r}" + (" with an epilogue: fp8 training fuses none yet" if fp8 in FP8_RECIPES
                              else f"; use one of {sorted(FP8_RECIPES)} (or None: the layer's dtype)"))  # fmt: skip
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.epilogue, self.fp8 = epilogue, fp8

    @classmethod
    def from_linear(cls, linear: nn.Linear, epilogue: Callable | None = None, *, fp8: str | None = None) -> Linear:
        """The same layer (its parameters shared, not copied) on epicute's GEMM (``fp8``: trained in fp8)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, epilogue=epilogue, fp8=fp8,
                    device="meta", dtype=linear.weight.dtype)  # fmt: skip
        layer.weight = linear.weight
        layer.bias = linear.bias
        return layer

    def forward(self, x: torch.Tensor, **operands: Any) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8_linear(x, self.weight, self.bias, recipe=self.fp8)
        return EF.linear(x, self.weight, self.bias, epilogue=self.epilogue, **operands)

    def extra_repr(self) -> str:
        fused = f", epilogue={getattr(self.epilogue, '__name__', self.epilogue)}" if self.epilogue else ""
        fused += f", fp8={self.fp8!r}" if self.fp8 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{fused}"


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` as two epicute GEMMs (:func:`epicute.nn.functional.gated_mlp`).

    ``gate_up`` ``(2 * intermediate, hidden)`` is the gate and up weights interleaved in blocks of 8
    (:func:`epicute.interleave_gate_up`), trained as one parameter; ``down_proj`` an ``nn.Linear``'s weight.
    ``state_dict()`` gives ``gate_proj.weight``, ``up_proj.weight`` and ``down_proj.weight`` (a Llama checkpoint's
    keys); ``load_state_dict`` takes those, or ``gate_up_proj.weight`` concatenated ``[gate; up]``.
    ``fp8="blockwise"`` trains it in fp8: all six GEMMs of a step on fp8 inputs, the activation and its derivative
    still in their epilogues (:func:`epicute.nn.fp8.fp8_gated_mlp`).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str | Callable = "silu",
        *,
        device: Any = None,
        dtype: torch.dtype | None = None,
        fp8: str | None = None,
    ) -> None:
        super().__init__()
        _check_gated_width(intermediate_size)
        if fp8 not in (None, "blockwise"):
            raise ConfigError(f"fp8={fp8!r}: the gated MLP trains in fp8 with 'blockwise' scales (or None: bf16)")
        self.hidden_size, self.intermediate_size, self.activation = hidden_size, intermediate_size, activation
        self.fp8 = fp8
        gate, up = (nn.Linear(hidden_size, intermediate_size, bias=False, device=device, dtype=dtype) for _ in "gu")
        self.gate_up = nn.Parameter(interleave_gate_up(gate.weight.detach(), up.weight.detach()))
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, device=device, dtype=dtype)
        self._register_state_dict_hook(_gate_up_to_checkpoint)
        self._register_load_state_dict_pre_hook(_checkpoint_to_gate_up)

    @classmethod
    def from_projections(
        cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, activation: str | Callable = "silu", *,
        fp8: str | None = None,
    ) -> GatedMLP:  # fmt: skip
        """A GatedMLP holding these projections' weights (copied once into the interleaved layout; ``fp8``: trained
        in fp8)."""
        for name, proj in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            if proj.bias is not None:
                raise ShapeError(f"{name} has a bias; GatedMLP's projections have none (mlp_bias=False)")
        weight = gate_proj.weight
        mlp = cls(gate_proj.in_features, gate_proj.out_features, activation, device="meta", dtype=weight.dtype,
                  fp8=fp8)  # fmt: skip
        mlp.load_state_dict({"gate_proj.weight": weight.detach(), "up_proj.weight": up_proj.weight.detach(),
                             "down_proj.weight": down_proj.weight.detach()}, assign=True)  # fmt: skip
        return mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8_gated_mlp(x, self.gate_up, self.down_proj.weight, self.activation, recipe=self.fp8)
        return EF.gated_mlp(x, self.gate_up, self.down_proj.weight, activation=self.activation)

    def extra_repr(self) -> str:
        sizes = f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"
        return f"{sizes}, activation={self.activation}" + (f", fp8={self.fp8!r}" if self.fp8 else "")


class MoEExperts(nn.Module):
    """The experts of a mixture-of-experts layer: ``out[t] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))``,
    ``e = top_k_index[t, j]``, ``w = top_k_weights`` (:func:`epicute.nn.functional.moe_experts`).

    ``gate_up`` ``(E, 2I, H)`` holds each expert's gate and up weights interleaved in blocks of 8, built once at load
    and trained as such (no copy per call); ``down_proj`` ``(E, H, I)``. ``fp8="blockwise"`` trains them in fp8:
    the six grouped GEMMs of a step on fp8 inputs, the weights kept in their dtype
    (:func:`epicute.nn.fp8_moe_experts`). ``state_dict()`` gives transformers' keys and layout (``gate_up_proj``
    ``[gate; up]``, ``down_proj``); ``load_state_dict`` takes them.

    Example:
        >>> import torch
        >>> from epicute.nn import MoEExperts, top_k_routing
        >>> experts = MoEExperts(8, 64, 128, dtype=torch.bfloat16)
        >>> sorted(experts.state_dict())
        ['down_proj', 'gate_up_proj']
        >>> index, weights = top_k_routing(torch.randn(5, 8), 2)
        >>> index.shape, weights.shape
        (torch.Size([5, 2]), torch.Size([5, 2]))
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        *,
        fp8: str | None = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_gated_width(intermediate_size)
        if activation not in EF.ACTIVATIONS:
            raise EpilogueError(f"activation={activation!r}: MoEExperts takes one of {sorted(EF.ACTIVATIONS)}")
        if fp8 not in (None, "blockwise"):
            raise ConfigError(f"fp8={fp8!r}: the experts train in fp8 with 'blockwise' scales (or None: bf16)")
        if fp8 and (hidden_size % 128 or intermediate_size % 64):
            raise ShapeError(f"hidden_size={hidden_size}, intermediate_size={intermediate_size}: fp8 experts need "
                             "multiples of 128 and 64 (each expert's weight rows are whole 128 x 128 "
                             "blocks)")  # fmt: skip
        self.fp8 = fp8
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation = activation
        bound_in, bound_mid = hidden_size**-0.5, intermediate_size**-0.5  # nn.Linear's default bounds, per expert
        gate_up = torch.empty(num_experts, 2 * intermediate_size, hidden_size, device=device, dtype=dtype)
        down = torch.empty(num_experts, hidden_size, intermediate_size, device=device, dtype=dtype)
        if gate_up.device.type != "meta":
            nn.init.uniform_(gate_up, -bound_in, bound_in)
            nn.init.uniform_(down, -bound_mid, bound_mid)
        self.gate_up = nn.Parameter(interleave_gate_up(*gate_up.chunk(2, dim=-2)))
        self.down_proj = nn.Parameter(down)
        self._register_state_dict_hook(_experts_to_checkpoint)
        self._register_load_state_dict_pre_hook(_checkpoint_to_experts)

    @classmethod
    def from_experts(cls, experts: nn.Module, activation: str = "silu", *, fp8: str | None = None) -> MoEExperts:
        """The experts of a transformers module holding ``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj``
        ``(E, H, I)`` (gate/up copied once into the interleaved layout; ``down_proj`` shared; ``fp8``: trained in
        fp8)."""
        gate_up, down = experts.gate_up_proj, experts.down_proj
        layer = cls(gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2, activation, fp8=fp8, device="meta",
                    dtype=gate_up.dtype)  # fmt: skip
        layer.load_state_dict({"gate_up_proj": gate_up.detach(), "down_proj": down.detach()}, assign=True)
        layer.down_proj = down
        return layer

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.fp8 is not None:
            return fp8_moe_experts(hidden_states, self.gate_up, self.down_proj, top_k_index, top_k_weights,
                                   self.activation, recipe=self.fp8)  # fmt: skip
        return EF.moe_experts(hidden_states, self.gate_up, self.down_proj, top_k_index, top_k_weights,
                              activation=self.activation, interleaved=True)  # fmt: skip

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, activation={self.activation}"
                + (f", fp8={self.fp8!r}" if self.fp8 else ""))  # fmt: skip


def top_k_routing(router_logits: torch.Tensor, top_k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_k_index, top_k_weights)`` from router logits ``(T, E)``: the softmax's ``top_k`` largest probabilities
    (float32) and their experts, renormalized to sum to 1 when ``normalize`` (Mixtral; Qwen3-MoE's
    ``norm_topk_prob``)."""
    if router_logits.dim() != 2 or not 1 <= top_k <= router_logits.shape[-1]:
        raise ShapeError(f"router_logits {tuple(router_logits.shape)} and top_k={top_k}: need (T, E) logits and "
                         "1 <= top_k <= E")  # fmt: skip
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, index = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return index, weights


class Attention(nn.Module):
    """``o_proj(attention(rope(q_proj(x)), rope(k_proj(x)), v_proj(x)))``, causal, with ``num_heads`` query heads
    over ``num_kv_heads`` key/value heads (any ratio) and rotary embeddings (Llama's: ``rotate_half``, base
    ``rope_theta``). Projections are :class:`Linear` (``nn.Linear``'s state dict: ``q_proj.weight``...).

    ``forward(x, cache=None)``: ``x`` ``(batch, s, hidden)``. Without a cache the ``s`` tokens are positions
    ``0..s-1`` and attend causally (training: differentiable). With a :class:`~epicute.nn.kv_cache.PagedKVCache` they
    are positions ``seqlens[b]`` onward: their keys and values are appended, then they attend over the whole cache
    (prefill, then one token per decode step; no host sync, so a decode step can be captured in a CUDA graph).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        rope_theta: float = 10000.0,
        bias: bool = False,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        head_dim = head_dim or hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise ShapeError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.q_proj = Linear(hidden_size, num_heads * head_dim, **kw)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, **kw)

    def forward(self, x: torch.Tensor, cache: PagedKVCache | None = None) -> torch.Tensor:
        batch, s, _ = x.shape
        q = self.q_proj(x).view(batch, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, s, self.num_kv_heads, self.head_dim)
        start = cache.seqlens.long()[:, None] if cache is not None else x.new_zeros((1, 1), dtype=torch.long)
        positions = start + torch.arange(s, device=x.device)  # (batch or 1, s)
        q, k = (rotary(t, positions, self.rope_theta) for t in (q, k))
        out = attention(q, k, v, causal=True) if cache is None else attention_with_kvcache(q, cache, k, v)
        return self.o_proj(out.reshape(batch, s, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"


def rotary(t: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``t`` ``(batch, s, heads, head_dim)`` at ``positions`` ``(batch or 1, s)``, as
    Llama applies it (``t * cos + rotate_half(t) * sin``, the frequencies repeated over the two halves), computed in
    fp32 and returned in ``t``'s dtype."""
    if t.dim() != 4 or t.shape[-1] % 2 or positions.dim() != 2 or positions.shape[0] not in (1, t.shape[0]) or \
            positions.shape[1] != t.shape[1]:  # fmt: skip
        raise ShapeError(f"t {tuple(t.shape)} and positions {tuple(positions.shape)}: rotary takes t (batch, s, heads, "
                         "head_dim) with an even head_dim and positions (batch or 1, s)")  # fmt: skip
    half = t.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (batch, s, half)
    cos, sin = (f(torch.cat([angles, angles], dim=-1))[:, :, None, :] for f in (torch.cos, torch.sin))
    x = t.float()
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(t.dtype)


def _experts_to_checkpoint(module: MoEExperts, state: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict hook: the interleaved gate/up as transformers' concatenated ``gate_up_proj`` ``[gate; up]``."""
    gate, up = split_gate_up(state.pop(prefix + "gate_up").transpose(-2, -1))
    state[prefix + "gate_up_proj"] = torch.cat([gate, up], dim=-1).transpose(-2, -1).contiguous()


def _checkpoint_to_experts(state: dict, prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: transformers' ``gate_up_proj`` into the interleaved ``gate_up``, once."""
    if prefix + "gate_up_proj" in state:
        state[prefix + "gate_up"] = interleave_gate_up(*state.pop(prefix + "gate_up_proj").chunk(2, dim=-2))


def _check_gated_width(intermediate_size: int) -> None:
    if intermediate_size % 8:
        raise ShapeError(f"intermediate_size={intermediate_size}: the gated GEMM needs a multiple of 8")


def _gate_up_to_checkpoint(module: GatedMLP, state: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict hook: the interleaved weight as the checkpoint's separate gate and up weights."""
    gate_up = state.pop(prefix + "gate_up")
    gate, up = split_gate_up(gate_up.transpose(-2, -1))
    state[prefix + "gate_proj.weight"] = gate.transpose(-2, -1).contiguous()
    state[prefix + "up_proj.weight"] = up.transpose(-2, -1).contiguous()


def _checkpoint_to_gate_up(state: dict, prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: separate (``gate_proj``/``up_proj``) or concatenated (``gate_up_proj``) weights into
    the interleaved one, once."""
    gate_key, up_key, both_key = prefix + "gate_proj.weight", prefix + "up_proj.weight", prefix + "gate_up_proj.weight"
    if both_key in state:
        gate, up = state.pop(both_key).chunk(2, dim=0)
    elif gate_key in state and up_key in state:
        gate, up = state.pop(gate_key), state.pop(up_key)
    else:
        return  # a state dict of our own layout, or one missing keys: load_state_dict reports them
    state[prefix + "gate_up"] = interleave_gate_up(gate, up)


__all__ = ["Attention", "GatedMLP", "Linear", "MoEExperts", "rotary", "top_k_routing"]
