"""The torch custom ops of the kernel families, defined from their declarations.

Each family exposes its kernel as a ``torch.library`` custom op (``epicute/gemm/torch_op.py``:
``torch.ops.epicute.gemm``; ``epicute/attention/torch_op.py``: ``torch.ops.epicute.attention``)
in one style: a :class:`TorchOp` whose real implementation is the public eager function and whose
fake one gives output metadata (also run on the meta device, :func:`register_meta`), and a
traceable ``*_op_call`` the public function delegates to while ``torch.compiler.is_compiling()``.
Under ``torch.compile`` (``fullgraph=True`` included) the public function turns into one call of
its op, so user code needs no change. A family's declaration (:mod:`epicute.families`) names its
:class:`TorchOp`; ``import epicute`` defines them all (:func:`define_ops`), so which ops exist never
depends on which modules happened to be imported.

What they share lives here. Epilogues (and score_mods) reach an op as a registry key (a
string in the graph, never a Python object): :func:`register_epilogue` traces the function
once, with every operand as a tile unless its annotation pins another kind, and keys it by
the semantic hash of that graph (``"<name>:<hash prefix>"``), so the same epilogue gets the
same key in every process; :func:`registered_epilogue` finds it again. Everything else a
call needs (operand names, pins, dtypes, config) travels as ``spec``, a JSON string
(:func:`spec_text`), and keyword operands travel as tensors and floats
(:func:`split_operands`, :func:`operand_values`).

CUDA graphs: capture works once the kernel is cached (call once before capturing, or run
``epicute compile`` ahead of time); pass epilogue scalars as Python numbers, since reading
a 1-element tensor synchronizes.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from epicute.epilogue.dtypes import ir_dtype
from epicute.epilogue.gated import gated_epilogue
from epicute.epilogue.graph import UP_OUTPUT
from epicute.epilogue.hashing import semantic_hash
from epicute.epilogue.operands import PINS, Pin
from epicute.epilogue.score_mod import score_mod as as_score_mod
from epicute.epilogue.tracer import Epilogue, as_epilogue, trace_key
from epicute.errors import EpilogueError
from epicute.runtime.buffers import per_call_buffers
from epicute.runtime.checks import PLAIN_TENSORS

_EPILOGUES: dict[str, Epilogue] = {}
_OUTPUTS: dict[str, tuple[str, ...]] = {}
_STORED: dict[str, dict[str, str]] = {}
_LOCK = threading.Lock()


def register_epilogue(fn: Callable) -> str:
    """Register an epilogue for the custom ops; returns its key (the same in every process).

    :func:`epicute.gemm` does this by itself under ``torch.compile``; call it
    directly only to run a graph exported with ``torch.export`` in a new process.
    """
    return _register(fn)[0]


def register_score_mod(fn: Callable) -> str:
    """:func:`register_epilogue` for an attention ``score_mod``.

    :func:`epicute.attention` does this by itself under ``torch.compile``.
    """
    return _register_score_mod(fn)[0]


def registered_epilogue(key: str) -> Epilogue:
    """The epilogue (or score_mod: a ``ScoreMod``) registered under ``key``."""
    try:
        return _EPILOGUES[key]
    except KeyError:
        raise EpilogueError(
            f"no epilogue is registered under {key!r} in this process; call "
            "epicute.runtime.torch_ops.register_epilogue(fn) (register_score_mod(fn) for a score_mod) "
            "before running a graph exported elsewhere"
        ) from None


#: Registrations by what tracing depends on (:func:`~epicute.epilogue.tracer.trace_key`) and the hook: a repeat
#: call of an eager training step (which goes through the op) does not trace its epilogue again.
_REGISTERED: dict[tuple, tuple[str, tuple[str, ...]]] = {}


def _register(fn: Callable, hook: Callable[[Callable], Epilogue] = as_epilogue) -> tuple[str, tuple[str, ...]]:
    memo = trace_key(fn)
    if memo is not None:
        memo = (hook, memo)
        hit = _REGISTERED.get(memo)
        if hit is not None:
            return hit
    epi = hook(fn)
    kinds = {p: epi.pins.get(p, "tile") for p in epi.params}
    try:
        graph = epi.trace(kinds, {}, None, d_dtype="fp32")
    except EpilogueError as exc:
        raise EpilogueError(
            f"epilogue {epi.name!r} cannot be keyed for torch.compile by tracing its operands as tiles ({exc}); "
            "annotate each operand's kind (epicute.RowVector, ColVector, Scalar, Tile) in its signature"
        ) from exc
    key = f"{epi.name}:{semantic_hash(graph)[:24]}"
    with _LOCK:
        # An earlier registration under this key traced to the same graph: keep it.
        _EPILOGUES.setdefault(key, epi)
        # A paired D_up is inside D (Graph.paired): never an output of its own.
        _OUTPUTS[key] = tuple(name for name, _ in graph.outputs if not (graph.paired and name == UP_OUTPUT))
        _STORED[key] = dict(graph.output_dtypes)
        if memo is not None:
            if len(_REGISTERED) >= 4096:
                _REGISTERED.clear()
            _REGISTERED[memo] = (key, _OUTPUTS[key])
    return key, _OUTPUTS[key]


def _register_score_mod(fn: Callable) -> tuple[str, tuple[str, ...]]:
    # Its own function (not a partial): assume_constant_result wraps plain functions.
    return _register(fn, as_score_mod)


def _register_gated(fn: Callable) -> tuple[str, tuple[str, ...]]:
    """A gated epilogue ``f(gate, up, *operands)`` (``gated=True``): its graph reads both halves of a column, so it
    keys apart from the same function taken as an ordinary epilogue."""
    return _register(fn, gated_epilogue)


def assume_constant_result(fn: Callable) -> Callable:
    """What ``torch._dynamo.assume_constant_result`` does (it only marks ``fn``), without importing
    dynamo: that import costs seconds, and ``import epicute`` must stay cheap for the CLI."""
    fn._dynamo_marked_constant = True
    return fn


# Under dynamo these run once, at trace time, and their results become constants of the graph.
# Dynamo folds them only over constant arguments: hand them the plain function (a
# constant to dynamo), not an Epilogue/ScoreMod object (some torch versions refuse
# user objects there); the hook rebuilds the same object from it (plain_fn).
register_traced = assume_constant_result(_register)
register_score_mod_traced = assume_constant_result(_register_score_mod)
register_gated_traced = assume_constant_result(_register_gated)


def plain_fn(hook: Callable) -> Callable:
    return hook.fn if isinstance(hook, Epilogue) else hook


def split_operands(operands: dict[str, Any]) -> tuple[list, list, list, list, list]:
    """Keyword operands as (tensor names, tensors, scalar names, scalars, pins), sorted by name."""
    tensor_names, tensors, scalar_names, scalars, pins = [], [], [], [], []
    for name in sorted(operands):
        value = operands[name]
        if isinstance(value, Pin):
            pins.append((name, value.kind))
            value = value.value
        if isinstance(value, torch.Tensor):
            tensor_names.append(name)
            tensors.append(value)
        else:
            scalar_names.append(name)
            scalars.append(float(value))
    return tensor_names, tensors, scalar_names, scalars, pins


def operand_values(operands: list[torch.Tensor], scalars: list[float], spec: dict) -> dict[str, Any]:
    """The keyword operands :func:`split_operands` took apart (pins re-applied)."""
    values: dict[str, Any] = dict(zip(spec["tensors"], operands))
    values.update(zip(spec["scalars"], scalars))
    for name, kind in spec["pins"].items():
        values[name] = PINS[kind](values[name])
    return values


def grad_slot(value: list):
    """No gradient for a list input of an op, in the structure autograd expects back: a list of tensors
    (an empty list included) is a list of slots, any other list one leaf."""
    return [None] * len(value) if all(isinstance(x, torch.Tensor) for x in value) else None


@functools.lru_cache(maxsize=1024)
def parsed_spec(spec: str) -> dict:
    """:func:`spec_text`'s JSON read back, once per string (a compiled graph passes the same one every step): the
    dict is shared between calls, so callers only read it."""
    return json.loads(spec)


def config_of(spec: dict) -> dict | None:
    """The call's config pins; JSON turned their tuples (epi_tile, mma_atoms_mn) into lists."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in spec["config"].items()} or None


