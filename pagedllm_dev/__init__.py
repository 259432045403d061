"""Development code beside the ``pagedllm`` package, in the source checkout
only (not installed with it): tools that check the engine from outside, as a
user runs it.

- ``differential``: features against their oracles on real text
  (``python -m pagedllm_dev.differential --help``).
"""
