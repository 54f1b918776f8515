"""torch.compile fusing into epicute, first part: a backend that lifts each linear layer, with the chain of
elementwise ops consuming it, into one :func:`epicute.gemm` whose epilogue is traced from those ops, and each
``F.scaled_dot_product_attention`` into :func:`epicute.attention`, then hands the graph to Inductor.

    compiled = torch.compile(model, backend=epicute.integrations.compile.backend)
    print(epicute.integrations.compile.last_report())   # what was lifted, what was left and why
    epicute.integrations.compile.last_report().explain(sys.stdout)   # and each lifted kernel's plan

The backend rewrites Dynamo's graph (torch-level calls, before AOTAutograd), so a lifted layer trains through the
epicute op's own autograd: its backward epilogue is derived from the lifted ops (:mod:`epicute.gemm.autograd`).
Everything else stays Inductor's. Lifted: ``F.linear``, ``x @ w``, ``torch.mm`` and ``torch.addmm(b, x, w)`` with a
2-D ``w`` (any leading dimensions, a linear's or addmm's bias too; bf16 or fp16, ``in`` and ``out`` multiples of 8), and
``torch.bmm`` (``a @ b`` of two 3-D tensors, as one batched GEMM), followed by single-use
``gelu``/``relu``/``silu``/``sigmoid``/``tanh`` and ``+ - * /`` with numbers, ``(out,)`` vectors, per-row
``(..., 1)`` columns or tensors of the output's shape (in the dtype of the value they meet), and float casts
(``.float()``, ``.to(dtype)``: the fp32 epilogue goes on, the last cast sets the output's dtype);
``torch._grouped_mm(x, w, offs=offs)``
(what ``F.grouped_mm`` and transformers' grouped experts record) with the same chains, as one
:func:`epicute.grouped_gemm` (an MoE layer's SiLU and router weights ride in its epilogue). On a GPU
each candidate, GEMM chain or attention, is kept only where it wins (:class:`Measured`: epicute's call against the
unlifted call compiled by Inductor with the graph's own settings, ``mode="max-autotune"``'s autotuning included,
forward and backward where the graph trains, on random inputs of the graph's sizes, once per call, sizes, settings
and GPU, remembered on disk); on a CPU every candidate is lifted. A lifted epilogue
computes in fp32 without the intermediate roundings to bf16 that the unfused ops make. Attention is lifted without a
mask or dropout, bf16 or fp16, head_dim 64, 128 or 256, any GQA ratio; causal only with as many queries as keys
(torch aligns a causal mask top-left, epicute bottom-right: they agree only there). What models do around SDPA under
torch.compile is read through: keys and values repeated to the query heads (transformers' ``repeat_kv``) are taken
unrepeated, and an ``attn_mask`` the graph builds from its static sizes alone (transformers' causal mask, explicit
while compiling) is evaluated while compiling and lifted as ``causal`` where it is the causal mask (dropped where it
masks nothing); any other mask stays SDPA's. ``flex_attention`` likewise, with
no block mask or a causal one, its score_mod read from Dynamo's graph of it (:func:`_score_program`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import json
import operator
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TextIO

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from epicute.epilogue import ops
from epicute.epilogue.operands import RowVector
from epicute.errors import ConfigError
from epicute.nn import functional as EF
from epicute.runtime.cache import JsonTable, code_versions

if TYPE_CHECKING:
    from epicute.runtime.precompile import Precompiled

#: torch callables (as Dynamo records them) -> the epicute op each becomes
FUNCTIONS: dict[Any, str] = {
    F.gelu: "gelu", torch.relu: "relu", F.relu: "relu", F.silu: "silu", torch.sigmoid: "sigmoid",
    torch.tanh: "tanh", operator.add: "add", torch.add: "add", operator.mul: "mul", torch.mul: "mul",
    operator.sub: "sub", torch.sub: "sub", operator.truediv: "div", torch.div: "div",
}  # fmt: skip
#: tensor methods -> the epicute op
METHODS = {"add": "add", "mul": "mul", "sub": "sub", "div": "div", "relu": "relu", "sigmoid": "sigmoid",
           "tanh": "tanh"}  # fmt: skip
#: epicute op -> how a lifted step applies it to traced values
APPLY: dict[str, Callable] = {
    **EF.ACTIVATIONS, "sigmoid": ops.sigmoid, "tanh": ops.tanh,
    "add": operator.add, "mul": operator.mul, "sub": operator.sub, "div": operator.truediv,
    # a cast is no step of the fp32 epilogue: the chain's last one sets the stored dtype (``_output_dtype``)
    "to_float32": lambda value: value, "to_bfloat16": lambda value: value, "to_float16": lambda value: value,
}  # fmt: skip
LIFTED_DTYPES = (torch.bfloat16, torch.float16)
#: Inductor settings of ``torch.compile``'s modes that a candidate's peer is compiled without (:class:`Measured`)
CUDA_GRAPH_SETTINGS = frozenset(("triton.cudagraphs", "triton.cudagraph_trees"))
#: the GEMM calls lifted: ``F.linear(x, w, b)`` (``w`` ``(out, in)``), ``x @ w`` / ``torch.mm(x, w)`` (``w``
#: ``(in, out)``), ``torch.addmm(b, x, w)`` (``x @ w + b``) and the batched ``torch.bmm(a, b)`` (or ``a @ b`` of two 3-D
#: tensors); as Dynamo records them, functions or tensor methods
GEMMS = (F.linear, operator.matmul, torch.matmul, torch.mm, torch.addmm, torch.bmm)
GEMM_METHODS = {"matmul": torch.matmul, "mm": torch.mm, "bmm": torch.bmm}


@dataclass
class Report:
    """One graph's rewrite: each linear node, lifted (with the ops its epilogue took) or left (and why)."""

    lifted: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)
    #: each decided candidate's measurement (node, what decided it), lifted or left
    measured: list[tuple[str, str]] = field(default_factory=list)
    #: each lifted node's call, its inputs as meta tensors of the graph's sizes (what :meth:`explain` plans)
    calls: dict[str, Candidate] = field(default_factory=dict)
    #: how the candidates' kernels were compiled before measuring (:meth:`Measured.precompile`), where they were
    precompiled: Precompiled | None = None
    #: the Inductor settings the measured candidates' peers were compiled with (:attr:`Measured.settings`)
    peer_settings: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        def kernel(steps: tuple[str, ...]) -> str:
            if steps[:1] == ("attention",):
                return "attention" + (f" ({', '.join(steps[1:])})" if steps[1:] else "")
            if steps[:1] == ("flex attention",):
                return f"flex attention -> {', '.join(steps[1:]) or '(no score_mod)'}"
            head, rest = (f"{steps[0]} gemm", steps[1:]) if steps[:1] in (("grouped",), ("batched",)) else (
                "linear", steps)  # fmt: skip
            return f"{head} -> {', '.join(rest) or '(no epilogue)'}"

        because = dict(self.measured)
        lines = [f"lifted {node}: {kernel(steps)}" + (f" ({because[node]})" if node in because else "")
                 for node, steps in self.lifted]  # fmt: skip
        lines += [f"left {node}: {why}" for node, why in self.left]
        lines += [f"kernels: {self.precompiled}"] if self.precompiled is not None else []
        if self.peer_settings and self.measured:
            settings = ", ".join(f"{name}={value}" for name, value in sorted(self.peer_settings.items()))
            lines.append(f"measured against Inductor compiled with {settings}")
        return "\n".join(lines) or "no linear layers in the graph"

    def explain(self, file: TextIO | None = None) -> str:
        """This report, then the plan of each lifted node's kernel at the graph's sizes (symbolic ones by their
        hints): the text :func:`epicute.explain`, :func:`epicute.explain_grouped` or
        :func:`epicute.explain_attention` prints for the call that replaced it. Written to ``file`` when given;
        returned.

        Example:
            >>> import functools, torch, epicute
            >>> from epicute.integrations import compile as EC
            >>> def mlp(x, w, b):
            ...     return torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
            >>> x, w, b = torch.randn(8, 64), torch.randn(32, 64), torch.randn(32)
            >>> backend = functools.partial(EC.backend, inner="aot_eager")
            >>> with epicute.use_backend("reference"):
            ...     y = torch.compile(mlp, backend=backend)(*(t.bfloat16() for t in (x, w, b)))
            >>> text = EC.last_report().explain()
            >>> text.splitlines()[0]
            'lifted linear: linear -> add, gelu'
        """
        parts = [str(self)]
        for node, call in self.calls.items():
            plan = io.StringIO()
            call.explain(plan)
            parts.append(f"\n== {node}\n{plan.getvalue().rstrip()}")
        text = "\n".join(parts) + "\n"
        if file is not None:
            file.write(text)
        return text


