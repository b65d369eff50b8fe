"""Micro-batching: a step split into token slices that run in threads, so one slice's
communication overlaps another's compute.

``slicing`` plans where a step is cut (and slices its attention metadata); ``schedule`` is the
turn-taking the threads run by (the baton, the two streams, the yield points); ``threads`` runs
one step's slices on threads and joins them; ``overlap`` decides how a step runs and captures a
FULL graph across its threads. The yield points a model calls are public as
:mod:`freezeframe.ubatch`.
"""