def dtype_name(dtype: torch.dtype | str | None) -> str | None:
    return None if dtype is None else ir_dtype(dtype, "dtype")


@assume_constant_result
def spec_text(tensor_names: tuple, scalar_names: tuple, pins: tuple, config: tuple, fields: tuple) -> str:
    """An op's static arguments as JSON: operand names and pins, config pins, and the
    kernel's own ``fields`` (``(name, value)`` pairs; see :func:`_plain`). The same arguments give the same
    string object (an eager training step builds one per call)."""
    memo = (tensor_names, scalar_names, pins, config, fields)
    try:
        found = _SPECS.get(memo)
    except TypeError:  # an unhashable config value
        memo = found = None
    if found is not None:
        return found
    spec = {
        "tensors": list(tensor_names),
        "scalars": list(scalar_names),
        "pins": dict(pins),
        "config": dict(config),
        **{name: plain_value(value) for name, value in fields},
    }
    text = json.dumps(spec, sort_keys=True)
    if memo is not None:
        if len(_SPECS) >= 4096:
            _SPECS.clear()
        _SPECS[memo] = text
    return text


_SPECS: dict[tuple, str] = {}


def plain_value(value: Any) -> Any:
    """A JSON value: torch dtypes by IR name, ``((name, value), ...)`` tuples as dicts."""
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, tuple):
        return {name: plain_value(v) for name, v in value}
    return value