_REPORTS: list[Report] = []


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: a chain's casts, by the dtype cast to: identity steps of the fp32 epilogue; the last one sets the output's dtype
CASTS: dict[torch.dtype, str] = {torch.float32: "to_float32", torch.bfloat16: "to_bfloat16",
                                 torch.float16: "to_float16"}  # fmt: skip
#: tensor methods that cast to one dtype (``.to(dtype)`` and ``.type(dtype)`` name theirs)
CAST_METHODS = {"float": torch.float32, "bfloat16": torch.bfloat16, "half": torch.float16}


def _cast_to(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype)

    cast.__name__ = CASTS[dtype]
    return cast


#: epicute op -> a torch call that makes it (FUNCTIONS read backwards): what a candidate's unlifted chain calls
TORCH_STEPS: dict[str, Callable] = {op: fn for fn, op in FUNCTIONS.items()} | {"gelu_tanh": _gelu_tanh} | {
    op: _cast_to(dtype) for dtype, op in CASTS.items()}  # fmt: skip
#: Lift decisions measured on this machine, kept beside the kernels (``lifted.json``).
LIFTED = JsonTable("lifted.json")


@dataclass(frozen=True)
class Candidate:
    """A liftable call: the torch call it starts with (a GEMM and the elementwise chain after it, or an attention),
    the epicute call that would replace it, the example values of its inputs (the torch call's, then the chain's
    operands), the epicute call's keyword arguments (a chain's ``program`` among them) and the torch call's."""

    target: Callable
    lifted: Callable
    inputs: tuple
    arity: int
    options: tuple
    torch_options: tuple = ()
    #: whether the graph runs with gradients enabled (under ``no_grad`` or ``inference_mode`` nothing trains)
    grad_enabled: bool = True

    def key(self) -> str:
        """What the decision depends on: the call, its inputs' sizes, strides, dtypes and whether they need gradients,
        the GPU, the code."""
        device = self.inputs[0].device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        metas = [(_hints(t.shape), _hints(t.stride()), str(t.dtype), t.requires_grad) for t in self.inputs]
        text = json.dumps([getattr(self.target, "__name__", str(self.target)), self.lifted.__name__, repr(self.options),
                           repr(self.torch_options), metas, self.trains(), name, torch.__version__,
                           code_versions()])  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()

    def on_meta(self) -> Candidate:
        """The same call with its inputs as meta tensors of the example values' sizes and strides (hints for
        symbolic ones): what a report keeps, without the compile's fake tensors."""
        metas = tuple(torch.empty_strided(_hints(t.shape), _hints(t.stride()), dtype=t.dtype, device="meta")
                      for t in self.inputs)  # fmt: skip
        return replace(self, inputs=metas)

    def explain(self, file: TextIO) -> None:
        """Print the plan of the epicute call (as :data:`EXPLAINERS` says it) to ``file``."""
        EXPLAINERS[self.lifted](*self.inputs, **dict(self.options), file=file)

    def trains(self) -> bool:
        """Whether the graph differentiates through the call (an input requires grad, with gradients enabled)."""
        return self.grad_enabled and any(t.requires_grad for t in self.inputs)

    def real_inputs(self) -> list[torch.Tensor]:
        """Random tensors like the example values (group ends split the rows evenly)."""
        made = []
        for i, t in enumerate(self.inputs):
            shape, stride = _hints(t.shape), _hints(t.stride())
            if self.lifted is lifted_grouped_gemm and i == 2:  # offs
                rows, groups = _hints(self.inputs[0].shape)[0], shape[0]
                made.append(torch.arange(1, groups + 1, device=t.device, dtype=t.dtype) * rows // groups)
            else:
                made.append(torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device).normal_())
        return made

    def epicute(self) -> Callable:
        return functools.partial(self.lifted, **dict(self.options))

    def unlifted(self) -> torch.fx.GraphModule:
        """The call as torch calls: what the graph held before lifting."""
        graph = torch.fx.Graph()
        args = [graph.placeholder(f"a{i}") for i in range(len(self.inputs))]
        call_args, operands = args[: self.arity], args[self.arity :]
        if self.target is torch._grouped_mm:
            value = graph.call_function(torch._grouped_mm, tuple(call_args[:2]), {"offs": call_args[2]})
        else:
            value = graph.call_function(self.target, tuple(call_args), dict(self.torch_options))
        steps, _ = dict(self.options).get("program", ((), ()))
        for op, refs in steps:
            call_args = tuple(value if r[0] == "acc" else operands[r[1]] if r[0] == "operand" else r[1] for r in refs)
            value = graph.call_function(TORCH_STEPS[op], call_args)
        graph.output((value,))  # a tuple, as Dynamo's graphs return (what compile backends take)
        return torch.fx.GraphModule(torch.nn.Module(), graph)


def _hints(sizes) -> list[int]:
    """Sizes (or strides) as numbers, a symbolic one by its hint (never a guard)."""
    return [s.node.hint if isinstance(s, torch.SymInt) else int(s) for s in sizes]


@dataclass
class Measured:
    """Keep a candidate where epicute's call takes no longer than the unlifted call compiled by Inductor, timed once
    on random inputs like the graph's and remembered on disk (:data:`LIFTED`). Where the graph trains (an input
    requires grad) each side is timed forward and backward, as one joint function (:func:`_joint`); otherwise
    forward. ``settings`` are the Inductor config the graph is compiled with (``torch.compile``'s ``mode`` and
    ``options``, as :func:`backend` hands them on): the unlifted call is compiled with them too, so under
    ``mode="max-autotune"`` a candidate meets Inductor's autotuned GEMM, and a decision is remembered per settings.
    Without CUDA graphs in them, each side's host time counts beside its GPU time (:class:`Cost`): a step queued
    ahead by the host hides its calls' host cost only while their GPU work outlasts it (ViT's block, its linears
    lifted on GPU time alone, ran 0.70x plain torch.compile; bench/NOTES.md). Epicute's side is timed as the compiled
    graph calls its ops (:func:`_as_the_graph_calls`), so that its host time is the graph's. ``timer`` (what decides
    for ``fn(*inputs)``: milliseconds, or a :class:`Cost`) and ``peer`` (compiles a graph of the unlifted call) may be
    replaced: tests do. :meth:`precompile` readies both sides of many candidates at once."""

    timer: Callable[[Callable, list], float | Cost] | None = None
    peer: Callable[[torch.fx.GraphModule, list], Callable] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    #: candidates' sides readied by :meth:`precompile`, by key, until measured
    _ready: dict[str, _Sides] = field(default_factory=dict, init=False, repr=False)

    #: whether the graph runs without CUDA graphs, so that each call's host cost is paid as the step runs
    counts_host: bool = field(init=False)

    def __post_init__(self) -> None:
        # CUDA graphs take the host's cost away, and the peer is measured without them: one replayed from a graph
        # would hand the timer outputs that its next replay overwrites.
        self.counts_host = not any(self.settings.get(name) for name in CUDA_GRAPH_SETTINGS)
        self.settings = {name: value for name, value in self.settings.items() if name not in CUDA_GRAPH_SETTINGS}

    def key(self, candidate: Candidate) -> str:
        """The candidate's decision key (:meth:`Candidate.key`), with these settings where there are any and whether
        host time counts where it does not."""
        key = candidate.key()
        if not self.settings and self.counts_host:
            return key
        text = json.dumps([key, sorted((name, repr(value)) for name, value in self.settings.items()),
                           "host counts" if self.counts_host else "CUDA graphs"])  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()

    def _cost(self, fn: Callable, inputs: list) -> Cost:
        """The default timer: GPU milliseconds of ``fn(*inputs)``, and the host's where they count."""
        return Cost(_time_ms(fn, inputs), _host_ms(fn, inputs) if self.counts_host else None)

    def __call__(self, candidate: Candidate) -> tuple[bool, str]:
        key = self.key(candidate)
        stored = LIFTED.get(key)
        if stored is not None:
            return stored["lift"], stored["why"]
        return _outside_the_compile(functools.partial(self._measure, candidate, key))

    def precompile(self, candidates: list[Candidate]) -> Precompiled:
        """Compile the kernels of every candidate that may be lifted (all but those measured before and left) in
        worker processes at once (:func:`epicute.runtime.precompile.precompile`), while Inductor compiles the
        unlifted calls to be measured against them: the measurements then find both sides compiled."""
        from epicute.runtime.cache import cache_dir
        from epicute.runtime.precompile import Precompiled, compile_workers, precompile

        if not compile_workers() or cache_dir() is None:  # each kernel compiled where a measurement first needs it
            return Precompiled()
        todo: dict[str, Candidate] = {}
        unmeasured: set[str] = set()
        for candidate in candidates:
            stored = LIFTED.get(key := self.key(candidate))
            if stored is None or stored["lift"]:
                todo.setdefault(key, candidate)
            if stored is None:
                unmeasured.add(key)

        def run() -> Precompiled:
            try:  # every candidate's inputs at once: where they do not fit, each is measured alone, as without workers
                sides = {key: self._sides(candidate) for key, candidate in todo.items()}
            except torch.OutOfMemoryError as exc:
                return Precompiled(skipped=f"the candidates' inputs at once: {exc}".splitlines()[0])
            runs = [functools.partial(side.eager, *side.inputs) for side in sides.values()]
            peers = [functools.partial(self._compile_peer, sides[key]) for key in sides if key in unmeasured]
            with torch.no_grad():
                done = precompile(runs, idle=peers)
            self._ready.update((key, sides[key]) for key in sides if key in unmeasured)
            return done

        return _outside_the_compile(run)

    def _sides(self, candidate: Candidate) -> _Sides:
        """Random inputs like the graph's and both sides' calls on them, joint forward and backward where the graph
        trains (the incoming gradient appended to the inputs)."""
        inputs = candidate.real_inputs()
        ours, theirs = candidate.epicute(), candidate.unlifted()
        trains = candidate.trains()
        if trains:
            needs = [t.requires_grad for t in candidate.inputs]
            with torch.no_grad():
                grad = torch.randn_like(theirs(*inputs)[0])  # the gradient both backward passes start from
            inputs = [*inputs, grad]
            ours, theirs = _joint(ours, needs), _joint(theirs, needs)
        return _Sides(inputs, _as_the_graph_calls(ours, inputs), theirs, trains, eager=ours)

    def _compile_peer(self, side: _Sides) -> None:
        """Inductor's compile of the unlifted side (or why there is none), kept on ``side``."""
        from torch._inductor.compile_fx import compile_fx

        try:
            with torch.no_grad():
                graph = make_fx(side.theirs, tracing_mode="fake")(*side.inputs) if side.trains else side.theirs
                compile_peer = self.peer or functools.partial(compile_fx, config_patches=self.settings)
                side.peer = compile_peer(graph, side.inputs)
        except Exception as exc:  # noqa: BLE001 - no figure to beat: lifted, as without measuring
            side.peer = exc

    def _measure(self, candidate: Candidate, key: str) -> tuple[bool, str]:
        """Time both sides; the decision, remembered under ``key`` where both were measured."""
        timer = self.timer or self._cost
        side = self._ready.pop(key, None) or self._sides(candidate)
        with torch.no_grad():
            try:
                ours = Cost.of(_ours_cost(timer, side))
            except Exception as exc:  # noqa: BLE001 - epicute's call failed here: the chain stays Inductor's
                return False, f"epicute's call failed on inputs like the graph's ({type(exc).__name__}: {exc})"
            if side.peer is None:
                self._compile_peer(side)
            if isinstance(side.peer, Exception):
                return True, f"Inductor's chain not measured ({type(side.peer).__name__}: {side.peer})"
            try:
                theirs = Cost.of(timer(side.peer, side.inputs))
            except Exception as exc:  # noqa: BLE001 - as above
                return True, f"Inductor's chain not measured ({type(exc).__name__}: {exc})"
        lift = ours.no_worse_than(theirs)
        what = "measured (forward and backward)" if side.trains else "measured"
        why = f"{what}: epicute {ours}, Inductor {theirs}{theirs.rule()}"
        LIFTED.put(key, {"lift": lift, "why": why})
        return lift, why


