"""The on-disk compile cache: where entries live, how they are keyed and written, and how they
are listed and cleared (``freezeframe cache``, in :mod:`freezeframe.cli.cache`, shows them). The
compile path (:mod:`freezeframe.compilation`) decides when to load and when to save."""
