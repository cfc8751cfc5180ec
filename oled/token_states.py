"""The decoder's state of each routed row after a forward, as the trace stores it and the policies
read it (int8 codes; device-free, so that every layer may import them)."""

TOKEN_FIXED = 0  # prompt / already decoded / pending prefix rows
TOKEN_MASKED = 1  # still masked after this iteration
TOKEN_COMMITTED = 2  # committed by this iteration
