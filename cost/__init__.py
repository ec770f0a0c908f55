"""autopar.cost: the symbolic cost model (placeholder docstring, rewritten below)."""
from .comm import CommRow
from .estimate import Cost, Term, estimate
from .hardware import Cluster
from .spec import ModelSpec

__all__ = ["ModelSpec", "Cluster", "Cost", "CommRow", "Term", "estimate"]
