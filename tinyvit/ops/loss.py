"""PLACEHOLDER: being written."""
def cross_entropy(*args, **kwargs):
    raise NotImplementedError('cross_entropy is being written')

def mse(*args, **kwargs):
    raise NotImplementedError('mse is being written')

