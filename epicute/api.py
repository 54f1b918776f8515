"""epicute's public functions: :func:`gemm`, :func:`explain` and :func:`tune`."""

from __future__ import annotations

import functools
import sys
from dataclasses import replace
from typing import Any, Callable, TextIO

import torch
from rich.progress import Progress

from epicute.epilogue.reference import reference_gemm
from epicute.epilogue.dtypes import IR_TO_TORCH
from epicute.epilogue.graph import REDUCTIONS
from epicute.epilogue.tracer import as_epilogue, trace_for_gemm
from epicute.epilogue.hashing import semantic_hash
from epicute.errors import ConfigError, DeviceError, EpilogueError
from epicute.epilogue.schedule import schedule
from epicute.plan import GemmPlan, GemmProblem, current_hardware, render_plan
from epicute.plan.smem import NO_EPILOGUE, EpilogueBuffers
from epicute.runtime.epilogue_args import aux_outputs, check_outs_names, kernel_inputs
from epicute.runtime.launch import cached_plan, launch_gemm
from epicute.runtime.torch_ops import gemm_op_call
from epicute.runtime.tune import TuneResult, candidates, label, pick_fastest, store_winner, stored_entry, tune_key
from epicute.runtime.validate import TORCH_TO_NAME, check_gemm_args


