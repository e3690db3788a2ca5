"""Integrations of flashtile with other libraries.

- :mod:`flashtile.integrations.transformers`: ``attn_implementation="flashtile"`` for Hugging Face
  transformers models (``register()`` once, then load the model as usual).

Each integration imports its library only when used, so ``import flashtile`` never needs them.
"""
