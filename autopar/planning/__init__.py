"""autopar.planning: choosing a plan with the cost model.

``search`` enumerates and ranks every plan for a model and cluster, offline and without
torch; ``autoplan`` serves ``parallelize(plan="auto")`` for the current world.
"""
