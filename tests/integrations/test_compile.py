"""The torch.compile integration on the CPU (the reference backend computes the lifted GEMMs): which linears are
lifted with which ops, and the compiled step against float64 autograd."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from epicute.integrations import compile as EC
from tests.integrations.compile_cases import (
    block,
    block_leaves,
    experts,
    experts_errors,
    masked_sdpa,
    step_errors,
)

TOL = 1e-2  # bf16 inputs, weights and outputs

AOT_EAGER = functools.partial(EC.backend, inner="aot_eager")


@pytest.mark.parametrize("inner", ["inductor", "aot_eager"])
def test_a_block_trains_through_its_lifted_gemms(reference_layers, inner):
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=functools.partial(EC.backend, inner=inner), fullgraph=True)
    errors = step_errors(compiled, block_leaves((3, 37), "cpu"))
    assert all(e < TOL for e in errors.values()), errors
    assert [steps for _, steps in EC.last_report().lifted] == [("add", "gelu", "mul", "add"), ("silu", "add")]


@pytest.mark.parametrize(("mode", "options"), [("reduce-overhead", None), (None, {"epilogue_fusion": False})])
def test_torch_compiles_mode_and_options_reach_inductor(reference_layers, mode, options):
    """``torch.compile(..., backend=EC.backend, mode=..., options=...)`` hands both to the backend: the lifts are
    the same and Inductor compiles the rest with them (CUDA graphs where the step runs on a GPU)."""
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=EC.backend, mode=mode, options=options, fullgraph=True)
    errors = step_errors(compiled, block_leaves((3, 37), "cpu"))
    assert all(e < TOL for e in errors.values()), errors
    assert [steps for _, steps in EC.last_report().lifted] == [("add", "gelu", "mul", "add"), ("silu", "add")]


@pytest.mark.parametrize(("backend", "mode", "names"), [
    (EC.backend, "fastest", "torch.compile's modes are"),
    (AOT_EAGER, "reduce-overhead", "inner='aot_eager' takes neither"),
])  # fmt: skip
def test_a_mode_the_backend_cannot_honour_is_refused(backend, mode, names):
    from torch._dynamo.exc import BackendCompilerFailed

    from epicute import ConfigError

    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed) as failed:
        torch.compile(block, backend=backend, mode=mode)(**block_leaves((3, 37), "cpu"))
    assert isinstance(failed.value.inner_exception, ConfigError) and names in str(failed.value.inner_exception)


def test_dynamic_shapes_keep_one_graph(reference_layers):
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=AOT_EAGER, fullgraph=True, dynamic=True)
    for tokens in ((3, 37), (5, 41)):
        errors = step_errors(compiled, block_leaves(tokens, "cpu"))
        assert all(e < TOL for e in errors.values()), (tokens, errors)
    assert len(EC.last_report().lifted) == 2


def test_what_is_left_and_where_a_chain_stops(reference_layers):
    def f(x, w, x32, w32):
        y = F.linear(x, w)
        return torch.tanh(y) + y.mean(), F.linear(x32, w32)  # y has two users; fp32 is Inductor's

    torch._dynamo.reset()
    x, w = torch.randn(9, 64, dtype=torch.bfloat16), (torch.randn(16, 64) / 8).to(torch.bfloat16)
    out = torch.compile(f, backend=AOT_EAGER, fullgraph=True)(x, w, x.float(), w.float())
    report = EC.last_report()
    assert [steps for _, steps in report.lifted] == [()]  # lifted alone: its value has two users
    assert len(report.left) == 1 and "torch.float32" in report.left[0][1]
    assert "linear -> (no epilogue)" in str(report)
    y = F.linear(x.double(), w.double())
    want = torch.tanh(y) + y.mean()
    assert ((out[0].double() - want).norm() / want.norm()).item() < TOL


def test_odd_widths_are_left_with_the_reason():
    def f(x, w):
        return F.gelu(F.linear(x, w))

    torch._dynamo.reset()
    x, w = torch.randn(4, 20, dtype=torch.bfloat16), torch.randn(12, 20, dtype=torch.bfloat16)
    torch.compile(f, backend=AOT_EAGER)(x, w)
    assert EC.last_report().lifted == []
    assert "multiples of 8" in EC.last_report().left[0][1]


def _sdpa_block(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) * 2


def test_attention_is_lifted_and_computes_sdpa(reference_layers):
    """Inference on the CPU (the reference backend has no compiled backward: the GPU test trains)."""
    torch._dynamo.reset()
    q = torch.randn(2, 8, 37, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 37, 64, dtype=torch.bfloat16) for _ in range(2))
    out = torch.compile(_sdpa_block, backend=AOT_EAGER, fullgraph=True)(q, k, v)
    assert EC.last_report().lifted == [("scaled_dot_product_attention", ("attention",))]
    want = _sdpa_block(q.double(), k.double(), v.double())
    assert ((out.double() - want).norm() / want.norm()).item() < TOL


def test_attention_torch_and_epicute_would_align_differently_is_left():
    def f(q, k, v, mask):
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # 5 queries over 37 keys: top-left in torch
        return causal, F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    torch._dynamo.reset()
    q, k = torch.randn(1, 4, 5, 64, dtype=torch.bfloat16), torch.randn(1, 4, 37, 64, dtype=torch.bfloat16)
    torch.compile(f, backend=AOT_EAGER)(q, k, k, torch.ones(5, 37, dtype=torch.bool))
    reasons = [why for _, why in EC.last_report().left]
    assert EC.last_report().lifted == [] and len(reasons) == 2
    assert "top-left" in reasons[0] and "attn_mask read from the graph's inputs" in reasons[1]


@pytest.mark.parametrize(("mask", "repeat", "notes"), [
    ("causal", "repeat_kv", ("key/value heads unrepeated (4x)", "the causal attn_mask as causal")),
    ("additive", "repeat_interleave", ("key/value heads unrepeated (4x)", "the causal attn_mask as causal")),
    ("everything", "none", ("an attn_mask masking nothing, dropped",)),
])  # fmt: skip
def test_a_causal_mask_built_from_sizes_and_repeated_heads_are_read_through(reference_layers, mask, repeat, notes):
    """transformers under torch.compile hands SDPA an explicit causal mask and keys/values repeated to the query
    heads: the lift evaluates the mask (built from sizes alone), takes the unrepeated heads (GQA), and computes the
    same attention; odd length, O against float64."""
    torch._dynamo.reset()
    q = torch.randn(2, 8 if repeat != "none" else 2, 37, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 37, 64, dtype=torch.bfloat16) for _ in range(2))
    f = functools.partial(masked_sdpa, mask=mask, repeat=repeat)
    out = torch.compile(f, backend=AOT_EAGER, fullgraph=True, dynamic=False)(q, k, v)
    assert EC.last_report().lifted == [("scaled_dot_product_attention", ("attention", *notes))]
    assert "attention (" in str(EC.last_report())
    want = f(q.double(), k.double(), v.double())
    assert ((out.double() - want).norm() / want.norm()).item() < TOL


def test_a_shared_mask_is_evaluated_once_and_compared_in_row_blocks(reference_layers, monkeypatch):
    """Every layer's SDPA reads the one mask node: evaluated once. Compared with the causal pattern 8 query rows at a
    time here (37 rows: a ragged last block), a mask wrong only in its last row is still found."""
    monkeypatch.setattr(EC, "MASK_ROWS", 8)
    evaluated, evaluate = [], EC._evaluated_mask_kind
    monkeypatch.setattr(EC, "_evaluated_mask_kind", lambda *args: evaluated.append(1) or evaluate(*args))

    def f(q, k, v, wrong_last_row: bool):
        n = q.shape[2]
        rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = (cols <= rows) & ~((rows == n - 1) & (cols == 0) & wrong_last_row)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(out, k, v, attn_mask=mask)

    q = torch.randn(1, 2, 37, 64, dtype=torch.bfloat16)
    for wrong, lifted in ((False, 2), (True, 0)):
        torch._dynamo.reset()
        evaluated.clear()
        torch.compile(functools.partial(f, wrong_last_row=wrong), backend=AOT_EAGER, dynamic=False)(q, q, q)
        assert len(EC.last_report().lifted) == lifted and len(evaluated) == 1, (wrong, EC.last_report())


def test_a_mask_of_symbolic_sizes_is_left_and_still_computes(reference_layers):
    """Under dynamic shapes the mask's aranges take the graph's symbolic sizes: whether it is causal for every size
    is not read from one evaluation, so SDPA keeps it (and the graph still computes it right at two lengths)."""
    torch._dynamo.reset()
    f = functools.partial(masked_sdpa, mask="causal", repeat="repeat_kv")
    compiled = torch.compile(f, backend=AOT_EAGER, dynamic=True)
    for n in (37, 45):
        q, k = torch.randn(2, 8, n, 64, dtype=torch.bfloat16), torch.randn(2, 2, n, 64, dtype=torch.bfloat16)
        out, want = compiled(q, k, k), f(q.double(), k.double(), k.double())
        assert ((out.double() - want).norm() / want.norm()).item() < TOL
    report = EC.last_report()
    assert report.lifted == [] and "symbolic sizes" in report.left[0][1], report


def test_masks_other_than_causal_are_left_with_the_reason():
    def f(q, k, padding):
        n = q.shape[2]
        rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
        return (
            masked_sdpa(q, k, k, "window", "repeat_kv"),
            F.scaled_dot_product_attention(q, k, k, attn_mask=(cols - rows).to(q.dtype)),  # a bias
            F.scaled_dot_product_attention(q, k, k, attn_mask=padding),
            F.scaled_dot_product_attention(q, k, k, attn_mask=torch.rand(n, n) > 0.5),
        )

    torch._dynamo.reset()
    q, k = torch.randn(1, 4, 24, 64, dtype=torch.bfloat16), torch.randn(1, 4, 24, 64, dtype=torch.bfloat16)
    torch.compile(f, backend=AOT_EAGER, dynamic=False)(q, k, torch.ones(24, 24, dtype=torch.bool))
    reasons = [why for _, why in EC.last_report().left]
    assert EC.last_report().lifted == [] and len(reasons) == 4, reasons
    assert "other than the causal" in reasons[0] and "besides 0 and -inf" in reasons[1]
    assert "graph's inputs" in reasons[2] and "built with rand" in reasons[3]


def _cast_chain(x, w, b, r):
    """A linear whose chain casts: GELU in the layer's dtype, then fp32 math with an fp32 tile."""
    return F.gelu(F.linear(x, w, b)).float() * 2.0 + r


