"""The ``epicute`` command line: ``demo``, ``explain``, ``bench``, ``compile``, ``cache``, ``doctor``.

Thin on purpose: each command parses arguments and calls the library, importing
what it needs when it runs (``epicute --help`` loads neither dynamo nor the CuTe
DSL). Errors epicute raises on purpose are printed in one line and exit with
status 2, and so are the command line's own (a bad value, an unknown option:
``_Group``). Text from users and libraries is never read as rich markup: ``[plot]``
or ``[[gemm]]`` in a message is printed as it is.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape

try:  # recent typer parses with its own copy of click (typer._click), whose exceptions these are
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer parses with click itself
    from click import exceptions as click_exceptions
from typer.core import TyperGroup

from epicute.runtime.precompile import DEFAULT_MAX_WORKERS  # stdlib and the cache: no dynamo, no DSL

if TYPE_CHECKING:
    from rich.table import Table


def _usage_error_line(exc: Exception) -> str:
    """A click error (a bad value, an unknown option or command, a missing option) as one line: the option,
    what is wrong with it, and where the options are listed; typer would draw a multi-line panel."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    param = getattr(exc, "param", None)
    if isinstance(exc, click_exceptions.BadParameter) and not isinstance(exc, click_exceptions.MissingParameter):
        hint = exc.param_hint
        if hint is not None and not isinstance(hint, str):
            hint = "/".join(hint)
        if hint is None and param is not None:
            hint = "/".join(getattr(param, "opts", ())) or param.human_readable_name
        if hint:
            message = " ".join(exc.message.split()).rstrip(".")
            # recent typer validates values with pydantic, whose message leaves out the value given
            errors = getattr(exc.__cause__, "errors", None)
            given = (errors() or [{}])[0].get("input") if callable(errors) else None
            if isinstance(given, str):
                hint, message = f"{hint} {given!r}", message[:1].lower() + message[1:]
            message = f"{hint}: {message}"
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click_exceptions.UsageError) and ctx is not None:
        message += f" (see '{ctx.command_path} --help')"
    return message


class _Group(TyperGroup):
    """The root command: click's errors exit with their status (2 for usage) in one line, as :func:`_fail`
    prints epicute's, in place of typer's panel."""

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click_exceptions.ClickException as exc:
            raise _one_line(exc) from exc

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click_exceptions.ClickException as exc:
            raise _one_line(exc) from exc


def _one_line(exc: click_exceptions.ClickException) -> Exception:
    if type(exc).__name__ == "NoArgsIsHelpError":  # typer printed the help; click exits 2 after it
        return typer.Exit(exc.exit_code)
    Console(stderr=True, highlight=False, soft_wrap=True, markup=False).print(
        f"[red]error:[/red] {escape(_usage_error_line(exc))}", markup=True
    )
    return typer.Exit(exc.exit_code)


app = typer.Typer(
    cls=_Group, add_completion=False, no_args_is_help=True, help="epicute: fused Hopper kernels from Python."
)
explain_app = typer.Typer(no_args_is_help=True, help="Print the plan epicute would run, with or without a GPU.")
app.add_typer(explain_app, name="explain")
cache_app = typer.Typer(no_args_is_help=True, help="The compiled-kernel cache on disk: list, describe, clear.")
app.add_typer(cache_app, name="cache")
# soft_wrap: plans are tables; never re-wrap them to the terminal width. markup=False: see
# the module docstring; the few styled strings pass markup=True and escape what they embed.
console = Console(highlight=False, soft_wrap=True, markup=False)

# Spelled out here, not imported: the library modules that define them import torch, and
# `epicute --help` should not wait for it. tests/test_cli.py checks that they agree.
#: The dtype names of A/B and of D (epicute.gemm.config.AB_DTYPES, D_DTYPES).
AB_DTYPES = ("bf16", "fp16", "fp8e4m3", "fp8e5m2")
#: q, k and v's dtypes (epicute.attention.validate.ATTN_DTYPES).
ATTENTION_DTYPES = ("bf16", "fp16", "fp8e4m3")
D_DTYPES = ("bf16", "fp16", "fp32", "fp8e4m3", "fp8e5m2")
#: epicute.epilogue.library.__all__
READY_EPILOGUES = "row_col_quant, tensor_quant, plain"
#: epicute.runtime.target.TARGETS
TARGET_NAMES = ("h100-sxm", "h100-pcie", "h200", "h20")
TARGET_HELP = f"the GPU to plan for: {', '.join(TARGET_NAMES)} (default: the visible GPU, else h100-sxm)"


