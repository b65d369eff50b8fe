"""The on-disk compile cache: where entries live, how they are keyed and written, and the
``freezeframe cache`` command. The compile path (:mod:`freezeframe.compilation`) decides when to
load and when to save."""
