"""What the compiler decided, for people: FusionReport, its tables and its pictures."""

from .tables import FusionReport

__all__ = ["FusionReport"]
