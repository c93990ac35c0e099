"""The embeddings replica (torch): a BERT sentence encoder, its dynamic batcher and its
HTTP server. The wire format is `tokenyard.wire.embeddings`."""
