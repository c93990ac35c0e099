"""tokenyard: a self-hosted LLM API platform."""

__version__ = "0.1.0"