def registered_outputs(key: str) -> tuple[str, ...]:
    """The output names of the epilogue registered under ``key``, D first (an op's list order)."""
    return _OUTPUTS[key]


def registered_casts(key: str) -> dict[str, str]:
    """The dtypes the epilogue registered under ``key`` gives its tile outputs by its own final
    ``cast``/``quantize`` (outputs it leaves to the call are absent)."""
    return {name: dtype for name, dtype in _STORED[key].items() if dtype != "fp32"}


@dataclass(frozen=True)
class TorchOp:
    """A family's custom op, as its ``torch_op.py`` declares it; :func:`define_ops` defines it with torch."""

    #: the qualified name, ``"epicute::gemm"``: ``torch.ops.epicute.gemm``
    name: str
    #: the real implementation; its annotations are the op's schema
    impl: Callable
    #: the fake implementation: outputs' shapes, dtypes and strides, computing nothing
    fake: Callable
    #: a differentiable op's ``backward(ctx, *grads)`` and ``setup_context(ctx, inputs, output)``
    #: (``torch.library.register_autograd``)
    backward: Callable | None = None
    setup_context: Callable | None = None
    #: ``"module:NAME"`` of the op its backward calls while traced (the whole backward as one op), defined with it
    traced_backward: str | None = None

    def __call__(self, *args: Any) -> list[torch.Tensor]:
        """The op applied to ``args``: through ``torch.ops`` while torch.compile traces (or on meta and fake
        tensors), else eagerly through an ``autograd.Function`` made of the same implementation, setup and
        backward. The dispatcher's own autograd wrapper costs a few hundred microseconds of Python a call
        (bench/NOTES.md, issue 57's host time), more than a GEMM's launch; the Function costs a few."""
        if not runs_eagerly(args[0]):
            namespace, name = self.name.split("::")
            return getattr(getattr(torch.ops, namespace), name)(*args)
        if self.backward is None:
            return self.impl(*args)
        return self.eager(eager_layout(args), *args)

    def eager(self, layout: tuple, *args: Any) -> list[torch.Tensor]:
        """The op applied eagerly to ``args`` whose :func:`eager_layout` is ``layout`` (a caller repeating calls of
        one signature works it out once)."""
        flat = [t for arg, (kind, _) in zip(args, layout) for t in (arg if kind == _LIST else (arg,))]
        return list(_EagerOp.apply(*flat, self, layout))