def _cast_leaves() -> list[torch.Tensor]:
    x = torch.randn(3, 29, 64, dtype=torch.bfloat16)
    w, b = (torch.randn(40, 64) / 8).to(torch.bfloat16), torch.randn(40, dtype=torch.bfloat16)
    return [t.requires_grad_() for t in (x, w, b, torch.randn(3, 29, 40))]


def test_casts_in_a_chain_are_lifted_and_set_the_output_dtype(reference_layers):
    """``.float()`` inside the chain: one GEMM whose epilogue goes on in fp32 and stores fp32; forward and every
    gradient (the fp32 tile's too) against float64 autograd."""
    torch._dynamo.reset()
    compiled = torch.compile(_cast_chain, backend=AOT_EAGER, fullgraph=True)
    errors = step_errors(compiled, dict(zip("xwbr", _cast_leaves())), math=_cast_chain)
    assert all(e < TOL for e in errors.values()), errors
    assert [steps for _, steps in EC.last_report().lifted] == [("add", "gelu", "to_float32", "mul", "add")]
    assert compiled(*_cast_leaves()).dtype == torch.float32


def test_a_cast_between_half_types_sets_the_output_dtype(reference_layers):
    def f(x, w):
        return torch.tanh(F.linear(x, w)).to(torch.bfloat16)

    torch._dynamo.reset()
    x, w = torch.randn(5, 64, dtype=torch.float16), (torch.randn(24, 64) / 8).to(torch.float16)
    out = torch.compile(f, backend=AOT_EAGER, fullgraph=True)(x, w)
    assert [steps for _, steps in EC.last_report().lifted] == [("tanh", "to_bfloat16")] and out.dtype == torch.bfloat16
    want = f(x.double(), w.double())
    assert ((out.double() - want).norm() / want.norm()).item() < TOL


