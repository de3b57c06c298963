"""Enrich orders with a table of customers and a global table of products (docs/how-to/tables.md).

Run it against a server of yours (topics "orders" and "customers" with the same partition count,
"products", "enriched-orders")::

    pspf run examples.enrich_orders:app
"""

import msgspec

from pspf import App, Context


class Customer(msgspec.Struct):
    name: str
    tier: str


class Product(msgspec.Struct):
    price: int


class Order(msgspec.Struct):
    product: str
    qty: int


app = App("enrich-orders")
app.table("customers", value_type=Customer)  # keyed by customer, the partition count of "orders"
app.global_table("products", value_type=Product)  # any partition count, looked up by any key


@app.handler("orders")  # keyed by customer
def enrich(order: Order, ctx: Context) -> None:
    customer: Customer | None = ctx.table("customers")  # this entry's key
    product: Product | None = ctx.table("products", key=order.product)
    if product is None:
        raise LookupError(f"no product {order.product!r}")  # retried, then the DLQ
    revenue = order.qty * product.price
    ctx.state["revenue"] = ctx.state.get("revenue", 0) + revenue
    ctx.emit(
        "enriched-orders",
        {"customer": ctx.key, "tier": customer.tier if customer else None, "revenue": revenue},
        key=ctx.key,
    )
