"""Kernels written in the CuTe DSL and the pipeline pieces they share."""