def test_what_is_no_float_cast_ends_the_chain(reference_layers):
    def f(x, w):
        return (torch.tanh(F.linear(x, w)).to(torch.int32), F.linear(x, w).to("cpu") * 2,
                F.linear(x, w).to(torch.float32, copy=True))  # fmt: skip

    torch._dynamo.reset()
    x, w = torch.randn(5, 64, dtype=torch.bfloat16), (torch.randn(24, 64) / 8).to(torch.bfloat16)
    torch.compile(f, backend=AOT_EAGER, fullgraph=True)(x, w)
    assert sorted(steps for _, steps in EC.last_report().lifted) == [(), (), ("tanh",)]


def test_a_cast_chain_is_measured_against_the_same_casts(reference_layers, monkeypatch, tmp_path):
    """The unlifted side replays the casts: the timer checks both sides' outputs and gradients agree."""
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    timer = _Timer(1.0, 2.0)
    backend = functools.partial(EC.backend, inner="aot_eager", decide=EC.Measured(timer=timer, peer=lambda gm, _: gm))
    torch._dynamo.reset()
    y = torch.compile(_cast_chain, backend=backend, fullgraph=True)(*_cast_leaves())
    assert timer.calls == 2 and y.dtype == torch.float32
    assert [steps for _, steps in EC.last_report().lifted] == [("add", "gelu", "to_float32", "mul", "add")]


def test_a_matmul_with_a_transposed_weight_is_lifted_like_a_linear(reference_layers):
    def f(x, w, b):
        return torch.tanh(x @ w.t() + b)

    torch._dynamo.reset()
    x, w = torch.randn(3, 29, 64, dtype=torch.bfloat16), (torch.randn(40, 64) / 8).to(torch.bfloat16)
    b = torch.randn(40, dtype=torch.bfloat16)
    out = torch.compile(f, backend=AOT_EAGER, fullgraph=True)(x, w, b)
    assert [steps for _, steps in EC.last_report().lifted] == [("add", "tanh")]
    want = f(x.double(), w.double(), b.double())
    assert ((out.double() - want).norm() / want.norm()).item() < TOL


@pytest.mark.parametrize("inner", ["inductor", "aot_eager"])
def test_grouped_mm_experts_are_lifted_and_train(reference_layers, inner):
    torch._dynamo.reset()
    compiled = torch.compile(experts, backend=functools.partial(EC.backend, inner=inner), fullgraph=True)
    errors = experts_errors(compiled, [7, 7, 20, 33, 45], "cpu")  # an empty expert too
    assert all(e < TOL for e in errors.values()), errors
    assert [steps for _, steps in EC.last_report().lifted] == [("grouped", "silu", "mul")]
    assert "grouped gemm -> silu, mul" in str(EC.last_report())


def test_grouped_mm_epicute_cannot_take_is_left_with_the_reason():
    torch._dynamo.reset()
    x, w = torch.randn(12, 24, dtype=torch.bfloat16), torch.randn(3, 12, 24, dtype=torch.bfloat16)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    out = torch.compile(experts, backend=AOT_EAGER, fullgraph=True)(x, w, offs, torch.ones(12, 1))
    report = EC.last_report()
    assert not report.lifted and "N=12" in report.left[0][1] and out.shape == (12, 12)


def is_peer(fn) -> bool:
    """Whether a timed side is the unlifted call (its graph, calling no epicute op) rather than epicute's (traced into
    its ops' calls, as a compiled graph makes them)."""
    return isinstance(fn, torch.fx.GraphModule) and "torch.ops.epicute." not in fn.code


