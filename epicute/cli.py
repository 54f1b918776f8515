"""The ``epicute`` command line: ``demo``, ``explain``, ``bench``, ``compile``, ``cache``, ``doctor``.

Thin on purpose: each command parses arguments and calls the library. Errors
epicute raises on purpose are printed in one line and exit with status 2.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="epicute: fused Hopper kernels from Python.")
explain_app = typer.Typer(no_args_is_help=True, help="Print the plan epicute would run, with or without a GPU.")
app.add_typer(explain_app, name="explain")
cache_app = typer.Typer(no_args_is_help=True, help="The compiled-kernel cache on disk: list, describe, clear.")
app.add_typer(cache_app, name="cache")
# soft_wrap: plans are tables; never re-wrap them to the terminal width.
console = Console(highlight=False, soft_wrap=True)

DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


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
    dtype: str = typer.Option("bf16", help="A/B dtype: bf16 or fp16"),
    out_dtype: Optional[str] = typer.Option(None, help="D dtype: bf16, fp16 or fp32 (default: dtype)"),
    a_major: str = typer.Option("k", help="'k': A row-major; 'm': A column-major"),
    b_major: str = typer.Option("n", help="'n': B row-major; 'k': B column-major"),
    tile_n: Optional[int] = typer.Option(None, help="pin the CTA tile's N (64, 128, 256)"),
    cluster_m: Optional[int] = typer.Option(None, help="pin the cluster's M extent (1 or 2)"),
    persistent: Optional[bool] = typer.Option(None, "--persistent/--no-persistent", help="pin persistence"),
    epilogue: Optional[str] = typer.Option(
        None, help="a fused epilogue by import path, e.g. epicute.epilogue.library:row_col_quant"
    ),
    operand: list[str] = typer.Option(
        [], help="an epilogue operand as name=kind[:dtype] (kind: scalar, row, col, tile); repeat per operand"
    ),
) -> None:
    """Plan D = A @ B (optionally with a fused epilogue) and print tiles, warp roles, pipelines,
    shared memory, roofline and the epilogue's stage chain."""
    from dataclasses import replace

    from epicute.errors import EpicuteError
    from epicute.plan import GemmProblem, plan_gemm, render_plan
    from epicute.plan.smem import NO_EPILOGUE

    overrides = {
        key: value
        for key, value in (("tile_n", tile_n), ("cluster_m", cluster_m), ("persistent", persistent))
        if value is not None
    }
    try:
        problem = GemmProblem(m, n, k, l, dtype, out_dtype or dtype, a_major, b_major)
        buffers = NO_EPILOGUE
        if epilogue:
            from epicute.epilogue.tracer import as_epilogue
            from epicute.runtime.aot import _gemm_fusion, import_object

            operands = dict(item.split("=", 1) if "=" in item else (item, "") for item in operand)
            fusion = _gemm_fusion(
                as_epilogue(import_object(epilogue)), operands, problem.d_dtype, out_dtype is not None, {}
            )
            problem = replace(problem, d_dtype=fusion.output_dtypes["D"])
            buffers = fusion.buffers()
        elif operand:
            raise typer.BadParameter("--operand needs --epilogue")
        plan = plan_gemm(problem, epilogue=buffers, **overrides)
    except EpicuteError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    console.print(render_plan(plan), markup=False)


def _fail(exc: Exception) -> typer.Exit:
    console.print(f"[red]error:[/red] {exc}", markup=True)
    return typer.Exit(2)