@dataclass(frozen=True)
class Cost:
    """What one side of a candidate costs a step: its GPU milliseconds and, without CUDA graphs, its host's (the
    host enqueuing its kernels while the GPU waits on nothing).

    How much host time costs depends on the step around the call, which is not measured: where the host runs ahead
    of a busy GPU (Llama's large GEMMs) it hides, where the step's calls are small (ViT's block) every millisecond of
    it adds. Inductor's own side stands for the step: its host time over its GPU time (at most 1) is the weight
    epicute's extra host time takes. A side is kept where it is no worse both by the longer of its GPU and host
    time and by its GPU time plus the weighed host time. (ViT's MLP output projection was lifted on the longer alone,
    0.4397 against 0.4427 ms, and its step ran 0.87x plain torch.compile against 1.03x with nothing lifted;
    bench/NOTES.md.)"""

    gpu_ms: float
    host_ms: float | None = None

    @classmethod
    def of(cls, timed: float | Cost) -> Cost:
        """A timer's figure as a cost (a number: GPU milliseconds alone)."""
        return timed if isinstance(timed, Cost) else cls(float(timed))

    def host_weight(self) -> float:
        """This side's host time over its GPU time, at most 1 (0 where host time does not count)."""
        if self.host_ms is None:
            return 0.0
        return min(1.0, self.host_ms / self.gpu_ms) if self.gpu_ms > 0 else 1.0

    def longer_ms(self) -> float:
        """A step that queues the call ahead pays the longer of its GPU and host time."""
        return self.gpu_ms if self.host_ms is None else max(self.gpu_ms, self.host_ms)

    def weighed_ms(self, weight: float) -> float:
        """GPU time plus ``weight`` times the host's: the step's price where that share of host time adds."""
        return self.gpu_ms + weight * (self.host_ms or 0.0)

    def no_worse_than(self, theirs: Cost) -> bool:
        """Whether this side (epicute's) costs no more than ``theirs`` (Inductor's) by both rules above."""
        weight = theirs.host_weight()
        return self.longer_ms() <= theirs.longer_ms() and self.weighed_ms(weight) <= theirs.weighed_ms(weight)

    def rule(self) -> str:
        """How the figures were compared, for a decision's reason (of Inductor's side)."""
        if self.host_ms is None:
            return ""
        return (f" (no CUDA graphs: kept where no worse by the longer of GPU and host time, and by GPU time plus "
                f"host time weighed {self.host_weight():.2f}, Inductor's host over GPU time)")  # fmt: skip

    def __str__(self) -> str:
        if self.host_ms is None:
            return f"{self.gpu_ms:.4g} ms"
        return f"{self.gpu_ms:.4g} ms GPU, {self.host_ms:.4g} ms host"


@dataclass
class _Sides:
    """A candidate's two sides as :class:`Measured` times them: the inputs, epicute's call (as the compiled graph
    calls its ops, :func:`_as_the_graph_calls`; ``eager``: as written, what precompiling runs to find its kernels),
    the unlifted call and, once compiled, Inductor's (or the exception its compile raised)."""

    inputs: list
    ours: Callable
    theirs: Callable
    trains: bool
    eager: Callable
    peer: Callable | Exception | None = None


def _ours_cost(timer: Callable, side: _Sides) -> float | Cost:
    """``timer`` of epicute's side; where its traced calls cannot run here (the reference backend runs no attention
    backward under a compiled graph's trace), of the side as written."""
    try:
        return timer(side.ours, side.inputs)
    except Exception:
        if side.ours is side.eager:
            raise
        return timer(side.eager, side.inputs)


def _joint(fn: Callable, trains: list[bool]) -> Callable:
    """``fn``'s forward and its backward as one function ``joint(*inputs, grad)`` returning ``(out, *gradients)`` of
    the inputs ``trains`` marks. Traced (``make_fx``) it is one inference graph of forward and backward, which
    Inductor compiles at once: a peer compiled for training would compile its backward lazily, on autograd's device
    thread, under Dynamo's compile lock that the compiling thread holds (a deadlock on a GPU)."""

    def joint(*args):
        *inputs, grad = args
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(needs) for t, needs in zip(inputs, trains)]
            out = fn(*leaves)
            out = out[0] if isinstance(out, (tuple, list)) else out
            grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad)
        return (out.detach(), *grads)

    return joint


def _as_the_graph_calls(fn: Callable, inputs: list) -> Callable:
    """``fn`` (epicute's side) traced into the calls of epicute's ops that a compiled graph makes: AOTAutograd
    traces the lifted call's forward and backward ahead, so the graph runs those ops one after another, with no
    autograd engine and none of the Python that decided them. Timed eagerly instead, the side's host time counted
    that work too (ViT's linears: ~1 ms forward and backward against Inductor's 0.16; bench/NOTES.md). Where it does
    not trace, ``fn`` itself (its host time then overstated, never understated)."""
    try:
        with torch.no_grad():
            return make_fx(fn, tracing_mode="fake")(*inputs)
    except Exception:  # noqa: BLE001 - measured as it is
        return fn


