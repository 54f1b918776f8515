"""Every kernel family epicute has, each declared once (a :class:`~epicute.runtime.family.FamilySpec`).

The runtime derives from this list, and from nothing else, which families there are
(``runtime.compile.FAMILIES``), the tables ``epicute compile`` takes (``runtime.aot.JOB_KINDS``),
the torch ops ``import epicute`` defines (``runtime.torch_ops.define_ops``) and the disk cache's
fingerprint of the kernel sources: the shared modules below, then every family's ``codegen``.
A family's ``codegen`` is its kernels, what they read while traced (configs, shared-memory
layouts, key ranges) and its compile functions; it may repeat a shared or another family's module
(the grouped kernel subclasses the GEMM's). ``tests/runtime/test_families.py`` fails when a module
that imports the CuTe DSL, or that a kernel module imports, is in no fingerprint: a stale kernel
gives wrong results silently, a needless recompile costs seconds.

Functions are ``"module:attribute"`` text, imported on first use: this module imports no family.
"""

from __future__ import annotations

from epicute.runtime.family import FamilySpec
from epicute.runtime.target import SM90A

#: Sources every kernel's code is generated from: the Hopper toolkit, the epilogue language (its op table
#: holds the emitters), the DSL compile options, and these declarations.
SHARED_CODEGEN = ("epicute.sm90", "epicute.epilogue", "epicute.runtime.compile", "epicute.families")

_GEMM_CODEGEN = ("epicute.gemm.kernel_sm90", "epicute.gemm.compile", "epicute.gemm.config", "epicute.gemm.smem")
#: The forward's fake tensors (``_fake_bshd``...), which every attention compile function builds its arguments from.
_ATTENTION_LAUNCH = "epicute.attention.launch"
#: The causal mask and the softmax, which every attention kernel reads.
_ATTENTION_SHARED = ("epicute.attention.mask", "epicute.attention.softmax")
_BACKWARD_CODEGEN = (
    "epicute.attention.backward_sm90", "epicute.attention.backward_plan", "epicute.attention.key_blocks",
    "epicute.attention.backward", _ATTENTION_LAUNCH, *_ATTENTION_SHARED,
)  # fmt: skip

DECLARATIONS: tuple[FamilySpec, ...] = (
    FamilySpec(
        "gemm",
        compilers={SM90A: "epicute.gemm.compile:compile_gemm_sm90"},
        codegen=_GEMM_CODEGEN,
        aot="epicute.gemm.aot:gemm_variants",
        torch_op="epicute.gemm.torch_op:GEMM_OP",
    ),
    FamilySpec(
        "grouped_gemm",
        compilers={SM90A: "epicute.grouped.compile:compile_grouped_sm90"},
        codegen=("epicute.grouped.kernel_sm90", "epicute.grouped.compile", *_GEMM_CODEGEN),
        aot="epicute.grouped.aot:grouped_variants",
        torch_op="epicute.grouped.torch_op:GROUPED_GEMM_OP",
    ),
    FamilySpec(
        "attention",
        compilers={SM90A: "epicute.attention.launch:compile_attention"},
        codegen=(
            "epicute.attention.kernel_sm90",
            "epicute.attention.plan",
            "epicute.attention.key_blocks",
            "epicute.attention.fp8",  # fp8's value slot order and stored O dtype
            _ATTENTION_LAUNCH,
            *_ATTENTION_SHARED,
        ),
        aot="epicute.attention.aot:attention_variants",
        torch_op="epicute.attention.torch_op:ATTENTION_OP",
    ),
    # Split-KV's combine kernel, launched by the forward after a split variant.
    FamilySpec(
        "attention_combine",
        compilers={SM90A: "epicute.attention.launch:compile_combine"},
        codegen=("epicute.attention.combine_sm90", _ATTENTION_LAUNCH, *_ATTENTION_SHARED),
    ),
    # fp8 attention's value pass (V keys-contiguous in slot order), launched by the forward before an fp8 variant.
    FamilySpec(
        "attention_value_layout",
        compilers={SM90A: "epicute.attention.launch:compile_value_layout"},
        codegen=("epicute.attention.value_layout_sm90", "epicute.attention.fp8", _ATTENTION_LAUNCH,
                 "epicute.attention.key_blocks"),
    ),
    # The backward's main kernel; its torch op runs the preprocess and postprocess around it.
    FamilySpec(
        "attention_backward",
        compilers={SM90A: "epicute.attention.backward:compile_backward"},
        codegen=_BACKWARD_CODEGEN,
        torch_op="epicute.attention.torch_op:ATTENTION_BACKWARD_OP",
    ),
    FamilySpec(
        "attention_backward_preprocess",
        compilers={SM90A: "epicute.attention.backward:compile_preprocess"},
        codegen=("epicute.attention.backward_prep_sm90", *_BACKWARD_CODEGEN),
    ),
    FamilySpec(
        "attention_backward_postprocess",
        compilers={SM90A: "epicute.attention.backward:compile_postprocess"},
        codegen=("epicute.attention.backward_prep_sm90", *_BACKWARD_CODEGEN),
    ),
    # The standalone group quantizer (epicute.quantize): a model's first input, what no GEMM epilogue produces.
    FamilySpec(
        "quantize",
        compilers={SM90A: "epicute.quantize.launch:compile_quantize"},
        codegen=("epicute.quantize.kernel_sm90", "epicute.quantize.launch"),
        torch_op="epicute.quantize.torch_op:QUANTIZE_OP",  # the tile quantizer's calls too
    ),
    # The tile quantizer: rows and columns (transposed) of an fp8 GEMM's operand from one read (fp8 training).
    FamilySpec(
        "quantize_tiles",
        compilers={SM90A: "epicute.quantize.launch:compile_tile_quantize"},
        codegen=("epicute.quantize.tile_sm90", "epicute.quantize.kernel_sm90", "epicute.quantize.launch"),
    ),
)

__all__ = ["DECLARATIONS", "SHARED_CODEGEN"]
