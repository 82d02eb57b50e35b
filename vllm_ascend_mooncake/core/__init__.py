"""The planning core: which prefill ranks and heads a decode rank reads, which bytes, which fix-up.

Pure: no I/O, no threads, no vLLM or Mooncake. ``topology``, ``layout`` and ``plan`` import only
numpy and the package's ``options`` (to declare the keys they read); ``relayout`` runs the
planned fix-ups with torch on whatever device the KV cache lives. Nothing here imports
``datapath`` or ``connector``.
"""
