"""autopar.views: human-readable views of a compiled program.

``program`` prints one rank's generated program with every collective marked; ``schedule``
lays a pipeline schedule out as a step x rank grid.
"""
