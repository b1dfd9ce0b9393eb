"""The optional packages the training job needs: the ``train`` extra of the package."""
from __future__ import annotations

import importlib.util
from typing import List

__all__ = ["INSTALL_HINT", "TRAIN_MODULES", "missing_train_modules", "require_train_extras"]

TRAIN_MODULES = ("tqdm", "matplotlib")
"""The progress bar and the loss and timeline plots."""
INSTALL_HINT = 'pip install "tensorplay-hpc[train]"'


def missing_train_modules() -> List[str]:
    """The modules of the ``train`` extra that this environment lacks."""
    return [name for name in TRAIN_MODULES if importlib.util.find_spec(name) is None]


def require_train_extras() -> None:
    """Raise :class:`ImportError` naming the extra when the training job cannot run here."""
    missing = missing_train_modules()
    if missing:
        raise ImportError(f"tensorplay-hpc train needs {' and '.join(missing)}, the training "
                          f"job's progress bar and plots: {INSTALL_HINT} (or pip install "
                          f"{' '.join(missing)})")
