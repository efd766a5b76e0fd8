"""Lossless verification of draft blocks by chain rejection sampling."""
from dspark_serve.verify.rejection import rejection_sample

__all__ = ["rejection_sample"]
