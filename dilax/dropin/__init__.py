"""Drop-ins for the attention functions of jax and Flax, with dilation as an option.

- :mod:`dilax.dropin.dot_product`: :func:`dot_product_attention`, the arguments and results of
  ``jax.nn.dot_product_attention``.
- :mod:`dilax.dropin.attention_fn`: :func:`attention_fn`, an ``attention_fn`` for
  ``flax.nnx.MultiHeadAttention``.
"""