class _Timer:
    """Runs each timed call once and reports ``ours`` for epicute's call, ``theirs`` for the unlifted call (the peer
    here: its graph itself, run eagerly). Where the graph trains, each side is one function of the inputs and the
    output's gradient returning the output and the inputs' gradients: the two sides must agree on all of them."""

    def __init__(self, ours: float, theirs: float) -> None:
        self.ours, self.theirs, self.calls = ours, theirs, 0
        self.results: dict[bool, list] = {}

    def __call__(self, fn, inputs) -> float:
        peer = is_peer(fn)
        out = fn(*inputs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        assert all(isinstance(t, torch.Tensor) and torch.isfinite(t.float()).all() for t in outs)
        self.results[peer] = outs
        if len(self.results) == 2:  # both sides of one candidate: the same output and gradients
            ours, theirs = self.results.pop(False), self.results.pop(True)
            assert len(ours) == len(theirs)
            for got, want in zip(ours, theirs):
                assert ((got.double() - want.double()).norm() / want.double().norm()).item() < TOL
        self.calls += 1
        return self.theirs if peer else self.ours


@pytest.mark.parametrize(("ours", "theirs", "lifted"), [(1.0, 2.0, True), (3.0, 2.0, False)])
def test_each_candidate_is_kept_only_where_it_wins(reference_layers, monkeypatch, tmp_path, ours, theirs, lifted):
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    timer = _Timer(ours, theirs)
    decide = EC.Measured(timer=timer, peer=lambda gm, inputs: gm)
    compiled_block = functools.partial(EC.backend, inner="aot_eager", decide=decide)
    for _ in range(2):  # the second compile takes the decisions from the disk
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=compiled_block, fullgraph=True)
        errors = step_errors(compiled, block_leaves((3, 37), "cpu"))
        assert all(e < TOL for e in errors.values()), errors
        report = EC.last_report()
        assert len(report.lifted) == (2 if lifted else 0) and len(report.left) == (0 if lifted else 2)
        expected = f"measured (forward and backward): epicute {ours:.4g} ms, Inductor {theirs:.4g} ms"
        assert all(why == expected for _, why in report.measured), report.measured
        assert timer.calls == 4  # two candidates, each side timed once, on the first compile only
    assert (tmp_path / "lifted.json").exists()


def test_the_peers_are_compiled_with_the_modes_settings_and_decided_per_settings(reference_layers, monkeypatch,
                                                                                  tmp_path):
    """Under ``mode="max-autotune"`` a candidate meets Inductor's autotuned chain: its peer is compiled with the
    mode's settings (CUDA graphs aside: they change host cost, not kernels), the report says so, and the decision is
    remembered per settings (the default mode measures again; the same settings find it on disk)."""
    from torch._inductor import compile_fx as inductor
    from torch._inductor import list_mode_options

    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    compiled_with = []

    def compile_fx(gm, inputs, config_patches=None):
        compiled_with.append(config_patches)
        return gm

    monkeypatch.setattr(inductor, "compile_fx", compile_fx)
    autotuned = list_mode_options("max-autotune")
    assert autotuned.get("triton.cudagraphs")
    for settings, measures in ((autotuned, 2), ({}, 2), (autotuned, 0)):
        timer, before = _Timer(1.0, 2.0), len(compiled_with)
        decide = EC.Measured(timer=timer, settings=settings)
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=functools.partial(EC.backend, inner="aot_eager", decide=decide))
        errors = step_errors(compiled, block_leaves((3, 37), "cpu"))
        assert all(e < TOL for e in errors.values()), errors
        assert timer.calls == 2 * measures  # each side of each candidate timed where no decision was on disk
        assert compiled_with[before:] == [decide.settings] * measures
        last = str(EC.last_report()).splitlines()[-1]
        if decide.settings:
            assert decide.settings == {"max_autotune": True, "coordinate_descent_tuning": True}
            assert last == "measured against Inductor compiled with coordinate_descent_tuning=True, max_autotune=True"
        else:
            assert not last.startswith("measured against")
    assert len(compiled_with) == 4


def test_the_candidates_are_readied_together_before_they_are_decided(reference_layers, monkeypatch, tmp_path):
    """With compile workers, every candidate is found first (a pass that lifts nothing), its kernels precompiled and
    its peer compiled once, while nothing is decided; then the decisions, as without workers. A second compile finds
    the decisions on disk: no peer is compiled again. (On the CPU the reference backend needs no kernel.)"""
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("EPICUTE_COMPILE_WORKERS", "2")
    peers = []

    def peer(gm, inputs):
        peers.append(gm)
        return gm

    decide = EC.Measured(timer=_Timer(1.0, 2.0), peer=peer)
    for _ in range(2):  # the second compile finds the decisions on disk
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=functools.partial(EC.backend, inner="aot_eager", decide=decide))
        errors = step_errors(compiled, block_leaves((3, 37), "cpu"))
        assert all(e < TOL for e in errors.values()), errors
        report = EC.last_report()
        assert len(report.lifted) == 2 and len(peers) == 2 and not decide._ready
        assert report.precompiled.workers == 2 and report.precompiled.compiled == []
        assert str(report).splitlines()[-1].startswith("kernels: none to compile (every kernel in memory or on disk")


