"""LoopServe: adaptive vertical/slash prefill lines (prefill.py, Algorithm 5 of the paper) and
progressive decode selection (decode.py, Algorithm 6)."""
