"""The sglang adapter: render a topology into sglang's command (`render`), fit it to the installed
sglang (`compat`), check it with sglang's own resolver (`check`).
"""