def _fail(exc: Exception) -> typer.Exit:
    console.print(f"[red]error:[/red] {escape(str(exc))}", markup=True)
    return typer.Exit(2)


def _print_table(table: Table) -> None:
    """A table at its natural width when piped: a pipe's default 80 columns would cut keys and labels."""
    if console.is_terminal:
        console.print(table)
        return
    from rich.measure import Measurement

    width = Measurement.get(console, console.options.update_width(1 << 16), table).maximum
    Console(width=width, highlight=False, markup=False).print(table)


def _check_pins(pins: dict) -> None:
    """The config pins given as options (``--tile-n``, ``--cluster-m``): sizes, so positive; the planner says
    which it can run."""
    from epicute.errors import ConfigError

    for key, value in pins.items():
        if not isinstance(value, bool) and value < 1:
            raise ConfigError(f"--{key.replace('_', '-')} {value}: pin a positive size (tile_n: 64, 128, 192 or 256; "
                              "cluster_m: 1 or 2)")  # fmt: skip


def _check_choice(option: str, value: str, choices: tuple) -> None:
    from epicute.errors import DtypeError

    if value not in choices:
        raise DtypeError(f"{option} {value!r}: give one of {', '.join(choices)}")


@app.command()
def demo(
    m: int = typer.Option(8192, help="rows of A and D"),
    n: int = typer.Option(8192, help="columns of B and D"),
    k: int = typer.Option(8192, help="the reduction dimension"),
) -> None:
    """Run (or, without a GPU, compile) a bf16 GEMM; print its plan, check and speed."""
    from epicute.demo import run_demo

    if not run_demo(m, n, k, echo=console.print):
        raise typer.Exit(1)


@explain_app.command("gemm")
def explain_gemm(
    m: int = typer.Option(..., help="rows of A and D"),
    n: int = typer.Option(..., help="columns of B and D"),
    k: int = typer.Option(..., help="the reduction dimension"),
    l: int = typer.Option(1, "--l", "--batch", help="batch count L"),
    dtype: str = typer.Option("bf16", help="A/B dtype: " + ", ".join(AB_DTYPES)),
    out_dtype: str | None = typer.Option(
        None, help="D dtype: " + ", ".join(D_DTYPES) + " (default: dtype; bf16 for fp8 inputs)"
    ),
    a_major: str = typer.Option("k", help="'k': A row-major; 'm': A column-major"),
    b_major: str | None = typer.Option(
        None, help="'n': B row-major; 'k': B column-major (default: 'n'; 'k' for fp8, which needs it)"
    ),
    tile_n: int | None = typer.Option(None, help="pin the CTA tile's N (64, 128, 192, 256)"),
    cluster_m: int | None = typer.Option(None, help="pin the cluster's M extent (1 or 2)"),
    persistent: bool | None = typer.Option(None, "--persistent/--no-persistent", help="pin persistence"),
    epilogue: str | None = typer.Option(
        None,
        help=f"a fused epilogue: module:function (importable from the working directory or PYTHONPATH), "
        f"or a ready one by name ({READY_EPILOGUES})",
    ),
    operand: list[str] = typer.Option(
        [],
        help="an epilogue operand as name=kind[:dtype] (kind: scalar, row, col, tile); repeat per operand; "
        "fp8 inputs' scales are a_scale (default col: one per row) and b_scale (default row: one per column), "
        "or a_scale=blockwise and b_scale=blockwise (per 128-wide block of K, applied in the mainloop)",
    ),
    target: str | None = typer.Option(None, help=TARGET_HELP),
) -> None:
    """Plan D = A @ B (optionally with a fused epilogue) and print tiles, warp roles, pipelines,
    shared memory, roofline and the epilogue's stage chain."""
    from epicute.errors import ConfigError, EpicuteError
    from epicute.gemm import GemmProblem, render_plan
    from epicute.gemm.aot import gemm_request
    from epicute.gemm.prepare import prepare
    from epicute.runtime.target import resolve_target

    pins = {
        key: value
        for key, value in (("tile_n", tile_n), ("cluster_m", cluster_m), ("persistent", persistent))
        if value is not None
    }
    try:
        _check_pins(pins)
        _check_choice("--dtype", dtype, AB_DTYPES)
        if out_dtype is not None:
            _check_choice("--out-dtype", out_dtype, D_DTYPES)
        b_major = b_major or ("k" if dtype.startswith("fp8") else "n")
        for option, value, choices in (("--a-major", a_major, ("k", "m")), ("--b-major", b_major, ("n", "k"))):
            if value not in choices:
                raise ConfigError(f"{option} {value!r}: give one of {', '.join(choices)}")
        if operand and not epilogue and not dtype.startswith("fp8"):
            raise ConfigError("--operand needs --epilogue (the operands are the epilogue's)")
        operands = dict(item.split("=", 1) if "=" in item else (item, "") for item in operand)
        resolved = resolve_target(target)
        fp8 = dtype.startswith("fp8")
        default_d = "bf16" if fp8 else dtype  # as epicute.gemm defaults it
        problem = GemmProblem(m, n, k, l, dtype, out_dtype or default_d, a_major, b_major)
        plan = prepare(gemm_request(problem, epilogue, operands, out_dtype is not None, {}, pins, resolved)).plan
    except EpicuteError as exc:
        raise _fail(exc) from exc
    console.print(render_plan(plan))