def test_without_cuda_graphs_a_sides_host_time_counts_where_it_outlasts_its_gpu_time(
    reference_layers, monkeypatch, tmp_path
):
    """The default timer: epicute's calls 1.0 ms of GPU time against Inductor's 2.0, but 5.0 ms of host time against
    0.1. Without CUDA graphs the host's 5 ms decide (both candidates left, and the report says how they were timed);
    under ``mode="reduce-overhead"``'s graphs the GPU's (both lifted), remembered under keys of their own."""
    from torch._inductor import list_mode_options

    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))

    def ms(ours, theirs):  # a timer of each side's figure (the peer is its graph, run eagerly)
        return lambda fn, inputs: (fn(*inputs), (theirs if is_peer(fn) else ours))[1]

    monkeypatch.setattr(EC, "_time_ms", ms(1.0, 2.0))
    monkeypatch.setattr(EC, "_host_ms", ms(5.0, 0.1))
    graphs = list_mode_options("reduce-overhead")
    for settings, lifted in (({}, 0), (graphs, 2), ({}, 0)):
        decide = EC.Measured(peer=lambda gm, inputs: gm, settings=settings)
        assert decide.counts_host == (not settings)
        torch._dynamo.reset()
        compiled = torch.compile(block, backend=functools.partial(EC.backend, inner="aot_eager", decide=decide))
        errors = step_errors(compiled, block_leaves((3, 37), "cpu"))
        assert all(e < TOL for e in errors.values()), errors
        report = EC.last_report()
        assert len(report.lifted) == lifted and len(report.left) == 2 - lifted
        for _, why in report.left:
            assert "epicute 1 ms GPU, 5 ms host, Inductor 2 ms GPU, 0.1 ms host (no CUDA graphs: kept where" in why


@pytest.mark.parametrize(
    ("ours", "theirs", "kept"),
    [
        ((1.9, 1.9), (2.0, 1.5), False),  # a step of small calls (Inductor's host 0.75 of its GPU): host time adds
        ((1.5, 1.0), (2.0, 0.2), True),  # a GPU-heavy call (0.1): epicute's extra host time hides behind the GPU
        ((2.1, 0.1), (2.0, 0.1), False),  # slower on the GPU
        ((1.0, 2.5), (2.0, 0.1), False),  # its host time outlasts Inductor's whole call
    ],
)
def test_host_time_weighs_as_much_as_inductors_side_says_the_step_is_host_bound(ours, theirs, kept):
    """Without CUDA graphs, epicute's side is kept where it is no worse by the longer of its GPU and host time and
    by GPU time plus host time weighed by Inductor's host-to-GPU ratio; with CUDA graphs, GPU time alone decides."""
    ours, theirs = EC.Cost(*ours), EC.Cost(*theirs)
    assert ours.no_worse_than(theirs) == kept
    assert EC.Cost(ours.gpu_ms).no_worse_than(EC.Cost(theirs.gpu_ms)) == (ours.gpu_ms <= theirs.gpu_ms)
    assert EC.Cost.of(1.5) == EC.Cost(1.5) and EC.Cost.of(ours) is ours


def test_epicutes_side_is_timed_as_the_compiled_graph_calls_it(reference_layers, monkeypatch, tmp_path):
    """The host time that decides is the compiled graph's: epicute's side of each training candidate is timed as the
    calls of its ops that AOTAutograd traces ahead (the forward GEMM with its epilogue, then the backward's GEMMs as
    one op), not through autograd and the Python that decides those calls."""
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    timer, ours = _Timer(1.0, 2.0), []

    def timed(fn, inputs):
        if not is_peer(fn):
            ours.append(fn)
        return timer(fn, inputs)

    torch._dynamo.reset()
    decide = EC.Measured(timer=timed, peer=lambda gm, inputs: gm)
    compiled = torch.compile(block, backend=functools.partial(EC.backend, inner="aot_eager", decide=decide))
    errors = step_errors(compiled, block_leaves((3, 37), "cpu"))
    assert all(e < TOL for e in errors.values()), errors
    assert len(ours) == 2 and len(EC.last_report().lifted) == 2
    for fn in ours:  # the forward's op, then the backward's (its gradient pass, data and weight gradients)
        assert isinstance(fn, torch.fx.GraphModule) and fn.code.count("torch.ops.epicute.gemm.default(") == 1
        assert fn.code.count("torch.ops.epicute.gemm_backward.default(") == 1


def test_a_side_that_does_not_trace_is_timed_as_it_is():
    """Data-dependent Python (a value read on the host) cannot be traced ahead: that side is timed as it is."""

    def reads_a_value(x):
        return x * 2 if x.sum().item() > 0 else x

    x = torch.randn(5, 7)
    assert EC._as_the_graph_calls(reads_a_value, [x]) is reads_a_value
    traced = EC._as_the_graph_calls(lambda x: torch.tanh(x) * 2, [x])
    assert isinstance(traced, torch.fx.GraphModule)
    want = torch.tanh(x) * 2
    assert ((traced(x) - want).norm() / want.norm()).item() < 1e-6


