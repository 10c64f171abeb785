"""Primitive differentiable Functions, grouped by topic.

basic       arithmetic, reductions, shape ops, matmul, linear
activation  gelu (exact erf and tanh), softmax, log_softmax
norm        layer_norm, group_norm, weight standardization
attention   multi_head_attention (Eq. 5-8 of appendix A)
patch       patch_embed (Eq. 1)
conv        conv2d (im2col), max_pool2d
loss        cross_entropy, mse
regularize  dropout, drop_path
"""
