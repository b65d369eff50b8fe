"""Micro-batching: a step split into token slices that run in threads, so one slice's
communication overlaps another's compute.

``slicing`` plans where a step is cut (and slices its attention metadata); ``overlap`` runs the
slices (threads, the turn-taking schedule, the two streams) and captures a FULL graph across
them. The yield points a model calls are public as :mod:`freezeframe.ubatch`.
"""
