"""Kernel sources and registries (package data): KERNEL_FAMILIES.toml, FUSIONS.toml, <hw>/."""
