"""The Anthropic dialect: schemas, conversions, stream and routes."""
