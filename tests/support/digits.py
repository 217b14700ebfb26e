"""The examples' digits split (examples/digits_data.py: cached on disk, no scikit-learn import
once cached), for tests that train in this process."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from support.paths import EXAMPLES


def _digits_data() -> ModuleType:
    spec = importlib.util.spec_from_file_location("digits_data", EXAMPLES / "digits_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


digits_split = _digits_data().digits_split
