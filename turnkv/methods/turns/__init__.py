"""The turn policies of the eviction axis: which positions each compression of a multi-turn
conversation may touch, and how many tokens it keeps."""