def _outside_the_compile(measure: Callable[[], Any]) -> Any:
    """``measure()`` as an eager program would run it. The backend runs inside Dynamo's compile: without its tracing
    context and fake mode, Inductor's compile of the peer makes its symbols in a shape environment of its own
    (in Dynamo's, the graph's guards found no source for them), and with ``torch.compiler.is_compiling()`` lowered
    epicute's entry points take their eager paths."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    flag = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = False
    try:
        with torch._guards.tracing(None), unset_fake_temporarily():
            return measure()
    finally:
        torch.compiler._is_compiling_flag = flag


def always(candidate: Candidate) -> tuple[bool, str]:
    """A policy that lifts every candidate (what the backend does on a CPU)."""
    return True, "lifted without measuring"


#: GPU cycles (~2 ms on an H200) the stream sleeps before each measured call: a training candidate's host cost (its
#: forward and backward through autograd, ~1 ms for epicute's, bench/NOTES.md) must pass under it, or the figure is
#: host time rather than the kernels' that a compiled step, queued ahead by the host, runs at
MEASURE_HOST_AHEAD_CYCLES = 4_000_000
#: calls :func:`_host_ms` takes the median of
HOST_ROUNDS = 7
#: Milliseconds of GPU work a side's timing aims at: :func:`_time_ms` takes the median of as many calls as fit
#: (between :data:`TIMED_CALLS`), so a long call is timed over fewer. A cold first call waits on every one: Llama's
#: LM head, 37 ms forward and backward, took 25 calls a side (1.9 s of a 38 s first call; bench/NOTES.md).
MEASURE_BUDGET_MS = 60.0
#: The fewest and most timed calls of a side (after two warm-up calls)
TIMED_CALLS = (5, 20)


def _time_ms(fn: Callable, inputs: list) -> float:
    """Median milliseconds of GPU work of ``fn(*inputs)`` (the host enqueues each call while the GPU sleeps), over
    as many calls as :data:`MEASURE_BUDGET_MS` holds by a first call's time."""
    from epicute.benchmark import time_cuda

    def timed(warmup: int, iters: int) -> float:
        return time_cuda(lambda: fn(*inputs), warmup=warmup, iters=iters, host_ahead_cycles=MEASURE_HOST_AHEAD_CYCLES)

    fewest, most = TIMED_CALLS
    first = timed(1, 1)
    return timed(2, min(most, max(fewest, int(MEASURE_BUDGET_MS / max(first, 1e-3)))))


def _host_ms(fn: Callable, inputs: list) -> float:
    """Median milliseconds the host takes to run ``fn(*inputs)`` (enqueue its kernels: the GPU sleeps meanwhile, so no
    launch waits for a free slot in the queue)."""
    fn(*inputs)  # warm: caches of plans, bound launches and autograd's
    times = []
    for _ in range(HOST_ROUNDS):
        torch.cuda.synchronize()
        torch.cuda._sleep(MEASURE_HOST_AHEAD_CYCLES)
        start = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e3 * statistics.median(times)


def last_report() -> Report | None:
    """The report of the graph the backend compiled last (None before any)."""
    return _REPORTS[-1] if _REPORTS else None


def backend(gm: torch.fx.GraphModule, example_inputs: list, inner: str = "inductor",
            decide: Callable[[Candidate], tuple[bool, str]] | None = None, *, mode: str | None = None,
            options: dict[str, Any] | None = None) -> Callable:  # fmt: skip
    """A ``torch.compile`` backend: :func:`lift_linear_epilogues` on Dynamo's graph, then ``inner`` (Inductor, or
    ``"aot_eager"``: AOTAutograd without Inductor's code generation) compiles the result. ``decide`` keeps or drops
    each candidate: by default :class:`Measured` where the graph runs on a GPU (its peers compiled with ``mode``'s and
    ``options``' settings; a ``decide`` of the caller's keeps its own), every candidate on a CPU (whose epicute calls
    compute on the reference backend: nothing there to measure). ``mode`` and ``options`` are
    ``torch.compile``'s own, which it hands to its backend: Inductor's settings for the graph around the lifted calls
    (``mode="reduce-overhead"`` runs the step as CUDA graphs, epicute's calls recorded in them like any op).

    Example:
        >>> compiled = torch.compile(torch.nn.Linear(64, 64), backend=backend, mode="reduce-overhead")  # doctest: +SKIP
    """
    patches = _inductor_settings(inner, mode, options)
    if decide is None and any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
        decide = Measured(settings=patches)
    precompiled = decide.precompile(candidates_of(gm)) if isinstance(decide, Measured) else None
    report = lift_linear_epilogues(gm, decide)
    report.precompiled = precompiled
    report.peer_settings = dict(decide.settings) if isinstance(decide, Measured) else {}
    _REPORTS[:] = [*_REPORTS[-15:], report]
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=patches)
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(inner)(gm, example_inputs)


