"""The OpenAI Responses API: POST /v1/responses and its stored responses."""