def _overrides(config: dict | None) -> tuple:
    return tuple(sorted((config or {}).items()))


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    epilogue: Callable | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out_dtypes: dict[str, torch.dtype] | None = None,
    outs: dict[str, torch.Tensor] | None = None,
    backend: str = "kernel",
    config: dict | None = None,
    tune: bool = False,
    **operands: Any,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """``a @ b`` on a Hopper GPU, optionally with a fused epilogue.

    Args:
        a: ``(M, K)`` or batched ``(L, M, K)``, bf16 or fp16, row- or column-major.
        b: ``(K, N)`` or ``(L, K, N)``, same dtype as ``a``, row- or column-major
            (``w.t()`` of a row-major ``(N, K)`` weight works without a copy).
        epilogue: a function ``f(acc, *operands) -> {"D": ...}`` (see
            :func:`epicute.epilogue`); its operands are passed by name as keyword
            arguments (scalars, row/column vectors or full tiles).
        out: optional preallocated row-major output ``(M, N)`` / ``(L, M, N)``.
        out_dtype: bf16, fp16 or fp32; defaults to ``out.dtype`` or ``a.dtype``.
        out_dtypes: dtypes of the epilogue's outputs by name (``"D"`` included);
            fp8 outputs saturate at the format's largest finite value.
        outs: preallocated aux tile outputs by name (D goes in ``out``).
        backend: ``"kernel"`` (the GPU) or ``"reference"`` (float32 on the CPU,
            any device: the oracle every GPU test compares against).
        config: optional :class:`epicute.plan.GemmConfig` fields to pin
            (e.g. ``{"tile_n": 128}``); the planner chooses the rest.
        tune: use the fastest config measured for this problem by :func:`tune`
            (stored on disk); the first call for a new problem runs the tuning.

    Returns:
        D, accumulated in fp32 and rounded once to its dtype; a dict of all
        outputs when the epilogue returns more than ``"D"``: aux tiles like D,
        ``row_*`` reductions ``(M,)``/``(L, M)``, ``col_*`` ``(N,)``/``(L, N)``
        and ``amax`` a 0-d tensor, all fp32, bitwise reproducible run to run.

    Example:
        >>> import torch, epicute                                  # doctest: +SKIP
        >>> a = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
        >>> w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
        >>> y = epicute.gemm(a, w.t())                              # (1000, 14336)
        >>> z = epicute.gemm(a, w.t(), epilogue=lambda acc, bias: epicute.ops.relu(acc + bias),
        ...                  bias=torch.randn(14336, device="cuda", dtype=torch.bfloat16))
    """
    if torch.compiler.is_compiling():
        # torch.compile sees one custom op (epicute::gemm), never this Python code.
        return gemm_op_call(
            a, b, epilogue=epilogue, out=out, out_dtype=out_dtype, out_dtypes=out_dtypes, outs=outs,
            backend=backend, config=config, operands=operands,
        )  # fmt: skip
    if backend not in ("kernel", "reference"):
        raise ConfigError(f"backend={backend!r}: use 'kernel' or 'reference'")
    if tune and backend == "kernel":
        tuned = _tuned_overrides(a, b, epilogue, out_dtype, out_dtypes, operands)
        config = {**tuned, **(config or {})}  # the caller's pins win
    if epilogue is None and (operands or out_dtypes or outs):
        given = sorted(operands) or list(out_dtypes or outs)
        raise EpilogueError(f"operands/outputs {given} were given without an epilogue")
    if out_dtypes and "D" in out_dtypes:
        out_dtype = out_dtype or out_dtypes["D"]
    call = check_gemm_args(a, b, out, out_dtype, require_cuda=backend == "kernel")
    if epilogue is None:
        if backend == "reference":
            return _deliver(call, {"D": _reference_matmul(call)})
        return launch_gemm(call, cached_plan(call.problem, _overrides(config)))

    p = call.problem
    epi = as_epilogue(epilogue)
    specs = epi.operands(operands, p.m, p.n, p.l)
    outs = dict(outs or {})
    d_explicit = out is not None or out_dtype is not None
    outs_dtypes = {k: v.dtype for k, v in outs.items()}
    if backend == "reference":
        graph = trace_for_gemm(epi, specs, call.out_dtype, d_explicit, out_dtypes, outs_dtypes)
        stored = {name: IR_TO_TORCH[dtype] for name, dtype in graph.output_dtypes}
        call = _with_d_dtype(call, stored["D"], a, b, out, require_cuda=False)
        check_outs_names(outs, tuple(n for n, i in graph.outputs if n != "D" and graph.node(i).op not in REDUCTIONS))
        return _deliver(call, reference_gemm(call.a, call.b, epi, operands, stored), outs)
    memo = _capture_key(epilogue)
    if memo is not None:
        memo = (memo, tuple((s.name, s.kind, s.dtype) for s in specs.values()), p, call.out_dtype, d_explicit,
                tuple(sorted((out_dtypes or {}).items())), tuple(sorted(outs_dtypes.items())), _overrides(config))  # fmt: skip
    prepared = _PREPARED.get(memo) if memo is not None else None
    if prepared is None:
        prepared = _prepare_fusion(epi, specs, call, d_explicit, out_dtypes, outs_dtypes, config)
        if memo is not None:
            if len(_PREPARED) >= 1024:
                _PREPARED.clear()
            _PREPARED[memo] = prepared
    fusion, d_dtype, plan = prepared
    call = _with_d_dtype(call, d_dtype, a, b, out, require_cuda=True)
    device = call.a.device
    tensors, scalars = kernel_inputs(fusion, specs, device)
    aux = aux_outputs(fusion, outs, (p.l, p.m, p.n), call.batched, device)
    return launch_gemm(call, plan, fusion, tensors, scalars, aux)


#: Traced, fused and planned epilogue calls, by what they depend on (see _capture_key).
_PREPARED: dict[tuple, tuple] = {}


def _capture_key(fn: Callable) -> tuple | None:
    """What tracing ``fn`` can depend on besides its code: the function object, its
    closure values, defaults and the module globals it names. A later call with an
    equal key reuses the trace; ``None`` (something unhashable) means always trace."""
    fn = getattr(fn, "fn", fn)  # an Epilogue's function
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells = tuple(cell.cell_contents for cell in fn.__closure__ or ())
    names = tuple((name, fn.__globals__[name]) for name in code.co_names if name in fn.__globals__)
    key = (fn, cells, fn.__defaults__, tuple(sorted((fn.__kwdefaults__ or {}).items())), names)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _prepare_fusion(epi, specs, call, d_explicit, out_dtypes, outs_dtypes, config) -> tuple:
    """Trace, lower and plan one epilogue call: (fusion, D's dtype, plan)."""
    from epicute.kernels.epilogue_emit import EpilogueFusion  # imports the CuTe DSL: only when launching

    graph = trace_for_gemm(epi, specs, call.out_dtype, d_explicit, out_dtypes, outs_dtypes)
    d_dtype = IR_TO_TORCH[dict(graph.output_dtypes)["D"]]
    fusion = EpilogueFusion(graph, tuple((s.name, s.kind, s.dtype) for s in specs.values()))
    problem = replace(call.problem, d_dtype=TORCH_TO_NAME[d_dtype])
    return fusion, d_dtype, cached_plan(problem, _overrides(config), fusion.buffers())


