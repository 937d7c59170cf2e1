"""metrale.lkb: the category toolkit and the Latent Kernel Blueprint.

Types and diagrams (``Ty``, ``Box``, ``Diagram``), functors, small categories with products and
coproducts, targets, and dtypes. This layer imports nothing of the others.
"""

from .category import Arrow, Coproduct, Discrete, Poset, ProductCategory, Projection, Tagged
from .diagram import Box, Builder, Diagram, Wire
from .dtype import DType
from .errors import AxiomError, ConfigError, MetraleError
from .functor import Functor, compose
from .target import KernelTarget, target_category
from .ty import TensorType, Ty

__all__ = [
    "Arrow", "AxiomError", "Box", "Builder", "ConfigError", "Coproduct", "DType", "Diagram",
    "Discrete", "Functor", "KernelTarget", "MetraleError", "Poset", "ProductCategory",
    "Projection", "Tagged", "TensorType", "Ty", "Wire", "compose", "target_category",
]