@app.command("compile")
def compile_cmd(
    spec: Path = typer.Argument(..., help="TOML (or .json) spec of the kernels to build; see epicute.runtime.aot"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the variants and their keys, compile nothing"),
) -> None:
    """Compile kernels ahead of time into the disk cache (no GPU needed); a GPU machine then loads them."""
    from rich.table import Table

    from epicute.errors import EpicuteError
    from epicute.runtime.aot import compile_spec
    from epicute.runtime.cache import cache_dir

    table = Table("kind", "problem", "key", "status", "seconds")
    try:
        with console.status("compiling for sm_90a..."):
            results = compile_spec(spec, dry_run=dry_run, on_result=lambda r: console.print(f"  {r.kind} {r.what}: {r.status}"))
    except EpicuteError as exc:
        raise _fail(exc) from exc
    for r in results:
        table.add_row(r.kind, r.what, r.digest[:16], r.status, f"{r.seconds:.2f}")
    console.print(table)
    built = sum(r.status == "compiled" for r in results)
    console.print(f"{len(results)} variants ({built} compiled now) in {cache_dir()}")


@cache_app.command("ls")
def cache_ls() -> None:
    """One line per cached kernel: key, kind, size, compile time, and whether this version can use it."""
    from rich.table import Table

    from epicute.runtime.cache import cache_dir, disk_entries

    entries = disk_entries()
    table = Table("key", "kind", "KiB", "compile s", "created", "usable", "variant")
    for e in entries:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["created"])) if "created" in e else "?"
        usable = "yes" if e["current"] else "stale"
        table.add_row(e["digest"][:16], e.get("kind", "?"), f"{e.get('size', 0) / 1024:.0f}",
                      str(e.get("compile_seconds", "?")), created, usable, e.get("label") or e.get("parts", "damaged"))  # fmt: skip
    console.print(table)
    console.print(f"{len(entries)} entries in {cache_dir() or 'nowhere (EPICUTE_CACHE=0)'}")


@cache_app.command("info")
def cache_info() -> None:
    """Where the cache lives, whether it is on, and how big it is."""
    from epicute.runtime.cache import cache_dir, code_versions, disk_entries

    root = cache_dir()
    entries = disk_entries()
    console.print(f"directory   {root if root else '(disabled: EPICUTE_CACHE=0)'}")
    console.print(f"entries     {len(entries)} ({sum(not e['current'] for e in entries)} stale)")
    console.print(f"size        {sum(e.get('size', 0) for e in entries) / 2**20:.2f} MiB")
    console.print("versions    " + ", ".join(f"{k} {v}" for k, v in code_versions()))
    console.print("settings    EPICUTE_CACHE_DIR to move it, EPICUTE_CACHE=0 to turn it off")


@cache_app.command("clear")
def cache_clear(stale: bool = typer.Option(False, "--stale", help="only entries other versions built")) -> None:
    """Delete cached kernels (they are rebuilt on the next call)."""
    from epicute.runtime.cache import cache_dir, clear_disk

    removed = clear_disk(stale_only=stale)
    console.print(f"removed {removed} {'stale ' if stale else ''}entries from {cache_dir() or 'nowhere (EPICUTE_CACHE=0)'}")


@app.command()
def doctor() -> None:
    """Check the driver, GPU, CuTe DSL, kernel cache and optional extras; say what is missing."""
    from epicute.doctor import checks

    found = checks()
    width = max(len(c.name) for c in found)
    for c in found:
        mark = "[green]ok[/green]  " if c.ok else "[yellow]warn[/yellow]"
        console.print(f"{mark} {c.name.ljust(width)}  {c.found}", markup=True)
        if c.fix:
            console.print(f"       {' ' * width}  -> {c.fix}", markup=False)
    missing = [c for c in found if not c.ok]
    console.print("everything epicute needs is here" if not missing else f"{len(missing)} item(s) to look at (above)")


@app.command()
def bench(
    shapes: Optional[str] = typer.Option(None, help="comma-separated MxNxK list (default: a standard set)"),
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
        if not no_plot:
            benchmark.require_matplotlib()  # fail before minutes of timing, not after
        device = benchmark.check_device()
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
    console.print(table)
    for row in rows:
        for name in fns:
            if row.get(f"{name}_error"):
                console.print(f"{row['case']} {name}: {row[f'{name}_error']}", markup=False)
    if not no_plot:
        console.print(f"plot: {benchmark.plot(rows, list(fns), plot, f'bf16 GEMM on {device}')}")
    if any(row.get("epicute") is None for row in rows):
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
