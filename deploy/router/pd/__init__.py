"""PD orchestration: the attempt loop, the two legs, the bootstrap fields, the relay of decode's
stream, input logprobs.
"""
