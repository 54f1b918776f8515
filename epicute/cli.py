"""The ``epicute`` command line: ``demo`` and ``explain``.

Thin on purpose: each command parses arguments and calls the library.
"""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="epicute: fused Hopper kernels from Python.")
explain_app = typer.Typer(no_args_is_help=True, help="Print the plan epicute would run, with or without a GPU.")
app.add_typer(explain_app, name="explain")
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
) -> None:
    """Plan D = A @ B and print tiles, warp roles, pipelines, shared memory and roofline."""
    from epicute.errors import EpicuteError
    from epicute.plan import GemmProblem, plan_gemm, render_plan

    overrides = {
        key: value
        for key, value in (("tile_n", tile_n), ("cluster_m", cluster_m), ("persistent", persistent))
        if value is not None
    }
    try:
        problem = GemmProblem(m, n, k, l, dtype, out_dtype or dtype, a_major, b_major)
        plan = plan_gemm(problem, **overrides)
    except EpicuteError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    console.print(render_plan(plan), markup=False)


if __name__ == "__main__":
    app()