def _with_d_dtype(call, d_dtype, a, b, out, *, require_cuda: bool):
    """``call`` again with D stored in ``d_dtype`` (an epilogue's own cast/quantize may choose it)."""
    return call if d_dtype == call.out_dtype else check_gemm_args(a, b, out, d_dtype, require_cuda=require_cuda)


def tune(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    epilogue: Callable | None = None,
    out_dtype: torch.dtype | None = None,
    out_dtypes: dict[str, torch.dtype] | None = None,
    iters: int = 20,
    warmup: int = 5,
    progress: bool = True,
    **operands: Any,
) -> TuneResult:
    """Time every config the planner accepts for ``a @ b`` (with ``epilogue``) on the GPU; store the fastest.

    Later ``gemm(..., tune=True)`` calls for the same problem (and epilogue, GPU
    and epicute version), in any process, use the stored winner.

    Example:
        >>> result = epicute.tune(x, w.t(), iters=10)                 # doctest: +SKIP
        >>> result.best, result.speedup_over_planner                  # doctest: +SKIP
        ({'cluster_m': 2, 'cluster_n': 1, 'persistent': True, 'tile_n': 256}, 1.0)
    """
    from epicute.benchmark import time_cuda

    if not torch.cuda.is_available():
        raise DeviceError("tune() times candidate kernels on a CUDA GPU; none is visible")
    key, problem, buffers = _tune_identity(a, b, epilogue, out_dtype, out_dtypes, operands)
    options = candidates(problem, current_hardware(), buffers)

    def measure(overrides: dict) -> float:
        run = functools.partial(gemm, a, b, epilogue=epilogue, out_dtype=out_dtype, out_dtypes=out_dtypes,
                                config=overrides, **operands)  # fmt: skip
        return time_cuda(run, warmup=warmup, iters=iters)

    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("tuning", total=len(options))

        def advance(name: str) -> None:
            bar.update(task, advance=1, description=f"tuning {name}")

        result = pick_fastest(options, measure, advance)
    store_winner(key, result)
    _TUNED[key] = result.best
    return result


#: Stored winners already read in this process, by tune key.
_TUNED: dict[str, dict] = {}


def _tune_identity(a, b, epilogue, out_dtype, out_dtypes, operands) -> tuple[str, GemmProblem, EpilogueBuffers]:
    """The tune key, the problem (D's dtype settled) and the epilogue's buffers of one call."""
    call = check_gemm_args(a, b, None, out_dtype or (out_dtypes or {}).get("D"), require_cuda=False)
    problem, epi_hash, buffers = call.problem, None, NO_EPILOGUE
    if epilogue is not None:
        p = call.problem
        epi = as_epilogue(epilogue)
        specs = epi.operands(operands, p.m, p.n, p.l)
        explicit = out_dtype is not None or "D" in (out_dtypes or {})
        graph = trace_for_gemm(epi, specs, call.out_dtype, explicit, out_dtypes, {})
        problem = replace(p, d_dtype=dict(graph.output_dtypes)["D"])
        epi_hash, buffers = semantic_hash(graph), schedule(graph).buffers()
    return tune_key(problem, epi_hash, current_hardware().name), problem, buffers


