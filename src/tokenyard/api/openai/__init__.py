"""The OpenAI dialect: schemas, conversions, stream and routes."""
