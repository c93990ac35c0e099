"""Speculative decoding: drafts proposed by n-gram lookup (ngram.py) or a draft model
(draft.py), verified by the target model in one step (verify.py, speculator.py)."""