def test_candidates_that_do_not_fit_at_once_are_measured_one_by_one(reference_layers, monkeypatch, tmp_path):
    """Readying every candidate's inputs at once runs out of GPU memory: nothing is precompiled (the report says
    why), and each candidate is then measured alone, as without workers."""
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("EPICUTE_COMPILE_WORKERS", "2")
    made = []
    real_sides = EC.Measured._sides

    def sides(self, candidate):
        made.append(1)
        if len(made) == 2:  # the second candidate's inputs, while readying them all
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_sides(self, candidate)

    monkeypatch.setattr(EC.Measured, "_sides", sides)
    decide = EC.Measured(timer=_Timer(1.0, 2.0), peer=lambda gm, inputs: gm)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=functools.partial(EC.backend, inner="aot_eager", decide=decide))
    errors = step_errors(compiled, block_leaves((3, 37), "cpu"))
    assert all(e < TOL for e in errors.values()), errors
    report = EC.last_report()
    assert len(report.lifted) == 2 and not decide._ready and len(made) == 4  # two tried at once, then one each
    assert str(report).splitlines()[-1] == ("kernels: not precompiled (the candidates' inputs at once: CUDA out of "
                                            "memory. Tried to allocate 2.00 GiB): compiled as the calls need them")


def test_candidates_of_finds_what_would_be_decided_and_changes_nothing(reference_layers):
    found, unchanged = [], []

    def spy(gm, example_inputs):
        before = gm.code
        found.extend(EC.candidates_of(gm))
        unchanged.append(gm.code == before)
        return gm

    torch._dynamo.reset()
    torch.compile(block, backend=spy, fullgraph=True)(*block_leaves((37,), "cpu").values())
    assert unchanged == [True] and [c.lifted.__name__ for c in found] == ["lifted_gemm", "lifted_gemm"]
    programs = [dict(c.options)["program"][0] for c in found]
    assert [tuple(op for op, _ in steps) for steps in programs] == [("add", "gelu", "mul", "add"), ("silu", "add")]


@pytest.mark.parametrize(("ours", "theirs", "lifted"), [(1.0, 2.0, True), (3.0, 2.0, False)])
def test_attention_is_kept_only_where_it_wins(reference_layers, monkeypatch, tmp_path, ours, theirs, lifted):
    """An attention candidate is measured like a GEMM chain: SDPA (GQA 2:1, causal) stays where epicute loses."""
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    timer = _Timer(ours, theirs)
    decide = EC.Measured(timer=timer, peer=lambda gm, inputs: gm)

    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=functools.partial(EC.backend, inner="aot_eager", decide=decide), fullgraph=True)
    q = torch.randn(1, 4, 37, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, 37, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    y = compiled(q, k, v)
    report = EC.last_report()
    assert report.lifted == ([("scaled_dot_product_attention", ("attention",))] if lifted else [])
    expected = f"measured (forward and backward): epicute {ours:.4g} ms, Inductor {theirs:.4g} ms"
    assert [why for _, why in report.measured] == [expected]
    want = f(*(t.detach().double() for t in (q, k, v)))
    assert ((y.double() - want).norm() / want.norm()).item() < TOL


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_graph_without_gradients_is_measured_forward_only(reference_layers, monkeypatch, tmp_path, mode):
    """Weights keep ``requires_grad`` under ``no_grad``/``inference_mode`` (a prefill): nothing trains there, so the
    candidate is timed forward only, and remembered apart from the same call in a training graph."""
    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    decide = EC.Measured(timer=_Timer(1.0, 2.0), peer=lambda gm, inputs: gm)
    w = torch.nn.Parameter((torch.randn(40, 64) / 8).to(torch.bfloat16))

    def f(x):
        return torch.tanh(F.linear(x, w))

    x = torch.randn(3, 29, 64, dtype=torch.bfloat16)
    for context, what in ((mode, "measured: "), (torch.enable_grad, "measured (forward and backward): ")):
        torch._dynamo.reset()
        with context():
            torch.compile(f, backend=functools.partial(EC.backend, inner="aot_eager", decide=decide))(x)
        assert [why[: len(what)] for _, why in EC.last_report().measured] == [what]


def test_the_peer_compiles_inside_the_compile(reference_layers, monkeypatch, tmp_path):
    """Measuring compiles the unlifted chain's forward and backward (one graph, through AOTAutograd) while Dynamo
    compiles the graph, dynamic shapes included: both compiles finish, the decisions say what was measured and the
    steps compute the block."""
    from torch._dynamo.backends.registry import lookup_backend

    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    decide = EC.Measured(timer=lambda fn, inputs: (fn(*inputs), 1.0)[1], peer=lookup_backend("aot_eager"))
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=functools.partial(EC.backend, inner="aot_eager", decide=decide),
                             fullgraph=True, dynamic=True)  # fmt: skip
    for tokens in ((3, 37), (41,)):
        errors = step_errors(compiled, block_leaves(tokens, "cpu"))
        assert all(e < TOL for e in errors.values()), errors
    expected = "measured (forward and backward): epicute 1 ms, Inductor 1 ms"
    assert [why for _, why in EC.last_report().measured] == [expected] * 2


