"""Long completions on one GPU: the MLP computed a slice of positions at a time (tiled MLP), the LM head's tile sized
from the vocabulary, activations offloaded to host memory.
"""