def _inductor_settings(inner: str, mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """Inductor's config for ``torch.compile``'s ``mode`` and ``options`` (``options`` win where both set one)."""
    from torch._inductor import list_mode_options

    modes = list_mode_options()
    if mode is not None and mode not in modes:
        raise ConfigError(f"mode={mode!r}: torch.compile's modes are {', '.join(modes)}")
    if inner != "inductor" and (mode not in (None, "default") or options):
        raise ConfigError(f"mode and options are Inductor's; inner={inner!r} takes neither: drop them, or use Inductor")
    return {**list_mode_options(mode or "default"), **(options or {})}


def lift_linear_epilogues(gm: torch.fx.GraphModule, decide: Callable[[Candidate], tuple[bool, str]] | None = None,
                          ) -> Report:  # fmt: skip
    """Rewrite ``gm`` in place: every liftable linear (or grouped) GEMM node and its elementwise consumers become one
    call of :func:`lifted_gemm` (:func:`lifted_grouped_gemm`) where ``decide`` keeps the candidate (all of them
    without one), every liftable attention one call of :func:`lifted_attention` (where ``decide`` keeps it too).
    Returns what was lifted and what was left, and why."""
    report = Report()
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method") or node.graph is not gm.graph:
            continue
        if node.target is F.scaled_dot_product_attention:
            _lift_attention(gm, node, decide, report)
        elif FLEX_ATTENTION is not None and node.target is FLEX_ATTENTION:
            _lift_flex_attention(gm, node, decide, report)
        elif node.target is torch._grouped_mm:
            why = _why_not_grouped(node)
            offs = _grouped_options(node)["offs"]
            _lift_or_leave(gm, node, why, lifted_grouped_gemm, (*node.args[:2], offs), {}, [], decide, report)
        elif node.target in GEMMS or (node.op == "call_method" and node.target in GEMM_METHODS):
            _lift_gemm(gm, node, decide, report)
    gm.graph.lint()
    gm.recompile()
    return report


def candidates_of(gm: torch.fx.GraphModule) -> list[Candidate]:
    """Every candidate :func:`lift_linear_epilogues` would decide in ``gm``, found by a pass that decides none (the
    graph is left as it was)."""
    found: list[Candidate] = []

    def collect(candidate: Candidate) -> tuple[bool, str]:
        found.append(candidate)
        return False, "collected"

    lift_linear_epilogues(gm, collect)
    return found


def _lift_gemm(gm: torch.fx.GraphModule, node: torch.fx.Node, decide, report: Report) -> None:
    """A linear, matmul, mm, addmm or bmm node: lifted with its chain as :func:`lifted_gemm` (one weight for
    every row of ``x``) or :func:`lifted_bmm` (a weight per batch entry), or left with the reason."""
    target = GEMM_METHODS[node.target] if node.op == "call_method" else node.target
    linear = target is F.linear
    args, bias = list(node.args), None
    if linear:
        args, bias = args[:2], (args[2:] or [node.kwargs.get("bias")])[0]
    elif target is torch.addmm:  # addmm(b, x, w): x @ w, then + b
        bias, args = args[0], args[1:3]
    x, weight = (_value(a) if isinstance(a, torch.fx.Node) else None for a in args[:2])
    batched = isinstance(weight, torch.Tensor) and weight.dim() == 3 and target is not F.linear
    why = _why_not(node, x, weight, linear) if not batched else _why_not_batched(x, weight)
    if why is None and target is torch.addmm and (set(node.kwargs) - {"beta", "alpha"} or any(
            node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha"))):  # fmt: skip
        why = "addmm with beta or alpha other than 1"
    bias_kind = _operand_kind(bias, (*x.shape[:-1], weight.shape[-1] if not linear else weight.shape[0])) if (
        bias is not None and why is None) else None  # fmt: skip
    if bias is not None and why is None and bias_kind is None:
        why = "a bias that is no (out,) vector, (tokens, 1) column or tile of the output's shape, or not a tensor"
    fn, options = (lifted_bmm, {}) if batched else (lifted_gemm, {"linear": linear})
    # What the unlifted candidate calls (its chain adds the bias): addmm is matmul + add.
    unlifted = torch.matmul if target in (torch.addmm, operator.matmul) else target
    _lift_or_leave(gm, node, why, fn, tuple(args[:2]), options, [] if bias is None else [(bias, bias_kind)], decide,
                   report, unlifted)  # fmt: skip


def _operand_kind(arg: Any, out_shape: tuple) -> str | None:
    """An epilogue operand's kind against the output's shape (``tile``, ``row``: ``(out,)``, ``col``: ``(..., 1)``),
    None where it is none of them (or not a tensor of a lifted dtype)."""
    t = _value(arg) if isinstance(arg, torch.fx.Node) else None
    if not isinstance(t, torch.Tensor) or t.dtype not in (*LIFTED_DTYPES, torch.float32):
        return None
    out_shape = tuple(out_shape)
    return ("tile" if tuple(t.shape) == out_shape else "row" if tuple(t.shape) == out_shape[-1:]
            else "col" if tuple(t.shape) == (*out_shape[:-1], 1) else None)  # fmt: skip


def _lift_or_leave(gm, node, why: str | None, fn: Callable, args: tuple, kwargs: dict, bias: list, decide,
                   report: Report, unlifted: Callable | None = None) -> None:  # fmt: skip
    """Replace the GEMM ``node`` and the elementwise chain consuming it (``bias``, ``[(node, kind)]``, added first)
    by one call ``fn(*args, *operands, program=..., **kwargs)``, unless ``why`` says it cannot be or ``decide`` drops
    it. ``unlifted``: the torch call the candidate's unlifted form starts with (default: the node's)."""
    if why:
        report.left.append((node.name, why))
        return
    operands: list = [arg for arg, _ in bias]
    kinds: list[str] = [kind for _, kind in bias]
    steps: list = [("add", (("acc",), ("operand", 0)))] if bias else []
    chain = [node]
    while (step := _next_step(chain[-1], _value(node), operands, kinds)) is not None:
        steps.append(step[0])
        chain.append(step[1])
    program = (tuple(steps), tuple(kinds))
    names = KERNEL_TAGS.get(fn, ()) + tuple(op for op, _ in steps)
    candidate = Candidate(unlifted or node.target, fn, tuple(_value(a) for a in (*args, *operands)), len(args),
                          tuple(sorted({**kwargs, "program": program}.items())))  # fmt: skip
    if decide is not None and not _decided(candidate, node, decide, report):
        return
    with gm.graph.inserting_before(chain[-1]):
        fused = gm.graph.call_function(fn, (*args, *operands), {"program": program, **kwargs})
    fused.meta.update(chain[-1].meta)
    chain[-1].replace_all_uses_with(fused)
    for dead in reversed(chain):
        gm.graph.erase_node(dead)
    report.lifted.append((node.name, names))
    report.calls[node.name] = candidate.on_meta()


def _decided(candidate: Candidate, node: torch.fx.Node, decide, report: Report) -> bool:
    """Whether ``decide`` keeps ``candidate`` (recorded in ``report``; left with the reason where it does not). The
    grad mode is the graph's: the backend runs in the mode the compiled function was called in."""
    lift, because = decide(replace(candidate, grad_enabled=torch.is_grad_enabled()))
    report.measured.append((node.name, because))
    if not lift:
        report.left.append((node.name, because))
    return lift


#: torch._grouped_mm's keyword parameters, with their defaults
GROUPED_PARAMETERS = (("offs", None), ("bias", None), ("out_dtype", None))


def _grouped_options(node: torch.fx.Node) -> dict[str, Any]:
    given = dict(zip((name for name, _ in GROUPED_PARAMETERS), node.args[2:])) | dict(node.kwargs)
    return {name: given.get(name, default) for name, default in GROUPED_PARAMETERS}


def _why_not_grouped(node: torch.fx.Node) -> str | None:
    """Why a ``torch._grouped_mm(x, w, offs=offs)`` node (``F.grouped_mm`` records as it: an MoE layer's experts) is
    left to Inductor (None: it is lifted, with its elementwise consumers, as one :func:`epicute.grouped_gemm`)."""
    a, b = (_value(arg) if isinstance(arg, torch.fx.Node) else None for arg in node.args[:2])
    options = _grouped_options(node)
    why = None
    if (
        not isinstance(a, torch.Tensor)
        or not isinstance(b, torch.Tensor)
        or not isinstance(options["offs"], torch.fx.Node)
    ):
        why = "its inputs or offs are not traced tensors"
    elif a.dim() != 2 or b.dim() != 3:
        why = f"a {a.dim()}-D x {b.dim()}-D grouped_mm: epicute lifts (tokens, K) x (G, K, N) with offs"
    elif a.dtype not in LIFTED_DTYPES or b.dtype != a.dtype:
        why = f"dtypes {a.dtype} x {b.dtype}: epicute lifts bf16 or fp16 grouped GEMMs of one dtype"
    elif options["bias"] is not None or options["out_dtype"] not in (None, a.dtype):
        why = "a bias or another out_dtype"
    elif a.shape[-1] % 8 or b.shape[-1] % 8:  # symbolic sizes: a guard of the compiled graph
        why = f"K={a.shape[-1]}, N={b.shape[-1]}: both must be multiples of 8 (TMA's 16-byte rows)"
    elif a.stride(-1) != 1:
        why = f"x strides {tuple(a.stride())}: epicute's grouped GEMM reads row-major rows"
    return why


def lifted_grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *operands: torch.Tensor,
                        program: tuple):  # fmt: skip
    """``torch._grouped_mm(x, w, offs=offs)`` and the lifted ops as one :func:`epicute.grouped_gemm` (tiles
    ``(tokens, N)``, per-token columns ``(tokens, 1)``)."""
    from epicute.grouped.api import grouped_gemm

    return grouped_gemm(
        x, w, offs, epilogue=lifted_epilogue(program), out_dtype=_output_dtype(program), **_named(operands)
    )


def _named(operands: tuple) -> dict[str, torch.Tensor]:
    """A lifted epilogue's operands by the names its signature gives them (``t0``, ``t1``, ...)."""
    return {f"t{i}": t for i, t in enumerate(operands)}


def _explain_grouped(x, w, offs, *operands, program: tuple, file: TextIO) -> None:
    from epicute.grouped.api import explain_grouped

    explain_grouped(
        x, w, offs, epilogue=lifted_epilogue(program), out_dtype=_output_dtype(program), file=file, **_named(operands)
    )


#: F.scaled_dot_product_attention's parameters after q, k, v, with their defaults
SDPA_PARAMETERS = (("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None),
                   ("enable_gqa", False))  # fmt: skip


def _lift_attention(gm: torch.fx.GraphModule, node: torch.fx.Node, decide, report: Report) -> None:
    """An SDPA node as :func:`lifted_attention`. Two things models do before SDPA are read through: key and value
    heads repeated for GQA (transformers' ``repeat_kv``, ``repeat_interleave``) are taken unrepeated, and a mask the
    graph builds from its sizes alone (transformers' causal mask under torch.compile) is evaluated here and lifted
    as ``causal`` (or dropped) where it equals one (:func:`_constant_mask_kind`)."""
    given = dict(zip((name for name, _ in SDPA_PARAMETERS), node.args[3:])) | dict(node.kwargs)
    options = {name: given.get(name, default) for name, default in SDPA_PARAMETERS}
    q_node, k_node, v_node = node.args[:3]
    notes: list[str] = []
    (k_node, k_repeats), (v_node, v_repeats) = _unrepeated_heads(k_node), _unrepeated_heads(v_node)
    if k_repeats != v_repeats:  # read through both or neither
        k_node, v_node = node.args[1:3]
    elif k_repeats > 1:
        notes.append(f"key/value heads unrepeated ({k_repeats}x)")
    q, k, v = (_value(a) if isinstance(a, torch.fx.Node) else None for a in (q_node, k_node, v_node))
    causal, why = bool(options["is_causal"]), None
    if options["dropout_p"]:
        why = "dropout: epicute's attention has none"
    elif options["attn_mask"] is not None:
        causal, why = _constant_mask_kind(gm, options["attn_mask"], q, k)
        if why is None:
            notes.append("the causal attn_mask as causal" if causal else "an attn_mask masking nothing, dropped")
    why = why or _why_not_attention(q, k, v, causal)
    if why:
        report.left.append((node.name, why))
        return
    lifted_options = {"causal": causal, "scale": options["scale"]}
    torch_options = {"is_causal": causal, "scale": options["scale"], "enable_gqa": q.shape[1] != k.shape[1]}
    candidate = Candidate(F.scaled_dot_product_attention, lifted_attention, (q, k, v), 3,
                          tuple(sorted(lifted_options.items())), tuple(sorted(torch_options.items())))  # fmt: skip
    if decide is not None and not _decided(candidate, node, decide, report):
        return
    with gm.graph.inserting_before(node):
        fused = gm.graph.call_function(lifted_attention, (q_node, k_node, v_node), lifted_options)
    fused.meta.update(node.meta)
    node.replace_all_uses_with(fused)
    gm.graph.erase_node(node)
    report.lifted.append((node.name, ("attention", *notes)))
    report.calls[node.name] = candidate.on_meta()


def _unrepeated_heads(node: Any) -> tuple[Any, int]:
    """``(source, n)`` where ``node`` is ``source`` ``(batch, heads, seqlen, dim)`` with each head repeated ``n``
    times in place, as GQA models widen keys and values for SDPA (a new axis expanded then merged: transformers'
    ``repeat_kv``; or ``repeat_interleave(n, dim=1)``); ``(node, 1)`` otherwise. Shapes are checked, not names."""
    if not isinstance(node, torch.fx.Node) or not isinstance(out := _value(node), torch.Tensor) or out.dim() != 4:
        return node, 1
    name = _name(node)
    if name == "repeat_interleave" and len(node.args) >= 2 and isinstance(node.args[1], int):
        source, repeats = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        src = _value(source) if isinstance(source, torch.fx.Node) else None
        if dim == 1 and isinstance(src, torch.Tensor) and src.dim() == 4 and src.shape[1] * repeats == out.shape[1]:
            return source, repeats
        return node, 1
    if name != "reshape" or not isinstance(expand := node.args[0], torch.fx.Node):
        return node, 1
    if _name(expand) != "expand" or not isinstance(
            new_axis := expand.args[0], torch.fx.Node):  # fmt: skip
        return node, 1
    source = new_axis.args[0] if new_axis.args else None
    src, wide = (_value(source) if isinstance(source, torch.fx.Node) else None), _value(expand)
    if not (isinstance(src, torch.Tensor) and isinstance(wide, torch.Tensor) and src.dim() == 4 and wide.dim() == 5):
        return node, 1
    unsqueezed = (_name(new_axis) == "unsqueeze" and new_axis.args[1:] == (2,)) or (
        new_axis.target is operator.getitem and _inserts_axis_2(new_axis.args[1]))  # fmt: skip
    (b, h, s, d), repeats = src.shape, wide.shape[2]
    if unsqueezed and tuple(wide.shape) == (b, h, repeats, s, d) and tuple(out.shape) == (b, h * repeats, s, d):
        return source, int(repeats)
    return node, 1


def _name(node: torch.fx.Node) -> str:
    """A call node's function or method name, as Dynamo records it (``"reshape"``, ``"getitem"``)."""
    return getattr(node.target, "__name__", str(node.target))


def _inserts_axis_2(index: Any) -> bool:
    """Whether ``t[index]`` of a 4-D ``t`` is ``t[:, :, None]`` (trailing full slices allowed)."""
    full = slice(None, None, None)
    return (isinstance(index, tuple) and len(index) >= 3 and index[:3] == (full, full, None)
            and all(i == full or i is Ellipsis for i in index[3:]))  # fmt: skip


#: ops a mask may be built from to be evaluated while compiling (pure, deterministic; by name, as Dynamo records
#: torch functions, tensor methods or operators)
MASK_OPS = frozenset({
    "arange", "add", "sub", "mul", "le", "lt", "ge", "gt", "eq", "ne", "getitem", "expand", "expand_as", "unsqueeze",
    "view", "reshape", "to", "bool", "float", "logical_and", "logical_or", "logical_not", "and_", "or_", "invert",
    "__and__", "__or__", "__invert__", "where", "full", "ones", "zeros", "tril", "triu", "masked_fill", "transpose",
    "contiguous", "clone", "type_as", "neg",
})  # fmt: skip


def _constant_mask_kind(gm: torch.fx.GraphModule, mask: Any, q: Any, k: Any) -> tuple[bool, str | None]:
    """``(causal, None)`` where ``mask`` (an SDPA ``attn_mask``) is built by the graph from constants and static
    sizes alone and, evaluated, equals the causal mask (``True``) or masks nothing (``False``); ``(False, why)``
    otherwise. Bool masks and additive ones of 0 and -inf (or the dtype's lowest value) are read."""
    if not isinstance(mask, torch.fx.Node):
        return False, "an attn_mask that is not a traced tensor"
    built, stack = {}, [mask]
    while stack:
        node = stack.pop()
        if node in built:
            continue
        built[node] = None
        name = _name(node)
        if node.op == "placeholder" and isinstance(_value(node), (torch.SymInt, int)):
            return False, "an attn_mask built from symbolic sizes: read as causal under static shapes only"
        if node.op == "placeholder":
            return False, "an attn_mask read from the graph's inputs (padding?): epicute's attention takes no mask"
        if node.op != "get_attr" and (node.op not in ("call_function", "call_method") or name not in MASK_OPS):
            return False, f"an attn_mask built with {name}: only masks of sizes alone are read as causal"
        stack.extend(node.all_input_nodes)
    value = _value(mask)
    if not isinstance(value, torch.Tensor) or not all(isinstance(n, int) for n in value.shape) or not isinstance(
            q, torch.Tensor) or not isinstance(k, torch.Tensor):  # fmt: skip
        return False, "an attn_mask of symbolic size: read as causal only under static shapes"
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    known = gm.meta.setdefault("epicute_masks", {})  # one evaluation per mask and shape: every layer shares one
    if (mask, full) not in known:
        known[mask, full] = _evaluated_mask_kind(gm, built, mask, full)
    return known[mask, full]


#: query rows of an evaluated mask compared with the causal pattern at a time (bounds the comparison's memory)
MASK_ROWS = 1024


def _evaluated_mask_kind(gm: torch.fx.GraphModule, built: dict, mask: torch.fx.Node, full: tuple,
                         ) -> tuple[bool, str | None]:  # fmt: skip
    """:func:`_constant_mask_kind`'s verdict on the mask ``built`` computes, evaluated for attention sizes ``full``
    ``(batch, heads, queries, keys)``."""
    graph, env = torch.fx.Graph(), {}
    for node in gm.graph.nodes:  # topological order
        if node in built:
            env[node] = graph.node_copy(node, lambda arg: env[arg])
    graph.output(env[mask])
    with torch.no_grad():
        values = _outside_the_compile(torch.fx.GraphModule(gm, graph))
    if tuple(torch.broadcast_shapes(values.shape, full)) != full:
        return False, f"an attn_mask of shape {tuple(values.shape)} that does not broadcast to {full}"
    if values.dtype == torch.bool:
        allowed = values
    elif values.is_floating_point():
        allowed = values == 0
        if not (allowed | (values <= torch.finfo(values.dtype).min)).all():
            return False, "an additive attn_mask with values besides 0 and -inf (a bias): epicute's attention has none"
    else:
        return False, f"an attn_mask of dtype {values.dtype}"
    if allowed.all():
        return False, None
    other = False, "an attn_mask other than the causal one (padding, a window): epicute's attention takes no mask"
    if full[2] != full[3]:
        return other
    columns = torch.arange(full[3], device=values.device)
    for start in range(0, full[2], MASK_ROWS):
        rows = torch.arange(start, min(start + MASK_ROWS, full[2]), device=values.device)[:, None]
        if not (allowed[..., start : start + MASK_ROWS, :] == (columns <= rows)).all():
            return other
    return True, None


def _why_not_attention(q: Any, k: Any, v: Any, causal: bool) -> str | None:
    """Why an attention over q, k, v ``(batch, heads, seqlen, head_dim)`` (example values) is left to Inductor."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "q, k and v are not 4-D traced tensors"
    if q.dtype not in LIFTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}: epicute's attention takes bf16 or fp16"
    if q.shape[-1] not in (64, 128, 256) or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return f"head_dim {q.shape[-1]}: epicute's attention takes 64, 128 or 256"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads over {k.shape[1]} key/value heads"
    if causal and q.shape[2] != k.shape[2]:
        return "causal with fewer queries than keys: torch aligns the mask top-left, epicute bottom-right"
    return None


#: ``flex_attention``'s higher-order op as Dynamo records it (absent from torch builds without it)
FLEX_ATTENTION = getattr(torch.ops.higher_order, "flex_attention", None)
#: a score_mod's arguments, in flex_attention's order (``score`` the scaled score), then its captured buffers
SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")


def _lift_flex_attention(gm: torch.fx.GraphModule, node: torch.fx.Node, decide, report: Report) -> None:
    """``flex_attention(q, k, v, score_mod=..., block_mask=...)`` as :func:`epicute.attention` with the score_mod read
    from its graph (:func:`_score_program`), where the block mask is none or causal and only O is read."""
    q, k, v = (_value(a) if isinstance(a, torch.fx.Node) else None for a in node.args[:3])
    score_node, block_mask, scale, _, score_buffers, mask_buffers = node.args[3:9]
    causal = _mask_kind(gm, block_mask) if not mask_buffers else None
    why = None
    if causal is None:
        why = "a block mask other than none or causal (q_idx >= kv_idx): epicute's attention has no other"
    elif any(not (user.target is operator.getitem and user.args[1] == 0) for user in node.users):
        why = "its log-sum-exp is read: the lifted call returns O alone"
    else:
        why = _why_not_attention(q, k, v, causal)
    program = None
    if why is None:
        program, why = _score_program(getattr(gm, score_node.target), score_buffers, q.shape[1])
    if why:
        report.left.append((node.name, why))
        return
    options = {"causal": causal, "scale": scale, "score_program": program}
    inputs = (q, k, v, *(_value(b) for b in score_buffers))
    candidate = Candidate(flex_peer, lifted_flex_attention, inputs, len(inputs), tuple(sorted(options.items())),
                          tuple(sorted(options.items())))  # fmt: skip
    if decide is not None and not _decided(candidate, node, decide, report):
        return
    with gm.graph.inserting_before(node):
        fused = gm.graph.call_function(lifted_flex_attention, (*node.args[:3], *score_buffers), options)
    fused.meta.update(node.meta)
    fused.meta["example_value"] = _value(node)[0]
    for user in list(node.users):
        user.replace_all_uses_with(fused)
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    report.lifted.append((node.name, ("flex attention", *(op for op, _ in program[0]))))
    report.calls[node.name] = candidate.on_meta()


def _mask_kind(gm: torch.fx.GraphModule, block_mask: tuple) -> bool | None:
    """A block mask's mask_mod read from its graph: False for none (flex's all-True), True for causal
    (``q_idx >= kv_idx``), None for any other."""
    mask_node = block_mask[-1] if isinstance(block_mask, tuple) and block_mask else None
    graph = getattr(gm, mask_node.target, None) if isinstance(mask_node, torch.fx.Node) else None
    if not isinstance(graph, torch.fx.GraphModule):
        return None
    args = [n for n in graph.graph.nodes if n.op == "placeholder"]
    (result,) = next(n for n in graph.graph.nodes if n.op == "output").args
    result = result[0] if isinstance(result, (tuple, list)) else result
    if result.op == "call_method" and result.target == "new_ones":
        return False
    if len(args) == 4 and result.op == "call_function":
        if result.target is operator.ge and result.args == (args[2], args[3]):
            return True
        if result.target is operator.le and result.args == (args[3], args[2]):
            return True
    return None


def _score_program(graph: torch.fx.GraphModule, buffers: tuple, heads: int) -> tuple[tuple | None, str | None]:
    """A score_mod's graph as a program of epicute ops: ``(steps, output)``, each step ``(op, refs)``, a ref
    ``("arg", i)`` (score, b, h, q_idx, kv_idx), ``("step", j)``, ``("operand", k)`` (captured buffer ``k`` read at
    the query head: ``buffer[h]`` of a ``(heads,)`` vector) or ``("const", value)``; or the reason it is none."""
    env: dict[torch.fx.Node, tuple] = {}
    steps: list = []
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    for i, arg in enumerate(placeholders):
        env[arg] = ("arg", i) if i < len(SCORE_ARGS) else ("buffer", i - len(SCORE_ARGS))
    for n in graph.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "call_function" and n.target is operator.getitem and env.get(n.args[0], ("",))[0] == "buffer":
            k = env[n.args[0]][1]
            t = _value(buffers[k]) if k < len(buffers) and isinstance(buffers[k], torch.fx.Node) else None
            if n.args[1] is not placeholders[2] or not isinstance(t, torch.Tensor) or tuple(t.shape) != (heads,):
                return None, "a captured tensor read other than per query head (buffer[h] of a (heads,) vector)"
            env[n] = ("operand", k)
            continue
        op = _op_of(n)
        if op is None or n.kwargs:
            return None, f"a score_mod op epicute lacks ({n.target})"
        refs = []
        for a in n.args:
            if isinstance(a, torch.fx.Node) and a in env and env[a][0] != "buffer":
                refs.append(env[a])
            elif isinstance(a, (int, float)) and not isinstance(a, bool):
                refs.append(("const", float(a)))
            else:
                return None, f"a score_mod argument epicute cannot read ({a})"
        env[n] = ("step", len(steps))
        steps.append((op, tuple(refs)))
    (result,) = next(n for n in graph.graph.nodes if n.op == "output").args
    result = result[0] if isinstance(result, (tuple, list)) else result
    if result not in env or env[result][0] not in ("arg", "step"):
        return None, "a score_mod whose result epicute cannot read"
    return (tuple(steps), env[result]), None


def _program_values(program: tuple, args: tuple, operands: tuple, apply: dict) -> Any:
    """A score program's result from its arguments (score, b, h, q_idx, kv_idx) and operands, ``apply`` giving each
    op (epicute's traced ops, or torch's)."""
    steps, output = program
    values: list = []

    def read(ref):
        kind, at = ref
        return {"arg": args, "step": values, "operand": operands}[kind][at] if kind != "const" else at

    for op, refs in steps:
        values.append(apply[op](*(read(r) for r in refs)))
    return read(output)


@functools.cache
def lifted_score_mod(program: tuple) -> Callable | None:
    """The epicute score_mod of a program (None for the identity): ``f(score, b, h, q_idx, kv_idx, t0, ...)``."""
    steps, output = program
    if output == ("arg", 0):
        return None
    count = len({r[1] for _, refs in steps for r in refs if r[0] == "operand"})

    def score_mod(*args):
        return _program_values(program, args[: len(SCORE_ARGS)], args[len(SCORE_ARGS) :], APPLY)

    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in SCORE_ARGS]
    params += [inspect.Parameter(f"t{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD) for i in range(count)]
    score_mod.__signature__ = inspect.Signature(params)
    score_mod.__name__ = "lifted_" + "_".join(op for op, _ in steps)
    return score_mod


def lifted_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *buffers: torch.Tensor, causal: bool,
                          scale: float | None, score_program: tuple) -> torch.Tensor:  # fmt: skip
    """``flex_attention(q, k, v, score_mod=..., block_mask=None or causal)`` (``(batch, heads, seqlen, dim)``) as
    :func:`epicute.attention` with the lifted score_mod (per-head buffers as its operands ``t0``, ``t1``...)."""
    from epicute.attention.api import attention

    out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, softmax_scale=scale,
                    score_mod=lifted_score_mod(score_program), **_named(buffers))  # fmt: skip
    return out.transpose(1, 2)


def flex_peer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *buffers: torch.Tensor, causal: bool,
              scale: float | None, score_program: tuple) -> torch.Tensor:  # fmt: skip
    """The unlifted call a GPU measures the lift against: torch's ``flex_attention`` with the same score_mod (the
    program in torch's ops, each buffer read at the query head) and mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def score_mod(score, b, h, q_idx, kv_idx):
        return _program_values(score_program, (score, b, h, q_idx, kv_idx), tuple(t[h] for t in buffers),
                               TORCH_STEPS)  # fmt: skip

    mask = None
    if causal:
        mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, q.shape[2], k.shape[2],
                                 device=q.device)  # fmt: skip
    gqa = q.shape[1] != k.shape[1]
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=gqa)


