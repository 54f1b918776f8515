"""``@epicute.epilogue``: a plain Python function of the accumulator, traced into a Graph.

The function's first parameter is the fp32 accumulator ``acc``; the others are
operands, passed by name at the GEMM call. It returns ``{"D": value, ...}`` (or
just the value of D): ``"D"`` is the main output, other keys are aux outputs (a
tile, stored as its own tensor, or a reduction). Tracing calls the function once
on :class:`~epicute.epilogue.proxy.Value` proxies. Scalar operands stay inputs
of the graph, so changing ``alpha`` never recompiles; numbers written in (or
captured by) the function become constants, so changing them does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from epicute.epilogue import optable
from epicute.epilogue.dtypes import ir_dtype
from epicute.epilogue.graph import INDEX_KINDS, KINDS, REDUCTIONS, Graph, Node
from epicute.epilogue.operands import PINS, OperandSpec, Pin, resolve_operands
from epicute.epilogue.proxy import Recorder, Value
from epicute.errors import EpicuteError, EpilogueError


def _signature(fn: Callable) -> inspect.Signature:
    # Annotations (e.g. ``scale: ColVector``) may be strings under ``from __future__
    # import annotations``; ones that do not evaluate are not pins, so keep them raw.
    try:
        return inspect.signature(fn, eval_str=True)
    except (NameError, AttributeError, SyntaxError):
        return inspect.signature(fn)


class Epilogue:
    """A traceable epilogue: ``fn``, its ``name``, and its operand ``params`` (after ``acc``).

    Annotating a parameter with :class:`~epicute.epilogue.operands.RowVector`,
    ``ColVector``, ``Scalar`` or ``Tile`` fixes that operand's kind; a parameter's
    default value is used when the operand is not passed.
    """

    #: Positional parameters after ``acc`` that are traced as leaves of their own (:meth:`_leaf_values`: a
    #: score_mod's ``index`` leaves, see :data:`~epicute.epilogue.graph.INDEX_KINDS`), not operands.
    LEAF_PARAMS: tuple[str, ...] = ()
    #: Whether those leaves stay in the graph when no output needs them (the kernel's interface).
    KEEP_LEAVES: bool = False
    #: What the hook is called in errors, and its signature.
    HOOK: str = "epilogue"
    SIGNATURE: str = "f(acc, *operands)"
    #: The name of the function's first parameter (the accumulator), as errors call it.
    value_name: str = "acc"

    def __init__(self, fn: Callable) -> None:
        if not callable(fn):
            raise EpilogueError(self._not_a_function(fn))
        functools.update_wrapper(self, fn)
        try:
            sig = _signature(fn)
        except (TypeError, ValueError) as exc:  # a callable without a signature (a builtin, a C function)
            raise EpilogueError(f"{self.HOOK} {fn!r}: its signature can't be read ({exc}); pass a Python function "
                                f"{self.SIGNATURE}") from exc  # fmt: skip
        params = list(sig.parameters.values())
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.fn = fn
        self.name: str = getattr(fn, "__name__", type(fn).__name__)
        if not params or params[0].kind not in positional:
            raise EpilogueError(self._first_param_error())
        self.value_name = params[0].name
        for p in params:
            if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                raise EpilogueError(
                    f"{self.HOOK} {self.name!r}: list its operands by name instead of *{p.name}/**{p.name}"
                )
        n_leaves = len(self.LEAF_PARAMS)
        if n_leaves and (len(params) <= n_leaves or any(p.kind not in positional for p in params[1 : 1 + n_leaves])):
            raise EpilogueError(self._leaf_params_error())
        operands = params[1 + n_leaves :]
        self.params: tuple[str, ...] = tuple(p.name for p in operands)
        self.pins: dict[str, str] = {
            p.name: p.annotation.kind
            for p in operands
            if isinstance(p.annotation, type) and issubclass(p.annotation, Pin)
        }
        self.defaults: dict[str, Any] = {p.name: p.default for p in operands if p.default is not p.empty}
        self._keyword_only = frozenset(p.name for p in operands if p.kind is inspect.Parameter.KEYWORD_ONLY)

    @classmethod
    def _not_a_function(cls, fn: Any) -> str:
        return f"an epilogue must be a function of the accumulator, {cls.SIGNATURE}; got {type(fn).__name__}"

    def _first_param_error(self) -> str:
        return f"epilogue {self.name!r}: its first parameter must be the accumulator, e.g. f(acc, ...)"

    def _leaf_params_error(self) -> str:
        listed = ", ".join(self.LEAF_PARAMS)
        return (
            f"{self.name!r}: takes the value first, then the positional indices {listed}, then its operands, "
            f"e.g. f(score, {listed})"
        )

    def _leaf_values(self, rec: Recorder) -> list[Value]:
        """The leaves traced for :attr:`LEAF_PARAMS`, in order (``index`` leaves here)."""
        return [rec.add("index", kind=INDEX_KINDS[i], attrs=(("name", i),)) for i in self.LEAF_PARAMS]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<epilogue {self.name}({', '.join(('acc', *self.params))})>"

    def operands(self, values: Mapping[str, Any], m: int, n: int, l: int = 1) -> dict[str, OperandSpec]:
        """Resolve the operands passed by name (``values``) against an ``L x M x N`` problem."""
        return resolve_operands(
            self.params, values, m, n, l, declared=self.pins, defaults=self.defaults, epilogue=self.name
        )

    def trace(
        self,
        operand_kinds: Mapping[str, str],
        operand_dtypes: Mapping[str, str] | None = None,
        out_dtypes: Mapping[str, torch.dtype | str] | None = None,
        *,
        d_dtype: torch.dtype | str = "fp32",
    ) -> Graph:
        """The graph of this epilogue for operands of these kinds and dtypes (default fp32).

        A tile output is stored in ``out_dtypes[name]`` if given, else in the dtype
        of its own final ``cast``/``quantize``, else in D's requested dtype
        (``out_dtypes["D"]``, defaulting to ``d_dtype``). Reductions are fp32.
        """
        operand_dtypes = operand_dtypes or {}
        if set(operand_kinds) != set(self.params) or not set(operand_dtypes) <= set(self.params):
            raise EpilogueError(
                f"epilogue {self.name!r} takes operands {self.params}; got operand_kinds for "
                f"{tuple(operand_kinds)} and operand_dtypes for {tuple(operand_dtypes)}"
            )
        rec = Recorder(self.HOOK)
        acc = rec.add("acc")
        leaves = self._leaf_values(rec)
        inputs: dict[str, Value] = {}
        for p in self.params:
            kind = operand_kinds[p]
            if kind not in KINDS:
                raise EpilogueError(f"operand {p!r}: kind {kind!r} is not one of {KINDS}")
            dtype = ir_dtype(operand_dtypes.get(p, "fp32"), f"operand {p!r}")
            inputs[p] = rec.add("input", kind=kind, dtype=dtype, attrs=(("name", p),))
        with rec.active():
            try:
                result = self.fn(
                    acc,
                    *leaves,
                    *(inputs[p] for p in self.params if p not in self._keyword_only),
                    **{p: inputs[p] for p in self._keyword_only},
                )
            except EpicuteError:
                raise
            except Exception as exc:  # the function's own error, met while it ran on traced values
                raise _traced_error(exc)(
                    f"{self.HOOK} {self.name!r} raised {type(exc).__name__} while it was traced: {exc}. It runs once, "
                    "on traced values (one number per element, no data): use Python operators and epicute.ops on "
                    "them"
                ) from exc
        outputs = self._outputs(result, rec)
        kept = leaves if self.KEEP_LEAVES else ()
        return _finish(rec, inputs, outputs, self._output_dtypes(outputs, out_dtypes or {}, d_dtype), kept)

    def _outputs(self, result: Any, rec: Recorder) -> dict[str, Node]:
        """The returned outputs as nodes, D first, after checking what each may be."""
        result = result if isinstance(result, dict) else {"D": result}
        if "D" not in result:
            raise EpilogueError(
                f"epilogue {self.name!r} returned outputs {tuple(result)} without 'D', the main output: "
                "return {'D': ..., <aux outputs>}"
            )
        outputs: dict[str, Node] = {}
        for name in ("D", *(k for k in result if k != "D")):
            value = result[name]
            if not isinstance(name, str) or not name.isidentifier():
                raise EpilogueError(f"epilogue {self.name!r}: output name {name!r} must be a Python identifier")
            if not isinstance(value, Value) or value._rec is not rec:
                raise EpilogueError(
                    f"epilogue {self.name!r}: output {name!r} is {type(value).__name__}, not a value computed "
                    f"from {self.value_name} and the operands in this trace"
                )
            node = value.node
            if name == "D" and node.kind != "tile":
                raise EpilogueError(
                    f"epilogue {self.name!r}: D is a {node.kind} value; it must be a tile (one per (m, n)): "
                    f"a function of {self.value_name} or of a tile operand"
                )
            if node.kind != "tile" and node.op not in REDUCTIONS and node.op != "group_scales":
                raise EpilogueError(
                    f"epilogue {self.name!r}: output {name!r} is a {node.kind} value; an aux output is either "
                    "a tile (stored like D) or the result of a reduction (row_sum, col_amax, amax, ...)"
                )
            outputs[name] = node
        return outputs

    def _output_dtypes(
        self, outputs: dict[str, Node], out_dtypes: Mapping[str, torch.dtype | str], d_dtype: torch.dtype | str
    ) -> dict[str, str]:
        unknown = set(out_dtypes) - set(outputs)
        if unknown:
            raise EpilogueError(
                f"out_dtypes names {sorted(unknown)}, but epilogue {self.name!r} returns {tuple(outputs)}"
            )
        explicit = {k: ir_dtype(v, f"out_dtypes[{k!r}]") for k, v in out_dtypes.items()}
        requested_d = explicit.get("D", ir_dtype(d_dtype, "D's dtype"))
        stored: dict[str, str] = {}
        for name, node in outputs.items():
            if node.op in REDUCTIONS or node.op == "group_scales":
                if explicit.get(name, "fp32") != "fp32":
                    raise EpilogueError(f"out_dtypes[{name!r}]: {name} is a reduction, which is always stored fp32")
                stored[name] = "fp32"
            elif node.op == "group_quant":
                if explicit.get(name, node.dtype) != node.dtype:
                    raise EpilogueError(
                        f"out_dtypes[{name!r}]: {name} is quantize_groups' {node.dtype} tile; pick the dtype there"
                    )
                stored[name] = node.dtype
            elif name in explicit:
                stored[name] = explicit[name]
            else:
                stored[name] = node.dtype if optable.rounds(node.op) else requested_d
        return stored


@functools.lru_cache(maxsize=64)
def _traced_error_type(base: type) -> type:
    """An :class:`EpilogueError` that is also a ``base`` (``TypeError``...): callers catching either catch it."""
    return type(f"Epilogue{base.__name__}", (EpilogueError, base), {"__module__": __name__})


def _traced_error(exc: Exception) -> type:
    """The error type an epilogue function's own ``exc`` is raised as: an EpilogueError, of ``exc``'s type too
    where that is a plain one (a TypeError from calling an op wrongly stays a TypeError)."""
    if type(exc) in (TypeError, AttributeError, NameError, ZeroDivisionError, OverflowError, IndexError):
        return _traced_error_type(type(exc))
    return EpilogueError


def _finish(
    rec: Recorder, inputs: dict[str, Value], outputs: dict[str, Node], dtypes: dict[str, str], leaves=()
) -> Graph:
    """Drop nodes no output needs (inputs and ``leaves`` stay: they are the kernel's interface), renumber densely."""
    live = {0, *(v.id for v in (*inputs.values(), *leaves)), *(node.id for node in outputs.values())}
    for node in reversed(rec.nodes):
        if node.id in live:
            live.update(node.args)
    new_id = {old: new for new, old in enumerate(sorted(live))}
    nodes = tuple(
        replace(node, id=new_id[node.id], args=tuple(new_id[a] for a in node.args))
        for node in rec.nodes
        if node.id in live
    )
    return Graph(
        nodes=nodes,
        inputs=tuple((name, new_id[v.id]) for name, v in inputs.items()),
        outputs=tuple((name, new_id[node.id]) for name, node in outputs.items()),
        output_dtypes=tuple(dtypes.items()),
    )


def epilogue(fn: Callable) -> Epilogue:
    """Decorator: make ``fn(acc, *operands)`` an epilogue for ``epicute.gemm(..., epilogue=fn)``.

    Example:
        >>> import epicute
        >>> @epicute.epilogue
        ... def ffn_out(acc, bias, residual, alpha):
        ...     return {"D": epicute.ops.gelu(alpha * acc + bias) + residual}
        >>> print(ffn_out.trace({"bias": "row", "residual": "tile", "alpha": "scalar"}))
        %0 = acc() : tile fp32
        %1 = input(name='bias') : row fp32
        %2 = input(name='residual') : tile fp32
        %3 = input(name='alpha') : scalar fp32
        %4 = mul(%3, %0) : tile fp32
        %5 = add(%4, %1) : tile fp32
        %6 = gelu_erf(%5) : tile fp32
        %7 = add(%6, %2) : tile fp32
        output D = %7
    """
    if isinstance(fn, Epilogue):
        if fn.HOOK != Epilogue.HOOK:  # a score_mod traces its indices as leaves an epilogue does not have
            raise EpilogueError(
                f"{fn!r} is a {fn.HOOK} (epicute.{fn.HOOK}), not an epilogue: pass it as {fn.HOOK}=, or pass an "
                f"epilogue function {Epilogue.SIGNATURE} as epilogue="
            )
        return fn
    return Epilogue(fn)


#: What a caller passing ``epilogue=`` uses: decorated or not, any function of ``acc`` is accepted.
as_epilogue = epilogue


def with_leading_operands(
    epilogue: Callable | None, names: tuple[str, ...], kinds: tuple[str, ...], combine: Callable, owner: str,
) -> Callable:  # fmt: skip
    """``f(acc, *names, *operands) = epilogue(combine(acc, *names), *operands)`` (``combine(acc, *names)`` alone
    without an epilogue): a step a caller puts before the user's epilogue (a layer's bias, peers' partial sums), as
    one traced epilogue keeping the user's operand names, pins and defaults; ``kinds`` pins the leading operands.

    One composite per :func:`trace_key` of the epilogue (a lambda written in the call is a new object each time, and
    a new composite would be traced and planned again on every call). ``owner`` names the caller in the error for
    an epilogue operand that takes one of ``names``."""
    key = (trace_key(epilogue) if epilogue is not None else (), names, kinds, combine, owner)
    composite = _COMPOSITES.get(key) if key[0] is not None else None
    if composite is None:
        composite = _compose(epilogue, names, kinds, combine, owner)
        if key[0] is not None:
            if len(_COMPOSITES) >= 1024:
                _COMPOSITES.clear()
            _COMPOSITES[key] = composite
    return composite


_COMPOSITES: dict[tuple, Callable] = {}


def _compose(epilogue: Callable | None, names: tuple, kinds: tuple, combine: Callable, owner: str) -> Callable:
    epi = as_epilogue(epilogue) if epilogue is not None else None
    clash = sorted(set(names) & set(epi.params if epi else ()))
    if clash:
        raise EpilogueError(f"epilogue {epi.name!r} takes an operand named {clash[0]!r}; {owner} passes its own "
                            f"{clash[0]!r} before the epilogue: rename the epilogue's")  # fmt: skip
    count = len(names)

    def composite(acc, *values):
        combined = combine(acc, *values[:count])
        return epi.fn(combined, *values[count:]) if epi is not None else combined

    param = functools.partial(inspect.Parameter, kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [param("acc"), *(param(name, annotation=PINS[kind]) for name, kind in zip(names, kinds, strict=True))]
    if epi is not None:
        params += [param(p, annotation=PINS[epi.pins[p]] if p in epi.pins else inspect.Parameter.empty,
                         default=epi.defaults.get(p, inspect.Parameter.empty)) for p in epi.params]  # fmt: skip
    composite.__signature__ = inspect.Signature(params)
    composite.__name__ = f"{epi.name}_after_{'_'.join(names)}" if epi is not None else f"plus_{'_'.join(names)}"
    return composite


def trace_for_gemm(
    epi: Epilogue,
    specs: Mapping[str, Any],
    d_dtype: torch.dtype,
    d_explicit: bool,
    out_dtypes: Mapping[str, torch.dtype] | None = None,
    outs_dtypes: Mapping[str, torch.dtype] | None = None,
) -> Graph:
    """The graph ``epicute.gemm`` runs, with every output's stored dtype settled.

    D is stored in ``d_dtype`` when the caller fixed it (``out``, ``out_dtype``
    or ``out_dtypes["D"]``: ``d_explicit``), else in the dtype of the epilogue's
    own final cast/quantize, else in ``d_dtype`` (a's dtype). Preallocated aux
    outputs (``outs_dtypes``) fix theirs unless ``out_dtypes`` names them;
    names the epilogue does not return are left for the caller to reject.
    """
    kinds = {k: s.kind for k, s in specs.items()}
    operand_dtypes = {k: s.dtype for k, s in specs.items()}
    dtypes = dict(out_dtypes or {})
    if d_explicit:
        dtypes["D"] = d_dtype
    graph = epi.trace(kinds, operand_dtypes, dtypes, d_dtype=d_dtype)
    stored = dict(graph.output_dtypes)
    pinned = {
        name: dtype
        for name, dtype in (outs_dtypes or {}).items()
        if name in stored and name not in dtypes and stored[name] != ir_dtype(dtype, f"outs[{name!r}]")
    }
    return epi.trace(kinds, operand_dtypes, {**dtypes, **pinned}, d_dtype=d_dtype) if pinned else graph


def trace_key(fn: Callable) -> tuple | None:
    """What tracing ``fn`` depends on: its code, closure values, defaults, annotations and
    the module globals it names (not the function object: a lambda written inside the
    call is a new object each time, with the same trace). A later call with an equal key
    may reuse the trace; ``None`` (something unhashable) means always trace. A subclass of :class:`Epilogue`
    traces the same function otherwise (a gated one binds its second parameter to ``up``): its kind is part of it."""
    kind = type(fn).__name__ if isinstance(fn, Epilogue) and type(fn) is not Epilogue else None
    fn = getattr(fn, "fn", fn)  # an Epilogue's function
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells = tuple(cell.cell_contents for cell in fn.__closure__ or ())
    names = tuple((name, _contents(fn.__globals__[name])) for name in code.co_names if name in fn.__globals__)
    annotations = tuple(getattr(fn, "__annotations__", {}).items())
    key = (kind, code, cells, fn.__defaults__, tuple(sorted((fn.__kwdefaults__ or {}).items())), annotations, names)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _contents(value: Any) -> Any:
    """A module global as a trace key holds it: a dict, list or set by its contents (a module's table of names,
    read at trace time, keys the trace by what it holds then), anything else as it is."""
    if isinstance(value, dict):
        return ("dict", tuple((k, _contents(v)) for k, v in value.items()))
    if isinstance(value, (list, set)):
        return (type(value).__name__, tuple(_contents(v) for v in value))
    return value


class TraceMemo:
    """A family's prepared calls (traced, lowered, planned), remembered by :func:`trace_key` of the epilogue and
    the rest of the request (its tensor-free signature): a repeat call neither traces nor plans."""

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._entries: dict[tuple, Any] = {}

    def get(self, epilogue: Callable, signature: tuple, prepare: Callable[[], Any]) -> Any:
        """The remembered result for ``(epilogue, signature)``, else ``prepare()`` (remembered when the epilogue
        has a trace key)."""
        capture = trace_key(epilogue)
        key = None if capture is None else (capture, signature)
        found = self._entries.get(key) if key is not None else None
        if found is None:
            found = prepare()
            if key is not None:
                if len(self._entries) >= self.limit:
                    self._entries.clear()
                self._entries[key] = found
        return found