def test_explain_plans_each_lifted_kernel_at_the_graphs_sizes(reference_layers):
    """A report's explain: what was lifted and left, then each lifted node's kernel plan at the graph's sizes (a
    dynamic graph's by their hints), with the epilogue chain the kernel runs; attention and grouped GEMMs too."""

    def model(x, w1, b1, r, w2, v, q, k, w, offs, weights):
        attended = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        return block(x, w1, b1, r, w2, v), attended, experts(x.reshape(-1, 64), w, offs, weights)

    leaves = block_leaves((3, 37), "cpu")
    q = torch.randn(1, 4, 40, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    w = torch.randn(3, 48, 64, dtype=torch.bfloat16)  # (experts, out, in), as experts() takes them
    offs = torch.tensor([50, 50, 111], dtype=torch.int32)
    weights = torch.rand(111, 1, dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=AOT_EAGER, fullgraph=True, dynamic=True)
    compiled(**leaves, q=q, k=k, w=w, offs=offs, weights=weights)
    report = EC.last_report()
    text = report.explain()
    assert text.startswith(str(report) + "\n")
    sections = dict(part.split("\n", 1) for part in text.split("\n== ")[1:])
    assert sorted(sections) == sorted(report.calls) == sorted(node for node, _ in report.lifted)
    plans = sorted(section.splitlines()[0] for section in sections.values())
    attention = "epicute attention plan: O[1x40x4x64] = softmax(Q K^T) V, seqlen_k=40, bf16, causal (bottom-right"
    grouped = "epicute grouped GEMM plan: 3 groups, D[111x48] = A[111x64] @ B[group][64x48] (rows sorted by group;"
    assert plans[:2] == ["epicute GEMM plan: D[1x111x136] = A[1x111x64] @ B[1x64x136]",
                         "epicute GEMM plan: D[1x111x24] = A[1x111x136] @ B[1x136x24]"]  # fmt: skip
    assert plans[2].startswith(attention) and plans[3].startswith(grouped), plans
    chains = [line for section in sections.values() for line in section.splitlines() if "subtile  compute" in line]
    assert any("gelu" in line for line in chains) and any("silu" in line for line in chains)


def test_mm_addmm_and_bmm_are_lifted_with_their_chains(reference_layers):
    """``torch.mm``/``Tensor.mm`` as ``x @ w``, ``torch.addmm(b, x, w)`` as ``x @ w + b`` (the bias its epilogue's
    first step), ``torch.bmm`` and ``a @ b`` of two 3-D tensors as one batched GEMM each, every chain lifted with
    them; each output against float64."""

    def f(x, w, b, a3, b3, t3, col3):
        return (torch.relu(torch.mm(x, w)), torch.tanh(torch.addmm(b, x, w)), x.mm(w) * 2.0,
                torch.sigmoid(torch.bmm(a3, b3) + t3), (a3 @ b3) * col3)  # fmt: skip

    torch._dynamo.reset()
    bf = torch.bfloat16
    x, w, b = torch.randn(21, 64, dtype=bf), (torch.randn(64, 40) / 8).to(bf), torch.randn(40, dtype=bf)
    a3, b3 = torch.randn(3, 13, 32, dtype=bf), (torch.randn(3, 32, 24) / 6).to(bf)
    t3, col3 = torch.randn(3, 13, 24, dtype=bf), torch.randn(3, 13, 1, dtype=bf)
    args = (x, w, b, a3, b3, t3, col3)
    got = torch.compile(f, backend=AOT_EAGER, fullgraph=True)(*args)
    report = EC.last_report()
    assert [steps for _, steps in report.lifted] == [
        ("relu",), ("add", "tanh"), ("mul",), ("batched", "add", "sigmoid"), ("batched", "mul"),
    ], report  # fmt: skip
    assert "batched gemm -> add, sigmoid" in str(report)
    want = f(*(t.double() for t in args))
    for i, (g, r) in enumerate(zip(got, want)):
        assert ((g.double() - r).norm() / r.norm()).item() < TOL, i


def test_batched_gemms_train_through_their_lifted_chain(reference_layers):
    def f(a3, b3, t3):
        return torch.sigmoid(torch.bmm(a3, b3) + t3)

    torch._dynamo.reset()
    bf = torch.bfloat16
    leaves = [torch.randn(2, 17, 32, dtype=bf), (torch.randn(2, 32, 16) / 6).to(bf), torch.randn(2, 17, 16, dtype=bf)]
    grad = torch.randn(2, 17, 16, dtype=bf)
    ours = [t.clone().requires_grad_() for t in leaves]
    torch.compile(f, backend=AOT_EAGER, fullgraph=True)(*ours).backward(grad)
    assert [steps for _, steps in EC.last_report().lifted] == [("batched", "add", "sigmoid")]
    ref = [t.double().requires_grad_() for t in leaves]
    f(*ref).backward(grad.double())
    for name, g, r in zip(("a", "b", "t"), ours, ref):
        assert ((g.grad.double() - r.grad).norm() / r.grad.norm()).item() < TOL, name


def test_mm_shapes_epicute_cannot_take_are_left_with_the_reason():
    def f(x, w, b, a3, b3):
        return torch.addmm(b, x, w, beta=2.0), torch.bmm(a3, b3)

    torch._dynamo.reset()
    bf = torch.bfloat16
    args = (torch.randn(8, 64, dtype=bf), torch.randn(64, 40, dtype=bf), torch.randn(40, dtype=bf),
            torch.randn(2, 8, 20, dtype=bf), torch.randn(2, 20, 16, dtype=bf))  # fmt: skip
    torch.compile(f, backend=AOT_EAGER, fullgraph=True)(*args)
    report = EC.last_report()
    assert report.lifted == []
    reasons = [why for _, why in report.left]
    assert "beta or alpha" in reasons[0] and "K=20" in reasons[1], reasons


SLOPES = torch.rand(4)  # a per-query-head ALiBi slope, captured by the score_mod below


def _softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def _alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _flex_reference(q, k, v, score_mod: str | None, causal: bool) -> torch.Tensor:
    """float64 attention with the score_mods above, GQA by repeated key/value heads."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    q_idx, kv_idx = torch.arange(s.shape[2])[:, None].double(), torch.arange(s.shape[3])[None].double()
    if score_mod == "softcap":
        s = 30.0 * torch.tanh(s / 30.0)
    elif score_mod == "alibi":
        s = s + SLOPES.double()[None, :, None, None] * (kv_idx - q_idx)
    if causal:
        s = s.masked_fill(kv_idx > q_idx, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize(("score_mod", "causal", "steps"), [
    ("softcap", True, ("flex attention", "div", "tanh", "mul")),
    ("alibi", False, ("flex attention", "sub", "mul", "add")),
    (None, False, ("flex attention",)),
])  # fmt: skip
def test_flex_attention_is_lifted_with_its_score_mod(reference_layers, score_mod, causal, steps):
    """``flex_attention``'s score_mod, read from its graph (a captured per-head vector as an operand), and a causal
    block mask become one epicute.attention; GQA 2:1, odd length; O against float64."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mod = {"softcap": _softcap, "alibi": _alibi, None: None}[score_mod]
    mask = create_block_mask(_causal, None, None, 77, 77, device="cpu") if causal else None

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=mod, block_mask=mask, enable_gqa=True)

    torch._dynamo.reset()
    q = torch.randn(2, 4, 77, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 77, 64, dtype=torch.bfloat16) for _ in range(2))
    out = torch.compile(f, backend=AOT_EAGER, fullgraph=True)(q, k, v)
    assert [s for _, s in EC.last_report().lifted] == [steps]
    want = _flex_reference(q, k, v, score_mod, causal)
    assert ((out.double() - want).norm() / want.norm()).item() < TOL