def eager_layout(args: tuple) -> tuple:
    """How :class:`_EagerOp` takes an op's arguments: each argument's kind and how many flat arguments it takes."""
    return tuple(_arg_kind(arg) for arg in args)



def traced(t: torch.Tensor) -> bool:
    """Whether a call on ``t`` is being traced (torch.compile, or AOTAutograd tracing a compiled graph with fake or
    functional tensors, where ``is_compiling()`` can be False): the public functions then call their torch op."""
    return torch.compiler.is_compiling() or (type(t) not in PLAIN_TENSORS and isinstance(t, torch.Tensor))


def runs_eagerly(*tensors: torch.Tensor) -> bool:
    """Whether a call on ``tensors`` runs for real: not :func:`traced`, not on meta tensors."""
    return not any(traced(t) or t.device.type == "meta" for t in tensors)


_TENSOR, _LIST, _OTHER = "tensor", "list", "other"


def _arg_kind(arg: Any) -> tuple[str, int]:
    """An op argument's kind for :class:`_EagerOp`, and how many flat arguments it takes."""
    if isinstance(arg, torch.Tensor):
        return _TENSOR, 1
    if isinstance(arg, list) and arg and all(isinstance(t, torch.Tensor) for t in arg):
        return _LIST, len(arg)
    return _OTHER, 1


def _regroup(flat: tuple, layout: tuple) -> list:
    """The op's arguments from the Function's flat ones."""
    args, i = [], 0
    for kind, count in layout:
        args.append(list(flat[i : i + count]) if kind == _LIST else flat[i])
        i += count
    return args


class _EagerOp(torch.autograd.Function):
    """A :class:`TorchOp` run eagerly: ``apply(*flat_args, op, layout)``, the op's tensor lists expanded (an
    ``autograd.Function`` tracks only tensors passed directly). ``a`` and ``b`` stay first, so the op's backward
    finds their ``needs_input_grad`` where it does under ``torch.ops``."""

    # forward(ctx, ...) rather than a separate setup_context: with one, every apply binds its arguments through
    # inspect.signature (tens of microseconds a call).
    @staticmethod
    def forward(ctx, *args: Any) -> tuple[torch.Tensor, ...]:
        *flat, op, layout = args
        inputs = _regroup(tuple(flat), layout)
        output = op.impl(*inputs)
        ctx.op, ctx.layout = op, layout
        op.setup_context(ctx, inputs, list(output))
        return tuple(output)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        flat: list = []
        for (kind, count), grad in zip(ctx.layout, ctx.op.backward(ctx, list(grads))):
            if kind == _LIST:
                flat.extend(grad if grad is not None else [None] * count)
            else:
                flat.append(grad if kind == _TENSOR else None)
        return (*flat, None, None)


_DEFINED: dict[str, Any] = {}


def define_ops() -> dict[str, Any]:
    """Define the torch op of every declared family (those already defined are kept); returns them by name."""
    from epicute.runtime.family import declarations, resolve

    for spec in declarations():
        if spec.torch_op is not None:
            define_op(resolve(spec.torch_op))
    return dict(_DEFINED)


def define_op(op: TorchOp) -> Any:
    """``torch.library.custom_op(op.name)(op.impl)`` with ``op.fake`` as its fake (and meta) implementation,
    once per process: the op object."""
    with _LOCK:
        if op.name not in _DEFINED:
            # Calls through torch.ops come from compiled graphs, which CUDA graphs may record: their buffers are
            # allocated per call (epicute.runtime.buffers says why).
            schema = torch.library.infer_schema(op.impl, mutates_args=())
            impl = per_call_buffers(op.impl)
            custom = torch.library.custom_op(op.name, impl, mutates_args=(), schema=schema)
            register_cuda_kernel(op.name, impl)
            register_cuda_autograd(custom, impl)
            custom.register_fake(op.fake)
            register_meta(custom, op.fake)
            if op.backward is not None:
                custom.register_autograd(op.backward, setup_context=op.setup_context)
            _DEFINED[op.name] = custom
    if op.traced_backward is not None:
        from epicute.runtime.family import resolve

        define_op(resolve(op.traced_backward))
    return _DEFINED[op.name]


