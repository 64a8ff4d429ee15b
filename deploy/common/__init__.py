"""What every component shares: the contract (names, ports, exit codes), child processes, OpenAI-shaped
errors, HTTP connection limits, argparse types.
"""
