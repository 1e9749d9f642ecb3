"""The root of a clone of fxshard; the package itself is the folder fxshard/ below.

Python searches a script's own folder first (the current folder for ``python -c`` and
``python -m``). A script run from the folder that holds a clone named ``fxshard`` therefore
imports this folder as ``fxshard``. Without this file it would be an empty namespace package
that shadows the real one, installed or not (``pip install -e .``'s import hook is asked
only after that search): ``module 'fxshard' has no attribute 'compile'``. This file loads the
real package in its place, so the script runs as from anywhere else
(tests/test_imports.py). Under any other name the folder is not imported and this does nothing.
"""

import importlib.util
import os
import sys

if __name__ == "fxshard":
    _package = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fxshard")
    _spec = importlib.util.spec_from_file_location(
        __name__, os.path.join(_package, "__init__.py"), submodule_search_locations=[_package])
    if _spec is None or _spec.loader is None:
        raise ImportError(f"fxshard: no package in {_package}")
    _module = importlib.util.module_from_spec(_spec)
    # The import statement returns what sys.modules holds once this file has run.
    sys.modules[__name__] = _module
    _spec.loader.exec_module(_module)