#: The ops' CUDA kernels, registered beside the custom ops' own (process lifetime, like them).
_CUDA_KERNELS = torch.library.Library("epicute", "IMPL")


def register_cuda_kernel(name: str, impl: Callable) -> None:
    """Run ``impl`` for CUDA tensors straight from the dispatcher. ``custom_op`` registers its implementation
    for every device behind a Python wrapper that checks the outputs alias no input (our outputs are always
    fresh tensors) and disables dynamo: on the H200's host that wrapper cost tens of microseconds per call of
    a compiled graph, more than the launch itself (bench/NOTES.md, issue 58's host time). A CUDA kernel takes
    precedence over the custom op's CompositeExplicitAutograd one; the op's autograd, fake and other devices
    stay the custom op's."""
    _CUDA_KERNELS.impl(name.split("::")[1], impl, "CUDA")


def register_cuda_autograd(custom: Any, impl: Callable) -> None:
    """Let a call on CUDA tensors that records no gradient run ``impl`` straight from the autograd key. The custom
    op's autograd kernel, a Python function, otherwise runs first and re-enters the dispatcher for the CUDA kernel:
    a second boxed call, 7-12 us of each call a compiled graph makes on the H200's host (bench/NOTES.md, thirteenth
    session), where the graphs AOTAutograd compiles call the op with no input requiring grad. Any other call (an input
    requiring grad with grad mode on, a tensor subclass such as a fake or functional tensor, a dispatch mode
    tracing) takes the custom op's own autograd kernel, as before. Where this torch has no such kernel to hand on
    to, nothing is registered."""
    try:
        from torch._library.autograd import make_autograd_impl

        autograd_kernel = make_autograd_impl(custom._opoverload, custom)
    except (ImportError, AttributeError, TypeError):  # a torch without it: the custom op's kernel alone
        return

    def kernel(keyset, *args):
        if records_no_gradient(args):
            return impl(*args)
        return autograd_kernel(keyset, *args)

    _CUDA_KERNELS.impl(custom._name, kernel, "AutogradCUDA", with_keyset=True)


def records_no_gradient(args: tuple) -> bool:
    """Whether an op call on ``args`` is one autograd has nothing to do for: plain tensors (tensor lists included),
    none requiring grad unless grad mode is off, and no dispatch mode (``make_fx``'s tracing, fake tensor modes)
    that must see the op itself."""
    if torch._C._len_torch_dispatch_stack():
        return False
    grad = torch.is_grad_enabled()
    for arg in args:
        for t in arg if isinstance(arg, list) else (arg,):
            if isinstance(t, torch.Tensor) and (type(t) not in PLAIN_TENSORS or (grad and t.requires_grad)):
                return False
    return True


def register_meta(op, fake: Callable) -> None:
    """Run ``op``'s fake implementation on the meta device too, so shapes can be checked with no
    GPU; some torch versions already route Meta to the fake implementation (and refuse a second)."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op._qualname, "Meta"):
        op.register_kernel("meta")(fake)


__all__ = [
    "TorchOp", "assume_constant_result", "define_op", "define_ops", "dtype_name", "eager_layout", "grad_slot",
    "operand_values",
    "plain_fn", "plain_value", "records_no_gradient", "register_cuda_autograd", "register_cuda_kernel",
    "register_epilogue", "register_meta", "register_score_mod",
    "registered_casts", "registered_epilogue", "registered_outputs", "runs_eagerly", "spec_text", "split_operands",
    "traced",
]  # fmt: skip
