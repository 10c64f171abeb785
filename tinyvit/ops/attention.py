"""PLACEHOLDER: being written."""
def multi_head_attention(*args, **kwargs):
    raise NotImplementedError('multi_head_attention is being written')