def test_flex_attention_epicute_cannot_take_is_left_with_the_reason():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    window = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < 16, None, None, 64, 64,
                               device="cpu")  # fmt: skip

    def f(q, k, v):
        windowed = flex_attention(q, k, v, block_mask=window)
        with_lse, lse = flex_attention(q, k, v, return_lse=True)
        clamped = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.clamp(s, max=5.0))
        return windowed, with_lse, lse, clamped

    torch._dynamo.reset()
    q = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    torch.compile(f, backend=AOT_EAGER, fullgraph=True)(q, q, q)
    report = EC.last_report()
    reasons = [why for _, why in report.left]
    assert report.lifted == [] and len(reasons) == 3, report
    assert "block mask other than none or causal" in reasons[0]
    assert "log-sum-exp is read" in reasons[1]
    assert "score_mod op epicute lacks" in reasons[2]


@pytest.mark.parametrize(("ours", "theirs", "lifted"), [(1.0, 2.0, True), (3.0, 2.0, False)])
def test_flex_attention_is_kept_only_where_it_wins(reference_layers, monkeypatch, tmp_path, ours, theirs, lifted):
    """Measured against torch's flex_attention with the same score_mod and mask (``flex_peer``), run here eagerly:
    both sides' outputs agree (the timer checks), and the faster one stays."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setenv("EPICUTE_CACHE_DIR", str(tmp_path))
    timer = _Timer(ours, theirs)
    decide = EC.Measured(timer=timer, peer=lambda gm, inputs: gm)
    mask = create_block_mask(_causal, None, None, 40, 40, device="cpu")

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=_alibi, block_mask=mask)

    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 4, 40, 64, dtype=torch.bfloat16) for _ in range(3))
    out = torch.compile(f, backend=functools.partial(EC.backend, inner="aot_eager", decide=decide),
                        fullgraph=True)(q, k, v)  # fmt: skip
    report = EC.last_report()
    assert len(report.lifted) == (1 if lifted else 0)
    assert [why for _, why in report.measured] == [f"measured: epicute {ours:.4g} ms, Inductor {theirs:.4g} ms"]
    assert timer.calls == 2  # each side once; the timer checks that their outputs agree
    want = _flex_reference(q, k, v, "alibi", True)
    assert ((out.double() - want).norm() / want.norm()).item() < TOL


def test_an_unmodified_transformers_model_runs_on_epicutes_attention(reference_layers):
    """An unmodified transformers Llama (GQA 2:1, 11 tokens) under the backend: whatever transformers hands SDPA
    while compiling (an explicit causal mask and repeated key/value heads in some versions, ``is_causal`` in
    others), each layer's attention is lifted, and the logits agree with the eager model's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=136, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, 96, (2, 11))
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend=AOT_EAGER, dynamic=False)(input_ids=ids).logits
        want = model.double()(input_ids=ids).logits
    attentions = [steps for _, steps in EC.last_report().lifted if steps[:1] == ("attention",)]
    assert len(attentions) == 2, EC.last_report()
    assert ((got.double() - want).norm() / want.norm()).item() < TOL
