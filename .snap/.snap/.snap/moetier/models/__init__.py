"""Model families, registered by their Hugging Face ``architectures`` names."""

import importlib
import pkgutil

from moetier.errors import CheckpointError
from moetier.models.base import MODEL_REGISTRY, CausalLM, register_model

_SUPPORT_MODULES = {"base", "cache", "layers"}


def _import_families() -> None:
    # Importing a family module registers it; every other module in this package is a family.
    import moetier.models as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in _SUPPORT_MODULES and not info.name.startswith("_"):
            importlib.import_module(f"moetier.models.{info.name}")


def model_class_for(architectures: list[str] | None) -> type[CausalLM]:
    """The family class for a config's ``architectures`` list, or a one-line CheckpointError."""
    _import_families()
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise CheckpointError(f"unsupported architecture {architectures}; moetier supports {sorted(MODEL_REGISTRY)}")


__all__ = ["CausalLM", "MODEL_REGISTRY", "model_class_for", "register_model"]
