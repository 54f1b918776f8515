"""Targets: named and detected GPUs, and compile keys that hold the arch but no SM count.

A target changes plans (configs, persistent grids, rooflines), never the code of
one configuration: the persistent CTA count is a launch argument, so one
ahead-of-time cache serves every Hopper part (issue 19, item 5).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import epicute
import epicute.attention.launch  # registers the attention family
from epicute.attention.aot import attention_variants
from epicute.attention.plan import AttentionProblem, plan_attention, render_attention_plan
from epicute.errors import ConfigError
from epicute.gemm import GemmConfig, GemmProblem, plan_gemm, render_plan
from epicute.gemm.aot import gemm_request, gemm_variants
from epicute.gemm.compile import GEMM_CACHE, GemmVariant, compile_gemm
from epicute.gemm.prepare import GemmRequest, prepare
from epicute.runtime.aot import compile_spec
from epicute.runtime.compile import FAMILIES
from epicute.runtime.target import H100_SXM, TARGETS, Target, current_target, resolve_target, target_from_device
from epicute.sm90.tile_grid import launched

BIG = GemmProblem(8192, 8192, 8192)
#: Pins under which every target plans one config (the planner would otherwise choose by SM count).
PINS = (("cluster_m", 2), ("persistent", True), ("schedule", "cooperative"), ("tile_n", 256))


# ------------------------------------------------------------------- the targets
def test_named_targets_and_their_figures():
    assert list(TARGETS) == ["h100-sxm", "h100-pcie", "h200", "h20"]
    figures = {name: (t.num_sms, t.peak_tflops_16bit, t.hbm_tb_per_s, t.l2_bytes >> 20) for name, t in TARGETS.items()}
    assert figures == {
        "h100-sxm": (132, 989.0, 3.35, 50), "h100-pcie": (114, 756.0, 2.0, 50),
        "h200": (132, 989.0, 4.8, 50), "h20": (78, 148.0, 4.0, 60),
    }  # fmt: skip
    assert H100_SXM is TARGETS["h100-sxm"] and H100_SXM.peak_tflops_fp8 == 1979.0
    assert all(t.arch == "sm_90a" and t.smem_per_cta_bytes == 227 * 1024 and not t.detected for t in TARGETS.values())
    assert H100_SXM.peak_tflops("fp8e4m3") == 1979.0 and H100_SXM.peak_tflops("bf16") == 989.0


def test_resolve_target_takes_names_targets_and_none():
    assert resolve_target("h100-pcie") is TARGETS["h100-pcie"]
    assert resolve_target(" H20 ") is TARGETS["h20"]
    custom = replace(H100_SXM, num_sms=66)
    assert resolve_target(custom) is custom
    assert resolve_target(None) == current_target()


@pytest.mark.parametrize("bad", ["h100", "sm_90a", "", 132])
def test_a_bad_target_name_is_a_config_error_listing_the_known_ones(bad):
    with pytest.raises(ConfigError, match="known targets are h100-sxm, h100-pcie, h200, h20"):
        resolve_target(bad)


@pytest.mark.parametrize(
    "device, sms, name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 132, "h100-sxm", 989.0),
        ("NVIDIA H100 PCIe", 114, "h100-pcie", 756.0),
        ("NVIDIA H200", 132, "h200", 989.0),
        ("NVIDIA H20", 78, "h20", 148.0),
        ("NVIDIA GH200 480GB", 132, "hopper", 989.0),  # unmatched: H100 SXM's peaks per SM
        ("NVIDIA H800", 66, "hopper", 989.0 / 2),
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 60, "h100-sxm", 989.0 * 60 / 132),  # a slice: its share
    ],
)
def test_a_detected_gpu_gets_its_own_counts_and_its_parts_peaks(device, sms, name, tflops):
    t = target_from_device(device, sms, 232448, 50 * 2**20)
    assert (t.name, t.device, t.num_sms, t.detected, t.arch) == (name, device, sms, True, "sm_90a")
    assert t.peak_tflops_16bit == pytest.approx(tflops) and t.peak_tflops_fp8 == pytest.approx(2 * tflops, rel=1e-3)
    assert t.hbm_tb_per_s == TARGETS.get(name, H100_SXM).hbm_tb_per_s
    assert "read from the GPU" in t.describe()


# ------------------------------------------------------------- keys hold no SM count
def _gemm_prepared(target, pins=PINS, **request):
    return prepare(GemmRequest(BIG, overrides=pins, target=resolve_target(target), **request))


@pytest.mark.parametrize("other", ["h100-pcie", "h20", replace(H100_SXM, num_sms=114)])
def test_gemm_keys_of_targets_that_differ_in_sm_count_are_equal(other):
    sxm, pcie = _gemm_prepared("h100-sxm"), _gemm_prepared(other)
    assert sxm.plan.config == pcie.plan.config  # pinned: one config on both
    assert sxm.plan.max_active_clusters != pcie.plan.max_active_clusters
    assert sxm.plan.grid != pcie.plan.grid
    assert sxm.variant() == pcie.variant()
    assert sxm.variant().key() == pcie.variant().key() and sxm.variant().key().digest == pcie.variant().key().digest


def test_fused_gemm_keys_of_two_targets_are_equal():
    def variant(target):
        request = gemm_request(
            BIG, "epicute.epilogue.library:row_col_quant", {"scale_m": "col:fp32", "scale_n": "row:bf16"}, False, {},
            dict(PINS), resolve_target(target),
        )  # fmt: skip
        return prepare(request)

    sxm, pcie = variant("h100-sxm"), variant("h100-pcie")
    assert sxm.plan.grid == (2, 1, 66) and pcie.plan.grid == (2, 1, 57)
    assert sxm.variant().key() == pcie.variant().key()


def test_the_variant_carries_the_targets_arch_and_unknown_archs_have_no_kernel():
    sm100 = replace(H100_SXM, name="future", arch="sm_100a")
    variant = _gemm_prepared(sm100).variant()
    assert variant.arch == "sm_100a" and variant.key() != _gemm_prepared("h100-sxm").variant().key()
    with pytest.raises(ConfigError, match="no gemm kernel for sm_100a: epicute's gemm kernels are for sm_90a"):
        compile_gemm(variant)
    assert set(FAMILIES) >= {"gemm", "attention"}
    assert all(set(family.compilers) == {"sm_90a"} for family in FAMILIES.values())


def test_a_family_compiles_each_arch_with_its_own_function(monkeypatch):
    built = []
    monkeypatch.setitem(GEMM_CACHE.compilers, "sm_100a", lambda v: built.append(v) or "sm100 kernel")
    variant = GemmVariant(GemmConfig(), "bf16", "bf16", "k", "n", arch="sm_100a")
    assert GEMM_CACHE.compile(variant) == "sm100 kernel" and built == [variant]


def test_spec_variants_planned_for_two_targets_share_their_keys():
    entry = {"shapes": [[8192, 8192, 8192], [1, 4096, 4096]], "config": dict(PINS)}
    keys = {name: [v.key() for v, _ in gemm_variants(entry, TARGETS[name])] for name in TARGETS}
    assert len({tuple(k) for k in keys.values()}) == 1
    # Unpinned, a target may plan other configs (the planner reads its SM count), never other keys for one config.
    for name in TARGETS:
        for variant, _ in gemm_variants({"shapes": [[8192, 8192, 8192]]}, TARGETS[name]):
            assert variant.key() == GemmVariant(variant.config, "bf16", "bf16", "k", "n", batched=False).key()


def test_attention_keys_of_two_targets_are_equal_and_grids_differ():
    entry = {"head_dim": [64, 128], "causal": [False, True], "config": {"persistent": True}}
    sxm = [v.key() for v, _ in attention_variants(entry, TARGETS["h100-sxm"])]
    for name in ("h100-pcie", "h20"):
        assert [v.key() for v, _ in attention_variants(entry, TARGETS[name])] == sxm
    problem = AttentionProblem(4, 8192, 8192, 16, 16, 128)
    grids = {name: plan_attention(problem, name, persistent=True).grid for name in ("h100-sxm", "h100-pcie", "h20")}
    assert grids == {"h100-sxm": (132, 1, 1), "h100-pcie": (114, 1, 1), "h20": (78, 1, 1)}
    plan = plan_attention(problem, "h100-pcie", persistent=True)
    assert plan.max_ctas == 114 and plan.grid[0] == min(plan.num_tiles, plan.max_ctas)


def test_compile_spec_dry_run_for_a_named_target(tmp_path):
    spec = tmp_path / "k.toml"
    spec.write_text(
        "[[gemm]]\nshapes = [[4096, 4096, 4096]]\nconfig = { tile_n = 128, cluster_m = 1, persistent = true }\n"
        "[[attention]]\nhead_dim = 128\n"
    )
    digests = {name: [r.digest for r in compile_spec(spec, dry_run=True, target=name)] for name in TARGETS}
    assert len({tuple(d) for d in digests.values()}) == 1
    with pytest.raises(ConfigError, match="unknown target 'b200'"):
        compile_spec(spec, dry_run=True, target="b200")


# ------------------------------------------------------------- one grid formula
@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("target", ["h100-sxm", "h100-pcie", "h20"])
def test_the_plans_grid_is_the_kernels_formula_on_the_launch_argument(target, persistent):
    for problem in (BIG, GemmProblem(1000, 4104, 136, 3), GemmProblem(1, 8, 8)):
        plan = plan_gemm(problem, target, cluster_m=2, persistent=persistent, tile_n=128)
        c = plan.config
        tiles_m, tiles_n = -(-problem.m // c.tile_m), -(-problem.n // c.tile_n)
        total = -(-tiles_m // c.cluster_m) * -(-tiles_n // c.cluster_n) * problem.l
        assert plan.max_active_clusters == TARGETS[target].num_sms // c.cluster_size
        assert plan.grid == (c.cluster_m, c.cluster_n, launched(total, plan.max_active_clusters, persistent))
        assert plan.grid[2] == (min(total, plan.max_active_clusters) if persistent else total)


# ------------------------------------------------------------------ explain
def test_explain_shows_each_targets_grid_and_roofline():
    a = torch.empty(8192, 8192, dtype=torch.bfloat16, device="meta")
    pins = {"tile_n": 256, "cluster_m": 2, "persistent": True}
    texts = {}
    for name in ("h100-sxm", "h100-pcie", "h20"):
        plan = epicute.explain(a, a, config=pins, target=name, file=None)
        assert plan.target is TARGETS[name]
        texts[name] = render_plan(plan)
    assert "grid            (2, 1, 66)" in texts["h100-sxm"] and "grid            (2, 1, 57)" in texts["h100-pcie"]
    assert "grid            (2, 1, 39)" in texts["h20"]
    for name, peak, tbs in (("h100-sxm", 989, "3.35"), ("h100-pcie", 756, "2.00"), ("h20", 148, "4.00")):
        text = texts[name]
        assert f"target          {name} " in text and f"{TARGETS[name].num_sms} SMs" in text
        assert f"at {peak} TFLOP/s" in text and f"at {tbs} TB/s" in text
    predicted = {name: text.split("predicted", 1)[1].split(" us", 1)[0] for name, text in texts.items()}
    assert len(set(predicted.values())) == 3
    with pytest.raises(ConfigError, match="known targets"):
        epicute.explain(a, a, target="a100", file=None)


def test_explain_attention_shows_each_targets_grid_and_roofline():
    q = torch.empty(4, 8192, 16, 128, dtype=torch.bfloat16, device="meta")
    texts = {}
    for name in ("h100-sxm", "h20"):
        plan = epicute.explain_attention(q, q, q, config={"persistent": True}, target=name, file=None)
        texts[name] = render_attention_plan(plan)
        assert plan.grid == (TARGETS[name].num_sms, 1, 1)
    assert "grid            (132, 1, 1)" in texts["h100-sxm"] and "grid            (78, 1, 1)" in texts["h20"]
    assert "at 989 TFLOP/s" in texts["h100-sxm"] and "at 148 TFLOP/s" in texts["h20"]
    assert "roofline" in texts["h20"] and "78 SMs" in texts["h20"]
    with pytest.raises(ConfigError, match="known targets"):
        epicute.explain_attention(q, q, q, target="h300", file=None)


def test_current_target_is_a_target():
    assert isinstance(current_target(), Target)
