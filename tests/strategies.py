"""The project's Hypothesis strategies: the public ones from ``metrale.testing``, in one place."""

from metrale.testing import (  # noqa: F401 - re-exported for the test modules
    boxes,
    composable_chains,
    diagrams,
    diagrams_over,
    tensor_products,
    tensor_types,
    tys,
)