@explain_app.command("grouped")
def explain_grouped_cmd(
    total_m: int = typer.Option(..., min=0, help="rows of A and D over all groups (variable K: M)"),
    n: int = typer.Option(..., min=0, help="columns of B and D (gated: gate and up columns)"),
    k: int = typer.Option(..., min=0, help="the reduction dimension (variable K: total rows the groups split)"),
    groups: int = typer.Option(..., min=1, help="groups (experts)"),
    dtype: str = typer.Option("bf16", help="A/B dtype: bf16, fp16, fp8e4m3, fp8e5m2 (fp8: blockwise scales)"),
    out_dtype: str | None = typer.Option(None, help="D dtype (default: dtype; bf16 for fp8 inputs)"),
    mode: str = typer.Option("rows", help="rows | gathered (a_index) | variable_k (x.t(), dy)"),
    gated: bool = typer.Option(False, "--gated/--no-gated", help="B interleaves gate and up; epilogue f(gate, up)"),
    b_major: str | None = typer.Option(None, help="'k': w.transpose(-2, -1) of a (G, N, K) weight (default); 'n'"),
    tile_n: int | None = typer.Option(None, help="pin the CTA tile's N (64, 128, 192, 256)"),
    cluster_m: int | None = typer.Option(None, help="pin the cluster's M extent (1 or 2)"),
    epilogue: str | None = typer.Option(None, help="a fused epilogue: module:function"),
    operand: list[str] = typer.Option(
        [], help="an epilogue operand as name=kind[:dtype] (kind: scalar, row (G, N), col (total_M, 1), tile)"
    ),
    target: str | None = typer.Option(None, help=TARGET_HELP),
) -> None:
    """Plan a grouped GEMM (mixture-of-experts) and print the grouped schedule, the mean group's tile plan
    and the epilogue chain (no GPU needed; offsets are never read)."""
    from epicute.errors import EpicuteError
    from epicute.grouped.aot import grouped_request
    from epicute.grouped.plan import render_grouped_plan
    from epicute.grouped.prepare import prepare
    from epicute.runtime.target import resolve_target

    pins = {key: value for key, value in (("tile_n", tile_n), ("cluster_m", cluster_m)) if value is not None}
    try:
        _check_pins(pins)
        operands = dict(item.split("=", 1) if "=" in item else (item, "") for item in operand)
        request = grouped_request([total_m, n, k, groups], dtype, out_dtype, b_major, mode, gated, epilogue,
                                  operands, {}, pins, resolve_target(target))  # fmt: skip
        plan = prepare(request).plan
    except EpicuteError as exc:
        raise _fail(exc) from exc
    console.print(render_grouped_plan(plan))


