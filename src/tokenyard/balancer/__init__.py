"""Stage 12: choosing an engine replica and talking to it over HTTP (never imports torch)."""
