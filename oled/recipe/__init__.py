"""Recipes: TOML files that declare a model, a budget, policies, decoding, a workload and a study.

`schema` holds the sections and every default; `load` reads, overrides and validates a file
(and turns a command's flags into the same spec); `locate` words an error as one line with the
file, the line and the key; `toml` reads TOML, finds the line of each key and writes recipes.
"""

from oled.model.config import BUILTIN
from oled.offload.budget import parse_size
from oled.recipe.load import (
    Flags,
    RecipeError,
    apply_overrides,
    command_recipe,
    component_model,
    load_recipe,
    override,
    parse_value,
    shipped_recipe,
    shipped_recipes,
    validate,
)
from oled.recipe.schema import (
    DEFAULT_MODEL,
    TRACE,
    BudgetSection,
    Component,
    DecodingSection,
    Recipe,
    RuntimeSection,
    SearchSpace,
    beside,
    routing_trace,
)
from oled.recipe.toml import dump_toml, key_lines, tomllib

__all__ = [
    "BUILTIN",
    "DEFAULT_MODEL",
    "TRACE",
    "BudgetSection",
    "Component",
    "DecodingSection",
    "Flags",
    "Recipe",
    "RecipeError",
    "RuntimeSection",
    "SearchSpace",
    "apply_overrides",
    "beside",
    "command_recipe",
    "component_model",
    "dump_toml",
    "key_lines",
    "load_recipe",
    "override",
    "parse_size",
    "parse_value",
    "routing_trace",
    "shipped_recipe",
    "shipped_recipes",
    "tomllib",
    "validate",
]