@explain_app.command("attention")
def explain_attention_cmd(
    batch: int = typer.Option(1, min=1, help="batch size"),
    seqlen_q: int = typer.Option(..., min=1, help="query sequence length"),
    seqlen_k: int | None = typer.Option(None, min=1, help="key/value sequence length (default: seqlen-q)"),
    heads_q: int = typer.Option(..., min=1, help="query heads"),
    heads_kv: int | None = typer.Option(None, min=1, help="key/value heads, dividing heads-q (default: heads-q)"),
    head_dim: int = typer.Option(128, min=1, help="head dimension: 64, 128 or 256"),
    dtype: str = typer.Option("bf16", help="q, k, v dtype: " + ", ".join(ATTENTION_DTYPES)),
    causal: bool = typer.Option(False, "--causal/--no-causal", help="causal mask"),
    score_mod: str | None = typer.Option(None, help="a score_mod: module:function"),
    epilogue: str | None = typer.Option(
        None, help=f"an output epilogue: module:function, or a ready one by name ({READY_EPILOGUES})"
    ),
    operand: list[str] = typer.Option(
        [], help="a hook operand as name=kind[:dtype] (kind: scalar, head, row, tile); repeat per operand"
    ),
    target: str | None = typer.Option(None, help=TARGET_HELP),
) -> None:
    """Plan a FlashAttention-3 style forward O = softmax(Q K^T) V and print tiles, warp roles,
    pipelines, shared memory, roofline and the output epilogue's chain (no GPU needed)."""
    from epicute.errors import ConfigError, EpicuteError

    try:
        _check_choice("--dtype", dtype, ATTENTION_DTYPES)
        from epicute.attention.aot import prepare_described
        from epicute.attention.plan import render_attention_plan
        from epicute.runtime.target import resolve_target

        if operand and not (epilogue or score_mod):
            raise ConfigError("--operand needs --epilogue or --score-mod (the operands are the hooks')")
        operands = dict(item.split("=", 1) if "=" in item else (item, "") for item in operand)
        prepared = prepare_described(
            dtype, head_dim, causal, (heads_q, heads_kv or heads_q), score_mod, epilogue, operands, None,
            resolve_target(target), (batch, seqlen_q, seqlen_k or seqlen_q),
        )  # fmt: skip
    except EpicuteError as exc:
        raise _fail(exc) from exc
    console.print(render_attention_plan(prepared.plan, prepared.chain))


@app.command("compile")
def compile_cmd(
    spec: Path = typer.Argument(..., help="TOML (or .json) spec of the kernels to build; see epicute.runtime.aot"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the variants and their keys, compile nothing"),
    target: str | None = typer.Option(
        None, help=TARGET_HELP + "; the kernels serve every GPU of its arch, the plans are this one's"
    ),
    jobs: int | None = typer.Option(
        None, "--jobs", "-j", min=0,
        help="worker processes compiling side by side (default: EPICUTE_COMPILE_WORKERS, else half the CPUs, at "
        f"most {DEFAULT_MAX_WORKERS}; 0 or 1: one variant at a time, here)",
    ),  # fmt: skip
) -> None:
    """Compile kernels ahead of time into the disk cache (no GPU needed); a GPU machine then loads them."""
    from rich.table import Table

    from epicute.errors import EpicuteError
    from epicute.runtime.aot import compile_spec
    from epicute.runtime.cache import cache_dir
    from epicute.runtime.target import resolve_target

    table = Table("kind", "problem", "key", "status", "seconds")
    try:
        resolved = resolve_target(target)
        console.print(f"target {resolved.describe()}")
        with console.status(f"compiling for {resolved.arch}..."):
            results = compile_spec(
                spec, dry_run=dry_run, on_result=lambda r: console.print(f"  {r.kind} {r.what}: {r.status}"),
                target=resolved, workers=jobs,
            )  # fmt: skip
    except EpicuteError as exc:
        raise _fail(exc) from exc
    for r in results:
        table.add_row(r.kind, r.what, r.digest[:16], r.status, f"{r.seconds:.2f}")
    _print_table(table)
    built = sum(r.status == "compiled" for r in results)
    console.print(f"{len(results)} variants ({built} compiled now) in {cache_dir()}")


@cache_app.command("ls")
def cache_ls() -> None:
    """One line per cached kernel: key, kind, size, compile time, and whether this version can use it."""
    from rich.table import Table

    from epicute.runtime.cache import disk_entries

    root = _usable_cache_dir()
    entries = disk_entries(root, verify=True) if root else []
    table = Table("key", "kind", "KiB", "compile s", "created", "usable", "variant")
    for e in entries:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["created"])) if "created" in e else "?"
        usable = "damaged" if e["damaged"] else "yes" if e["current"] else "stale"
        variant = e.get("label") or e.get("parts", "?")
        kib, seconds = f"{e.get('size', 0) / 1024:.0f}", str(e.get("compile_seconds", "?"))
        table.add_row(e["digest"][:16], str(e.get("kind", "?")), kib, seconds, created, usable, variant)
    _print_table(table)
    console.print(f"{len(entries)} entries in {root or 'nowhere (EPICUTE_CACHE=0)'}")
    damaged = [e for e in entries if e["damaged"]]
    for e in damaged:
        console.print(f"damaged {e['digest'][:16]}: {e['damaged']}")
    if damaged:
        console.print("the next call that needs a damaged entry rebuilds it; `epicute cache clear` removes them now")


