"""metrale.lkb: the category toolkit and the Latent Kernel Blueprint.

Types and diagrams (``Ty``, ``Box``, ``Diagram``), functors, product and coproduct categories,
targets, dtypes and the presentation of kernel families and fusion relations. This layer
imports nothing of the others.
"""
