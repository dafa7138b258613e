"""A plugin whose import fails, as one with a missing vendor library does."""

raise ImportError("libdummy_runtime.so: cannot open shared object file")
