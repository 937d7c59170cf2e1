"""Metrale: a category-theory-first compiler framework for the kernel plans of LLM inference."""

__version__ = "0.1.0"