def _explain_flex(q, k, v, *buffers, causal: bool, scale: float | None, score_program: tuple, file: TextIO) -> None:
    from epicute.attention.api import explain_attention

    explain_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, file=file,
                      score_mod=lifted_score_mod(score_program), **_named(buffers))  # fmt: skip


def lifted_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None):
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)`` (``(batch, heads, seqlen, dim)``)
    as :func:`epicute.attention` (``(batch, seqlen, heads, dim)``: transposed views both ways, no copies)."""
    from epicute.attention.api import attention

    out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, softmax_scale=scale)
    return out.transpose(1, 2)


def _explain_attention(q, k, v, *, causal: bool, scale: float | None, file: TextIO) -> None:
    from epicute.attention.api import explain_attention

    explain_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, file=file)


def _value(node: torch.fx.Node) -> Any:
    return node.meta.get("example_value")


def _why_not(node: torch.fx.Node, x: Any, weight: Any, linear: bool) -> str | None:
    """Why this linear (or ``x @ w``) node, of input ``x`` and ``weight`` (example values), is left to Inductor
    (None: it is lifted)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "its input or weight is not a traced tensor"
    if x.dtype not in LIFTED_DTYPES or weight.dtype != x.dtype:
        return f"dtypes {x.dtype} x {weight.dtype}: epicute lifts bf16 or fp16 GEMMs of one dtype"
    if weight.dim() != 2 or x.dim() < 2:
        return "a weight that is not 2-D, or a 1-D input"
    if weight.stride(-1) != 1 and weight.stride(-2) != 1:
        return f"weight strides {tuple(weight.stride())}: neither dimension is contiguous (TMA reads rows)"
    n, k = weight.shape if linear else reversed(weight.shape)
    if n % 8 or k % 8:  # symbolic sizes: a guard of the compiled graph (it recompiles where it fails)
        return f"weight {tuple(weight.shape)}: in and out must be multiples of 8 (TMA's 16-byte rows)"
    return None


