"""The attention kernel family (FlashAttention-3 style forward).

- :mod:`~epicute.attention.api`: the public ``attention`` and ``explain_attention``, the hooks;
- :mod:`~epicute.attention.validate`: q, k, v (and out) checked;
- :mod:`~epicute.attention.plan`: problem, config, shared memory, plan and its report;
- :mod:`~epicute.attention.launch`: variants, compile and launch;
- :mod:`~epicute.attention.kernel_sm90`: the CuTe-DSL kernel for Hopper.

The public function ``epicute.attention`` shares this package's name: import from the
modules (``from epicute.attention.plan import plan_attention``).
"""
