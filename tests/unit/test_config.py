"""Settings read once: defaults < TOKENYARD_* environment < flags."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tokenyard.config import EngineConfig, ServeConfig


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*ServeConfig._ENV.values(), *EngineConfig._ENV.values()):
        monkeypatch.delenv(var, raising=False)


def test_serve_defaults_then_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = ServeConfig.from_env()
    assert defaults == ServeConfig()
    assert defaults.database == "sqlite+aiosqlite:///.tokenyard/tokenyard.db"
    assert defaults.replica_token is None and defaults.redis_url is None

    monkeypatch.setenv("TOKENYARD_STATE_DIR", "/srv/ty")
    monkeypatch.setenv("TOKENYARD_REPLICA_TOKEN", "s3cret")
    monkeypatch.setenv("TOKENYARD_KEY_CACHE_TTL_S", "2.5")
    monkeypatch.setenv("TOKENYARD_LEDGER_MAX_BATCH", "64")
    monkeypatch.setenv("TOKENYARD_DRAIN_TIMEOUT_S", "7")
    monkeypatch.setenv("TOKENYARD_REDIS_URL", "  ")  # blank: unset
    config = ServeConfig.from_env(drain_timeout_s=3.0, billing_refresh_s=None)
    assert config.state_dir == Path("/srv/ty") and config.journal_dir == Path("/srv/ty/journal")
    assert config.database == "sqlite+aiosqlite:////srv/ty/tokenyard.db"
    assert config.dev_key_file == Path("/srv/ty/dev-key")
    assert (config.replica_token, config.key_cache_ttl_s, config.ledger_max_batch) == (
        "s3cret", 2.5, 64)
    assert config.drain_timeout_s == 3.0  # the flag beats the environment
    assert config.billing_refresh_s == 1.0 and config.redis_url is None  # None flag: ignored

    monkeypatch.setenv("TOKENYARD_DATABASE_URL", "postgresql://db/ty")
    assert ServeConfig.from_env().database == "postgresql://db/ty"


def test_a_bad_value_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENYARD_LEDGER_MAX_BATCH", "many")
    with pytest.raises(ValueError, match="TOKENYARD_LEDGER_MAX_BATCH"):
        ServeConfig.from_env()
    monkeypatch.setenv("TOKENYARD_LEDGER_MAX_BATCH", "0")
    with pytest.raises(ValueError, match="ledger_max_batch"):
        ServeConfig.from_env()
    with pytest.raises(ValueError, match=">= 0"):
        ServeConfig.from_env(key_cache_ttl_s=-1.0)


def test_responses_retention_comes_from_the_environment_then_serve_s_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tokenyard.cli.main import _light_parser, serve_config

    parser = _light_parser("serve")
    assert serve_config(parser.parse_args(["serve"])).responses_retention_days == 30.0
    monkeypatch.setenv("TOKENYARD_RESPONSES_RETENTION_DAYS", "7")
    assert serve_config(parser.parse_args(["serve"])).responses_retention_days == 7.0
    args = parser.parse_args(["serve", "--responses-retention-days", "0.5"])
    assert serve_config(args).responses_retention_days == 0.5
    with pytest.raises(ValueError, match="responses_retention_days"):
        serve_config(parser.parse_args(["serve", "--responses-retention-days", "0"]))


def test_request_records_retention_and_redaction_patterns_from_serve_s_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tokenyard.cli.main import _light_parser, serve_config

    parser = _light_parser("serve")
    config = serve_config(parser.parse_args(["serve"]))
    assert config.request_records_retention_hours == 24.0 and config.redact_patterns == ()
    monkeypatch.setenv("TOKENYARD_REQUEST_RECORDS_RETENTION_HOURS", "2")
    assert serve_config(parser.parse_args(["serve"])).request_records_retention_hours == 2.0
    config = serve_config(parser.parse_args([
        "serve", "--request-records-retention-hours", "0.5", "--redact-pattern", "ACME-\\d+",
        "--redact-pattern", "secret"]))
    assert config.request_records_retention_hours == 0.5
    assert config.redact_patterns == ("ACME-\\d+", "secret")
    with pytest.raises(ValueError, match="redact-pattern"):
        serve_config(parser.parse_args(["serve", "--redact-pattern", "("]))
    with pytest.raises(ValueError, match="retention"):
        serve_config(parser.parse_args(["serve", "--request-records-retention-hours", "0"]))


def test_engine_config_reads_the_environment_the_same_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKENYARD_KV_CACHE_GIB", "0.25")
    monkeypatch.setenv("TOKENYARD_MAX_NUM_SEQS", "8")
    config = EngineConfig.from_env(max_num_seqs=4)
    assert (config.kv_cache_gib, config.max_num_seqs) == (0.25, 4)
    with pytest.raises(ValueError, match="weights"):
        EngineConfig.from_env(weights="int4")


def test_the_gateway_runs_on_the_values_it_was_given(tmp_path: Path) -> None:
    from tokenyard.gateway.gate import Gateway
    from tokenyard.gateway.limits import InProcessLimiter

    config = ServeConfig(state_dir=tmp_path, billing_refresh_s=0.5, prices_refresh_s=30.0,
                         ledger_flush_interval_s=0.2, ledger_max_batch=7,
                         responses_retention_days=2.0)

    async def main() -> tuple[float, float, float, int, bool, float, bool]:
        gateway, dev_key = await Gateway.open(config.database, InProcessLimiter(),
                                              config.journal_dir, config=config)
        try:
            billing, ledger = gateway.billing, gateway.billing.ledger
            purging = gateway.responses._task is not None and not gateway.responses._task.done()
            return (billing.refresh_s, billing.prices_refresh_s, ledger.flush_interval,
                    ledger.max_batch, dev_key is not None,
                    gateway.responses.retention.total_seconds(), purging)
        finally:
            await gateway.close()

    assert asyncio.run(main()) == (0.5, 30.0, 0.2, 7, True, 2 * 86_400.0, True)
