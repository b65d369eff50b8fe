"""Front doors for models written for other libraries.

* :mod:`freezeframe.integrations.hf` (also ``ff.hf``) - Hugging Face transformers causal LMs,
  unmodified: ``ff.hf.compile(model, ...)``. Needs the ``hf`` extra
  (``pip install 'freezeframe[hf]'``).

Nothing here is imported by ``import freezeframe``; each integration imports its library when
it is first used.
"""
