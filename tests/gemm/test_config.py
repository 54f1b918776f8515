"""GemmConfig.validate() and GemmProblem: what is accepted, what is rejected and why."""

from __future__ import annotations

import pytest

from epicute import ConfigError
from epicute.gemm import GemmConfig, GemmProblem


def _field_id(fields: dict) -> str:
    """A test id like ``tile_n=96`` from a case's field dict."""
    return ",".join(f"{k}={v}" for k, v in fields.items())


def test_default_config_is_valid():
    GemmConfig().validate()


@pytest.mark.parametrize(
    "fields",
    [
        {"tile_n": 128, "ab_stages": 6, "epi_tile": (128, 64)},
        {"tile_n": 64, "cluster_m": 2, "persistent": False, "epi_tile": (128, 16), "num_epi_stages": 1},
        {"cluster_n": 2, "persistent": False, "epi_reuses_ab_smem": True},
        {"epi_tile": (128, 256), "producer_regs": 24, "consumer_regs": 240, "swizzle": 1},
        {"schedule": "pingpong", "tile_n": 128, "epi_tile": (64, 32)},
        {"schedule": "pingpong", "tile_n": 192, "epi_tile": (64, 64), "cluster_m": 2},
        {"schedule": "pingpong", "tile_m": 64, "tile_n": 256, "epi_tile": (64, 32)},
        {"tile_n": 192, "epi_tile": (128, 32)},
    ],
    ids=_field_id,
)
def test_other_valid_configs(fields):
    GemmConfig(**fields).validate()


BAD_CONFIGS = [
    ({"tile_m": 64}, r"tile_m=64"),
    ({"tile_m": 192}, r"tile_m=192: the cooperative schedule splits a 128- or 256-row tile"),
    ({"tile_m": 256}, r"tile 256x256 .* needs 256 accumulator registers per thread .*; use a smaller tile$"),
    ({"tile_n": 96}, r"tile_n=96"),
    ({"tile_k": 32}, r"tile_k=32"),
    ({"cluster_m": 2, "cluster_n": 2}, r"cluster 2x2"),
    ({"cluster_m": 3}, r"cluster_m=3"),
    ({"cluster_n": 4}, r"cluster_n=4"),
    ({"ab_stages": 1}, r"ab_stages=1"),
    ({"num_epi_stages": 0}, r"num_epi_stages=0"),
    ({"tile_n": 128, "epi_tile": (128, 48)}, r"epi_tile=\(128, 48\).*divides tile_n=128"),
    ({"epi_tile": (128, 8)}, r"epi_tile=\(128, 8\).*multiple of 16"),
    ({"epi_tile": (64, 32)}, r"epi_tile=\(64, 32\).*M must be 128 with schedule='cooperative'"),
    ({"schedule": "pingpong", "tile_n": 128}, r"epi_tile=\(128, 32\).*M must be 64 with schedule='pingpong'"),
    ({"epi_reuses_ab_smem": True, "persistent": True}, r"epi_reuses_ab_smem=True needs persistent=False"),
    ({"producer_regs": 44}, r"producer_regs=44: register budgets must be multiples of 8"),
    ({"consumer_regs": 228}, r"consumer_regs=228: register budgets must be multiples of 8"),
    ({"producer_regs": 16}, r"producer_regs=16: .*in \[24, 256\]"),
    ({"consumer_regs": 264}, r"consumer_regs=264: .*in \[24, 256\]"),
    ({"producer_regs": 56, "consumer_regs": 240}, r"need 68608 registers; an SM has 65536"),
    ({"swizzle": 0}, r"swizzle=0"),
    ({"schedule": "pingpong"}, r"tile 128x256 with schedule='pingpong' needs 256 accumulator registers"),
    ({"schedule": "pingpong", "tile_n": 128, "epi_tile": (64, 32), "persistent": False}, r"needs persistent=True"),
    ({"schedule": "pingpong", "tile_m": 192, "tile_n": 64, "epi_tile": (64, 32)}, r"tile_m=192"),
    ({"schedule": "stream-k"}, r"schedule='stream-k': must be one of"),
]


@pytest.mark.parametrize(("fields", "match"), BAD_CONFIGS, ids=[_field_id(f) for f, _ in BAD_CONFIGS])
def test_invalid_config_names_the_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        GemmConfig(**fields).validate()


def test_config_derived_counts():
    cfg = GemmConfig(tile_n=256, epi_tile=(128, 32), cluster_m=2)
    assert cfg.num_mma_warpgroups == 2
    assert cfg.num_threads == 384
    assert cfg.num_mma_threads == 256
    assert cfg.cluster_size == 2
    assert cfg.num_epi_subtiles == 8
    assert (cfg.tile_warpgroups, cfg.num_teams, cfg.acc_regs) == (2, 1, 128)
    pingpong = GemmConfig(schedule="pingpong", tile_n=128, epi_tile=(64, 32))
    assert (pingpong.tile_warpgroups, pingpong.num_teams, pingpong.acc_regs) == (1, 2, 128)
    assert pingpong.num_threads == 384 and pingpong.num_epi_subtiles == 8


def test_config_key_and_equality_ignore_reasons():
    with_reasons = GemmConfig(reasons=("because",))
    assert with_reasons == GemmConfig()
    assert hash(with_reasons) == hash(GemmConfig())
    assert with_reasons.key() == GemmConfig().key()
    assert GemmConfig(ab_stages=5).key() != GemmConfig().key()


BAD_PROBLEMS = [
    ({"ab_dtype": "fp32"}, r"ab_dtype='fp32'"),
    ({"ab_dtype": "bfloat16"}, r"ab_dtype='bfloat16'"),
    ({"d_dtype": "int8"}, r"d_dtype='int8'"),
    ({"a_major": "n"}, r"a_major='n'"),
    ({"b_major": "m"}, r"b_major='m'"),
    ({"k": -1}, r"k=-1 must be >= 0"),
]


@pytest.mark.parametrize(("fields", "match"), BAD_PROBLEMS, ids=[_field_id(f) for f, _ in BAD_PROBLEMS])
def test_invalid_problem_names_the_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        GemmProblem(**{"m": 16, "n": 16, "k": 16, **fields})


def test_problem_flops_and_min_bytes_by_hand():
    problem = GemmProblem(m=2, n=3, k=4, l=5, ab_dtype="fp16", d_dtype="fp32")
    assert problem.flops == 2 * 2 * 3 * 4 * 5  # 240
    # per batch: A 2*4 + B 4*3 fp16 elements = 40 B, D 2*3 fp32 = 24 B
    assert problem.min_bytes == 5 * (40 + 24)


def test_problem_is_hashable_and_accepts_all_majors():
    problems = {GemmProblem(8, 8, 8, a_major=a, b_major=b) for a in ("k", "m") for b in ("n", "k")}
    assert len(problems) == 4
