"""Runtime: argument validation, compiling and caching kernels, launching them."""
