"""The data path: moving KV bytes and the exchanges between prefill and decode workers.

``transport`` is the seam to the byte mover (``mooncake`` is the real one); ``wire`` and
``side_channel`` carry the messages; ``sender`` (prefill) and ``receiver`` (decode) run the
transfers that ``orders`` describe, planned by ``core``. Nothing here imports ``connector``.
"""
