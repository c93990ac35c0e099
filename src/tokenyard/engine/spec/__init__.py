"""Speculative decoding: drafts proposed without a second model (n-gram prompt lookup),
verified by the target model in one step. See ngram.py and verify.py."""
