"""A stream app: purchases filtered, re-keyed by customer and totalled per customer per minute.

Run it (after ``pspf topic create orders --partitions 4`` and ``pspf topic create
spend-per-minute --partitions 4``)::

    pspf run examples.spend_per_minute:main

``pspf describe examples.spend_per_minute:main`` prints its steps. See docs/how-to/dataflow.md.
"""

from __future__ import annotations

from datetime import timedelta

import msgspec

from pspf import App, agg, windows


class Order(msgspec.Struct):
    oid: str
    customer: str
    qty: int
    price: float
    ts: int  # event time, epoch milliseconds


main = App("spend")

(
    main.stream("orders", value_type=Order)
    .filter(lambda o: o.qty > 0)
    .map(lambda o: {"customer": o.customer, "amount": o.qty * o.price, "ts": o.ts})
    .group_by(lambda v: v["customer"], topic="spend-by-customer")
    .window(windows.tumbling(timedelta(minutes=1)), timestamp="ts", grace=timedelta(seconds=30))
    .agg(total=agg.Sum("amount"), n=agg.Count())
    .to("spend-per-minute")
)