def _why_not_batched(a: Any, b: Any) -> str | None:
    """Why a batched ``bmm(a, b)`` (``a @ b`` of two 3-D tensors) is left to Inductor (None: it is lifted)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return "its inputs are not traced tensors"
    if a.dtype not in LIFTED_DTYPES or b.dtype != a.dtype:
        return f"dtypes {a.dtype} x {b.dtype}: epicute lifts bf16 or fp16 GEMMs of one dtype"
    if a.dim() != 3 or a.shape[0] != b.shape[0]:
        return f"a {a.dim()}-D x 3-D matmul: epicute lifts (L, M, K) x (L, K, N) batches"
    for name, t in (("a", a), ("b", b)):
        if t.stride(-1) != 1 and t.stride(-2) != 1:
            return f"{name} strides {tuple(t.stride())}: neither of its last two dimensions is contiguous"
    if a.shape[-1] % 8 or b.shape[-1] % 8:  # symbolic sizes: a guard of the compiled graph
        return f"K={a.shape[-1]}, N={b.shape[-1]}: both must be multiples of 8 (TMA's 16-byte rows)"
    return None


def _next_step(last: torch.fx.Node, out: torch.Tensor, operands: list, kinds: list) -> tuple | None:
    """The chain's next elementwise op after ``last``, as ``((op, argument refs), node)``, registering its tensor
    operand; None where the chain ends (several users, an op epicute lacks, a dtype or shape change)."""
    users = list(last.users)
    if len(users) != 1:
        return None
    user = users[0]
    value = _value(user)
    if not isinstance(value, torch.Tensor) or value.shape != out.shape:
        return None
    cast = _cast_dtype(user)
    if cast is not None:
        return ((CASTS[cast], (("acc",),)), user) if value.dtype == cast and user.args[0] is last else None
    op = _op_of(user)
    if op is None or value.dtype != _value(last).dtype:
        return None
    if op == "gelu":
        approximate = user.kwargs.get("approximate", "none")
        if approximate not in ("none", "tanh"):
            return None
        op = "gelu" if approximate == "none" else "gelu_tanh"
    if set(user.kwargs) - {"approximate"}:
        return None
    refs, added = [], []
    for arg in user.args:
        if arg is last:
            refs.append(("acc",))
        elif isinstance(arg, (int, float)) and not isinstance(arg, bool):
            refs.append(("const", float(arg)))
        elif isinstance(arg, torch.fx.Node) and isinstance(_value(arg), torch.Tensor):
            t = _value(arg)
            kind = ("tile" if t.shape == out.shape else "row" if tuple(t.shape) == (out.shape[-1],)
                    else "col" if tuple(t.shape) == (*out.shape[:-1], 1) else None)  # fmt: skip
            if kind is None or t.dtype not in (*LIFTED_DTYPES, torch.float32):
                return None
            refs.append(("operand", len(operands) + len(added)))
            added.append((arg, kind))
        else:
            return None
    if sum(ref == ("acc",) for ref in refs) != 1:
        return None
    for arg, kind in added:
        operands.append(arg)
        kinds.append(kind)
    return (op, tuple(refs)), user


def _cast_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The float dtype ``node`` casts its tensor to (``.float()``, ``.to(torch.bfloat16)``, ``.type(dtype)``...),
    None where it is no such cast (another method, a device move, ``copy``/``non_blocking``/``memory_format``)."""
    if node.op != "call_method" or not node.args:
        return None
    if node.target in CAST_METHODS and len(node.args) == 1 and not node.kwargs:
        return CAST_METHODS[node.target]
    if node.target not in ("to", "type") or set(node.kwargs) - {"dtype"}:
        return None
    given = [*node.args[1:], *node.kwargs.values()]
    return given[0] if len(given) == 1 and given[0] in CASTS else None


