"""Money: integer micro-units of currency (1 unit = 1,000,000 micros), never floats.

Prices are micros per MILLION tokens, so a request's cost is
    sum(tokens_i * price_i) / 1,000,000
computed in integers and rounded ONCE, half up, at the end. Rounding per line item
instead would let a stream of tiny requests drift from what the price list says.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

MICROS_PER_UNIT = 1_000_000
TOKENS_PER_PRICE_UNIT = 1_000_000  # prices are quoted per million tokens


@dataclass(frozen=True)
class Prices:
    """One model's price list, each field in micros per million tokens."""

    input: int = 0  # uncached prompt tokens
    cached_input: int = 0  # prompt tokens served from the prefix cache
    output: int = 0  # generated tokens


def cost_quarters(
    prices: Prices, uncached_input: int, cached_input: int, output: int,
    cache_write_5m: int = 0, cache_write_1h: int = 0,
) -> dict[str, int]:
    """Each line item of one request's cost in quarter micro-units per million tokens
    (exact integers, not rounded): "input" (uncached), "cached_input", "output" and
    "cache_write" (prompt-cache writes: the input price times 1.25 kept 5 minutes, times 2
    kept 1 hour, Anthropic's multipliers)."""
    counts = (uncached_input, cached_input, output, cache_write_5m, cache_write_1h)
    if min(counts) < 0:
        raise ValueError(f"token counts must be non-negative, got {counts}")
    return {
        "input": 4 * uncached_input * prices.input,
        "cached_input": 4 * cached_input * prices.cached_input,
        "output": 4 * output * prices.output,
        "cache_write": (5 * cache_write_5m + 8 * cache_write_1h) * prices.input,
    }


#: What one `cost_quarters` unit is in currency units (a quarter micro per million tokens).
QUARTER_UNIT = Decimal(1) / (4 * TOKENS_PER_PRICE_UNIT * MICROS_PER_UNIT)


def cost_micros(
    prices: Prices, uncached_input: int, cached_input: int, output: int,
    cache_write_5m: int = 0, cache_write_1h: int = 0,
) -> int:
    """Cost in micros of one request's token counts under `prices`.

    Exact integer arithmetic, in quarter micros (`cost_quarters`): the per-million
    products are summed first and divided once, rounding half up (0.5 micro -> 1 micro).
    """
    quarters = sum(cost_quarters(prices, uncached_input, cached_input, output,
                                 cache_write_5m, cache_write_1h).values())
    # Floor division of (n + d/2) rounds half up for the non-negative n we have here.
    divisor = 4 * TOKENS_PER_PRICE_UNIT
    return (quarters + divisor // 2) // divisor


def parse_money(text: str) -> int:
    """Micros from a decimal amount such as "12.50" (-> 12_500_000); at most 6 decimals."""
    try:
        amount = Decimal(text.strip())
    except InvalidOperation:
        raise ValueError(f"not an amount of money: {text!r}") from None
    if not amount.is_finite():
        raise ValueError(f"not an amount of money: {text!r}")
    micros = amount * MICROS_PER_UNIT
    if micros != micros.to_integral_value():
        # Silently rounding an admin's input would credit a different amount than typed.
        raise ValueError(f"{text!r} has more than 6 decimal places")
    return int(micros)


def format_money(micros: int) -> str:
    """A decimal string with exactly 6 places from micros: 12_500_000 -> "12.500000"."""
    return f"{Decimal(micros).scaleb(-6):.6f}"


def format_exact(quarters: int) -> str:
    """A line item (`cost_quarters`) as an exact decimal string of currency units, never
    fewer than 6 places: 6 (quarter micros per million) -> "0.0000000000015" is kept
    whole rather than rounded, so the parts add up to the unrounded total."""
    amount = (Decimal(quarters) * QUARTER_UNIT).normalize()
    text = f"{amount:f}"
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(6, '0')}"
