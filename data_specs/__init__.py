"""One schema per table. Every module in this package registers its tables on import."""
import importlib
import pkgutil

from data_specs.base import (
    Column,
    SpecError,
    TableSpec,
    all_specs,
    get_spec,
    register,
    validate_name,
)

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name not in {"base", "stages"}:
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["Column", "SpecError", "TableSpec", "all_specs", "get_spec", "register", "validate_name"]