def _output_dtype(program: tuple) -> torch.dtype | None:
    """The dtype a lifted chain's last cast sets (None: the GEMM's own)."""
    cast_to = {op: dtype for dtype, op in CASTS.items()}
    return next((cast_to[op] for op, _ in reversed(program[0]) if op in cast_to), None)


def _op_of(node: torch.fx.Node) -> str | None:
    if node.op == "call_function":
        return FUNCTIONS.get(node.target)
    if node.op == "call_method":
        return METHODS.get(node.target)
    return None


@functools.cache
def lifted_epilogue(program: tuple) -> Callable:
    """The epilogue of a lifted chain: ``f(acc, t0, t1, ...)`` applying its steps to the accumulator (one function
    per program, so its trace is remembered)."""
    steps, kinds = program

    def epilogue(acc, *operands):
        value = acc
        for op, refs in steps:
            args = [value if ref[0] == "acc" else operands[ref[1]] if ref[0] == "operand" else ref[1] for ref in refs]
            value = APPLY[op](*args)
        return value

    params = [inspect.Parameter("acc", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(f"t{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD) for i in range(len(kinds))]
    epilogue.__signature__ = inspect.Signature(params)
    epilogue.__name__ = "lifted_" + "_".join(op for op, _ in steps) if steps else "lifted"
    return epilogue


def lifted_gemm(x: torch.Tensor, weight: torch.Tensor, *operands: torch.Tensor, program: tuple, linear: bool):
    """``F.linear(x, weight)`` (``linear``) or ``x @ weight`` and the lifted ops as one :func:`epicute.gemm` (what a
    rewritten graph calls), through :func:`epicute.nn.functional.linear`: row operands as ``RowVector``, tiles as
    ``(tokens, out)``."""
    weight, values = _linear_operands(weight, operands, program, linear)
    return EF.linear(x, weight, epilogue=lifted_epilogue(program), out_dtype=_output_dtype(program), **values)


def _linear_operands(weight: torch.Tensor, operands: tuple, program: tuple, linear: bool) -> tuple:
    """F.linear's ``(out, in)`` weight and the epilogue's operands against the ``(tokens, out)`` problem: row
    operands as ``RowVector``, columns ``(tokens, 1)``, tiles ``(tokens, out)``."""
    _, kinds = program
    weight = weight if linear else weight.t()
    out = weight.shape[0]
    values = {f"t{i}": RowVector(t) if kind == "row" else t.reshape(-1, 1 if kind == "col" else out)
              for i, (t, kind) in enumerate(zip(operands, kinds))}  # fmt: skip
    return weight, values


def lifted_bmm(a: torch.Tensor, b: torch.Tensor, *operands: torch.Tensor, program: tuple):
    """``torch.bmm(a, b)`` and the lifted ops as one batched :func:`epicute.gemm` (operands pinned to the kinds the
    chain gave them: tiles ``(L, M, N)``, rows ``(N,)``, columns ``(L, M, 1)``)."""
    from epicute.gemm.api import gemm

    return gemm(a, b, epilogue=lifted_epilogue(program), out_dtype=_output_dtype(program), **_pinned(operands, program))


def _pinned(operands: tuple, program: tuple) -> dict[str, Any]:
    from epicute.epilogue.operands import ColVector, Tile

    pins = {"row": RowVector, "col": ColVector, "tile": Tile}
    return {f"t{i}": pins[kind](t) for i, (t, kind) in enumerate(zip(operands, program[1]))}


def _explain_bmm(a, b, *operands, program: tuple, file: TextIO) -> None:
    from epicute.gemm.api import explain

    explain(
        a,
        b,
        epilogue=lifted_epilogue(program),
        out_dtype=_output_dtype(program),
        file=file,
        **_pinned(operands, program),
    )


def _explain_gemm(x, weight, *operands, program: tuple, linear: bool, file: TextIO) -> None:
    from epicute.gemm.api import explain

    weight, values = _linear_operands(weight, operands, program, linear)
    explain(
        x.reshape(-1, x.shape[-1]),
        weight.t(),
        epilogue=lifted_epilogue(program),
        out_dtype=_output_dtype(program),
        file=file,
        **values,
    )


#: the report's first step of a lifted call that is no linear GEMM
KERNEL_TAGS: dict[Callable, tuple[str, ...]] = {lifted_grouped_gemm: ("grouped",), lifted_bmm: ("batched",)}
#: each lifted call -> what prints its kernel's plan (the same arguments, and ``file``)
EXPLAINERS: dict[Callable, Callable] = {
    lifted_gemm: _explain_gemm, lifted_bmm: _explain_bmm, lifted_grouped_gemm: _explain_grouped,
    lifted_attention: _explain_attention, lifted_flex_attention: _explain_flex,
}  # fmt: skip


__all__ = ["Candidate", "Cost", "Measured", "Report", "always", "backend", "candidates_of", "flex_peer", "last_report",
           "lift_linear_epilogues",
           "lifted_attention", "lifted_bmm", "lifted_flex_attention", "lifted_gemm", "lifted_grouped_gemm",
           "lifted_score_mod"]  # fmt: skip
