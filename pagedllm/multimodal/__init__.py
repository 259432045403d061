"""Images in the prompt: typed per-request inputs (``inputs``, torch-free), content
hashes (``hashing``) and preprocessing through the checkpoint's own Hugging Face
processor (``processing``). Importing the package loads nothing heavy: ``core/``
names ``inputs`` and must stay torch-free."""
