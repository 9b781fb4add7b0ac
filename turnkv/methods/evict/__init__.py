"""The eviction axis: scorers rank the tokens of a layer, allocators split its budget among heads, and
the Eviction driver (eviction.py) compacts what stays. Its turn policies are in turnkv.methods.turns."""