def _tuned_overrides(a, b, epilogue, out_dtype, out_dtypes, operands) -> dict:
    key, _, _ = _tune_identity(a, b, epilogue, out_dtype, out_dtypes, operands)
    if key not in _TUNED:
        stored = stored_entry(key)
        _TUNED[key] = stored["best"] if stored is not None else tune(
            a, b, epilogue=epilogue, out_dtype=out_dtype, out_dtypes=out_dtypes, **operands
        ).best
    return _TUNED[key]


def _reference_matmul(call) -> torch.Tensor:
    return torch.matmul(call.a.cpu().float(), call.b.cpu().float()).to(call.out_dtype)


def _deliver(call, results: dict[str, torch.Tensor], outs: dict | None = None):
    """Reference results in the caller's rank, copied into ``out``/``outs`` when given."""
    if not call.batched:
        results = {k: v[0] if v.dim() else v for k, v in results.items()}
    targets = dict(outs or {})
    if call.out is not None:
        targets["D"] = call.out if call.batched else call.out[0]
    for name, target in targets.items():
        target.copy_(results[name].reshape(target.shape))
        results[name] = target
    return results["D"] if set(results) == {"D"} else results


def explain(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    epilogue: Callable | None = None,
    out_dtype: torch.dtype | None = None,
    out_dtypes: dict[str, torch.dtype] | None = None,
    config: dict | None = None,
    file: TextIO | None | str = "stdout",
    **operands: Any,
) -> GemmPlan:
    """Print (to ``file``, default stdout; ``None`` to stay quiet) and return the plan for ``a @ b``.

    With ``epilogue`` (and its operands, as for :func:`gemm`) the plan budgets
    the epilogue's shared memory and the text ends with its stage chain.
    Works without a GPU: tensors may live on any device, ``"meta"`` included,
    and the plan then targets an H100.

    Example:
        >>> import torch, epicute
        >>> a = torch.empty(8192, 8192, dtype=torch.bfloat16, device="meta")
        >>> plan = epicute.explain(a, a, file=None)
        >>> plan.config.tile_m, plan.config.tile_n
        (128, 256)
        >>> bias = torch.empty(8192, dtype=torch.bfloat16, device="meta")
        >>> plan = epicute.explain(a, a, epilogue=lambda acc, bias, residual: epicute.ops.gelu(acc + bias) + residual,
        ...                        bias=epicute.RowVector(bias), residual=a, file=None)
        >>> [item.name for item in plan.smem][-2:]
        ['operand tile 0', 'row vector 0']
    """
    if out_dtypes and "D" in out_dtypes:
        out_dtype = out_dtype or out_dtypes["D"]
    call = check_gemm_args(a, b, None, out_dtype, require_cuda=False)
    buffers = NO_EPILOGUE
    if epilogue is not None:
        p = call.problem
        epi = as_epilogue(epilogue)
        specs = epi.operands(operands, p.m, p.n, p.l)
        graph = epi.trace(
            {k: s.kind for k, s in specs.items()}, {k: s.dtype for k, s in specs.items()},
            {"D": call.out_dtype, **(out_dtypes or {})}, d_dtype=call.out_dtype,
        )  # fmt: skip
        buffers = schedule(graph).buffers()
    elif operands or out_dtypes:
        raise EpilogueError(f"operands/outputs {sorted(operands) or list(out_dtypes)} were given without an epilogue")
    plan = cached_plan(call.problem, _overrides(config), buffers)
    if file is not None:
        text = render_plan(plan)
        tuned = stored_entry(_tune_identity(a, b, epilogue, out_dtype, out_dtypes, operands)[0])
        if tuned is not None:
            times = tuned["times_ms"]
            text += (
                f"\n\ntuned (epicute.tune, stored): {label(tuned['best'])} at {times[label(tuned['best'])]:.3f} ms vs the "
                f"planner's {label(tuned['planner'])} at {times[label(tuned['planner'])]:.3f} ms; "
                "gemm(..., tune=True) uses it"
            )
        # Resolved per call so redirect_stdout, capsys and notebooks see the text.
        print(text, file=sys.stdout if file == "stdout" else file)
    return plan
