"""The zero-waste savings: the training pass that computes only what carries gradient (its row layer packs shared
prompts), generation that prefills each prompt once and drops finished rows, tool turns that continue the cache, image
inputs cut by row.
"""
