"""Import the kernel modules of an older commit, written into a folder by bench/old_kernels.sh, as
the package ``base_kernels`` (so they import each other from that folder, never the installed ones).

    import old_kernels
    base = old_kernels.load(args.base)        # base.gemm, base.attention, base.logprobs, ...
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

DEFAULT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".old_kernels")
PACKAGE = "base_kernels"
MODULES = ("gemm", "attention", "logprobs", "rows")


def add_argument(parser) -> None:
    parser.add_argument("--base", default=DEFAULT_DIR,
                        help="folder with the kernel modules to compare against, written by "
                             "`bash bench/old_kernels.sh [REF] [DIR]` (default: %(default)s)")


def load(base: str = DEFAULT_DIR) -> ModuleType:
    """The package in ``base`` with its GEMM, attention, logprobs and rows modules imported as attributes."""
    init = os.path.join(base, "__init__.py")
    if not os.path.isfile(init):
        raise SystemExit(f"no old kernels in {base}: run `bash bench/old_kernels.sh [REF] {base}` on a "
                         "machine with the git history (and carry the folder to the GPU machine)")
    if PACKAGE in sys.modules:
        loaded = os.path.dirname(sys.modules[PACKAGE].__file__)
        if os.path.realpath(loaded) != os.path.realpath(base):
            raise RuntimeError(f"old kernels already imported from {loaded}, asked for {base}")
        return sys.modules[PACKAGE]
    spec = importlib.util.spec_from_file_location(PACKAGE, init, submodule_search_locations=[base])
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    spec.loader.exec_module(package)
    for name in MODULES:
        setattr(package, name, importlib.import_module(f"{PACKAGE}.{name}"))
    return package