def _usable_cache_dir(writable: bool = False):
    """The cache directory (None when EPICUTE_CACHE=0), or exit 2 saying why it cannot be used."""
    from epicute.errors import EpicuteError
    from epicute.runtime.cache import check_cache_dir

    try:
        return check_cache_dir(writable=writable)
    except EpicuteError as exc:
        raise _fail(exc) from exc


@cache_app.command("info")
def cache_info() -> None:
    """Where the cache lives, whether it is on, and how big it is."""
    from epicute.runtime.cache import code_versions, disk_entries

    root = _usable_cache_dir()
    entries = disk_entries(root) if root else []
    console.print(f"directory   {root if root else '(disabled: EPICUTE_CACHE=0)'}")
    console.print(f"entries     {len(entries)} ({sum(not e['current'] for e in entries)} stale)")
    console.print(f"size        {sum(e.get('size', 0) for e in entries) / 2**20:.2f} MiB")
    console.print("versions    " + ", ".join(f"{k} {v}" for k, v in code_versions()))
    console.print("settings    EPICUTE_CACHE_DIR to move it, EPICUTE_CACHE=0 to turn it off")


@cache_app.command("clear")
def cache_clear(stale: bool = typer.Option(False, "--stale", help="only entries other versions built")) -> None:
    """Delete cached kernels (they are rebuilt on the next call)."""
    from epicute.runtime.cache import clear_disk

    root = _usable_cache_dir(writable=True)
    removed = clear_disk(root, stale_only=stale) if root else 0
    console.print(f"removed {removed} {'stale ' if stale else ''}entries from {root or 'nowhere (EPICUTE_CACHE=0)'}")


@app.command()
def doctor() -> None:
    """Check the driver, GPU, CuTe DSL, kernel cache and optional extras; say what is missing."""
    from epicute.doctor import checks

    found = checks()
    width = max(len(c.name) for c in found)
    for c in found:
        mark = "[green]ok[/green]  " if c.ok else "[yellow]warn[/yellow]"
        console.print(f"{mark} {escape(c.name.ljust(width))}  {escape(c.found)}", markup=True)
        if c.fix:
            console.print(f"       {' ' * width}  -> {c.fix}")
    missing = [c for c in found if not c.ok]
    console.print("everything epicute needs is here" if not missing else f"{len(missing)} item(s) to look at (above)")


@app.command()
def bench(
    shapes: str | None = typer.Option(None, help="comma-separated MxNxK list (default: a standard set)"),
    plot: Path = typer.Option(Path("epicute-bench.png"), help="where to write the TFLOPS-vs-shape PNG"),
    no_plot: bool = typer.Option(False, "--no-plot", help="skip the plot (no matplotlib needed)"),
) -> None:
    """Time bf16 GEMMs against cuBLAS (and quack) over shapes; print a table, write a PNG plot."""
    from rich.progress import Progress
    from rich.table import Table

    from epicute import benchmark
    from epicute.errors import EpicuteError

    try:
        todo = benchmark.parse_shapes(shapes) if shapes else list(benchmark.DEFAULT_SHAPES)
        device = benchmark.check_device()  # first: without a GPU, installing matplotlib would not help
        if not no_plot:
            benchmark.require_matplotlib()  # before minutes of timing, not after
    except EpicuteError as exc:
        raise _fail(exc) from exc
    fns = benchmark.contenders()
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(todo))
        for m, n, k in todo:
            progress.update(task, description=f"{m}x{n}x{k}")
            rows.append(benchmark.run_shape((m, n, k), fns))
            progress.advance(task)
    table = Table("shape", *(f"{name} TFLOPS" for name in fns), title=f"bf16 GEMM on {device}")
    for row in rows:
        table.add_row(str(row["case"]), *(f"{row[name]:.1f}" if row.get(name) else "failed" for name in fns))
    _print_table(table)
    for row in rows:
        for name in fns:
            if row.get(f"{name}_error"):
                console.print(f"{row['case']} {name}: {row[f'{name}_error']}")
    if not no_plot:
        console.print(f"plot: {benchmark.plot(rows, list(fns), plot, f'bf16 GEMM on {device}')}")
    if any(row.get("epicute") is None for row in rows):
        raise typer.Exit(1)


if __name__ == "__main__":
    app(prog_name="epicute")
