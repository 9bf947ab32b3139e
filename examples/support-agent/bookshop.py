"""Pageturner Books: the support agent's world and its four tools, in two versions.

The world (customers, orders, parcels, the catalogue) is made from a seed, so the traffic
generator (``traffic.py``), the agent (``agent.py``) and the MCP server (``mcp_server.py``)
built with the same seed see the same shop and compute the same tool results, byte for byte.

Tools (``TOOLS[api]``):

- ``find_order(order_id)``: an order's customer, books, total, carrier and tracking id;
- ``track_parcel(tracking_id)``: a parcel's status and its date (expected, delivered on, or
  lost since); **API v2** adds a required ``carrier`` (the one ``find_order`` names), as the
  shop's carrier integration changed mid-month. A v1-shaped call to v2 fails with the usage
  error every tool gives a call its schema refuses (the wording of Ratchet's replay
  sandbox, so a recorded error and a replayed one read alike);
- ``refund_order(order_id, reason)``: refunds an order in full, ``lost`` only for a lost
  parcel, ``damaged`` only for a delivered one (idempotent: the refund id is the order's);
- ``check_stock(title)``: a book's author, price, copies in stock, and when it is back.

Results are JSON text (``json.dumps`` of a dict; a domain error is ``{"error": "..."}``),
as a tool runtime hands them to the model.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date, timedelta
from typing import Any

API_VERSIONS = ("v1", "v2")
CARRIERS = ("DHL", "UPS", "GLS", "DPD")
STATUSES = ("in transit", "delivered", "lost")
WORLD_ORDERS = 6000  # orders in the shop; a traffic file uses each at most once
SYSTEM_PROMPT = "Pageturner Books support: use the tools, never guess."

_ORDER_ID = re.compile(r"^PT-\d{5}$")
_TRACKING_ID = re.compile(r"^TR-\d{5}$")

_ORDER_ID_PROP = {"type": "string", "description": "e.g. PT-10482"}
FIND_ORDER = {
    "name": "find_order",
    "description": "Look up an order: customer, books, total, carrier and tracking id.",
    "parameters": {
        "type": "object",
        "properties": {"order_id": _ORDER_ID_PROP},
        "required": ["order_id"],
    },
}
TRACK_PARCEL_V1 = {
    "name": "track_parcel",
    "description": "Where a parcel is: its status and date.",
    "parameters": {
        "type": "object",
        "properties": {"tracking_id": {"type": "string", "description": "e.g. TR-55012"}},
        "required": ["tracking_id"],
    },
}
TRACK_PARCEL_V2 = {
    "name": "track_parcel",
    "description": "Where a parcel is: its status and date. Name the parcel's carrier.",
    "parameters": {
        "type": "object",
        "properties": {
            "tracking_id": {"type": "string", "description": "e.g. TR-55012"},
            "carrier": {
                "type": "string",
                "enum": list(CARRIERS),
                "description": "the carrier find_order names",
            },
        },
        "required": ["tracking_id", "carrier"],
    },
}
REFUND_ORDER = {
    "name": "refund_order",
    "description": "Refund an order in full: lost parcels and damaged books only.",
    "parameters": {
        "type": "object",
        "properties": {
            "order_id": _ORDER_ID_PROP,
            "reason": {"type": "string", "enum": ["damaged", "lost"]},
        },
        "required": ["order_id", "reason"],
    },
}
CHECK_STOCK = {
    "name": "check_stock",
    "description": "A book's author, price, copies in stock and restock date.",
    "parameters": {
        "type": "object",
        "properties": {"title": {"type": "string", "description": "the book's title"}},
        "required": ["title"],
    },
}
TOOLS: dict[str, list[dict[str, Any]]] = {
    "v1": [FIND_ORDER, TRACK_PARCEL_V1, REFUND_ORDER, CHECK_STOCK],
    "v2": [FIND_ORDER, TRACK_PARCEL_V2, REFUND_ORDER, CHECK_STOCK],
}

CATALOGUE = (
    ("Middlemarch", "George Eliot"),
    ("Persuasion", "Jane Austen"),
    ("Emma", "Jane Austen"),
    ("Bleak House", "Charles Dickens"),
    ("Great Expectations", "Charles Dickens"),
    ("Jane Eyre", "Charlotte Bronte"),
    ("Wuthering Heights", "Emily Bronte"),
    ("Moby-Dick", "Herman Melville"),
    ("Anna Karenina", "Leo Tolstoy"),
    ("War and Peace", "Leo Tolstoy"),
    ("Crime and Punishment", "Fyodor Dostoevsky"),
    ("The Idiot", "Fyodor Dostoevsky"),
    ("Madame Bovary", "Gustave Flaubert"),
    ("Les Miserables", "Victor Hugo"),
    ("Dracula", "Bram Stoker"),
    ("Frankenstein", "Mary Shelley"),
    ("Ulysses", "James Joyce"),
    ("Dubliners", "James Joyce"),
    ("Mrs Dalloway", "Virginia Woolf"),
    ("To the Lighthouse", "Virginia Woolf"),
    ("The Age of Innocence", "Edith Wharton"),
    ("Little Women", "Louisa May Alcott"),
    ("Heart of Darkness", "Joseph Conrad"),
    ("Nostromo", "Joseph Conrad"),
    ("The Trial", "Franz Kafka"),
    ("Buddenbrooks", "Thomas Mann"),
    ("Don Quixote", "Miguel de Cervantes"),
    ("Candide", "Voltaire"),
    ("The Odyssey", "Homer"),
    ("Walden", "Henry David Thoreau"),
    ("Silas Marner", "George Eliot"),
    ("North and South", "Elizabeth Gaskell"),
    ("Vanity Fair", "William Makepeace Thackeray"),
    ("Kidnapped", "Robert Louis Stevenson"),
    ("Treasure Island", "Robert Louis Stevenson"),
    ("The Moonstone", "Wilkie Collins"),
    ("Middlesex", "Jeffrey Eugenides"),
    ("Beloved", "Toni Morrison"),
    ("Kindred", "Octavia Butler"),
    ("Solaris", "Stanislaw Lem"),
    ("Dune", "Frank Herbert"),
    ("Neuromancer", "William Gibson"),
    ("The Remains of the Day", "Kazuo Ishiguro"),
    ("Atonement", "Ian McEwan"),
    ("Possession", "A. S. Byatt"),
    ("Rebecca", "Daphne du Maurier"),
    ("Stoner", "John Williams"),
    ("The Leopard", "Giuseppe Tomasi di Lampedusa"),
)
FIRST_NAMES = (
    "Maria", "Jonas", "Aisha", "Tomasz", "Elena", "Kwame", "Ingrid", "Rahul", "Chloe", "Mateo",
    "Yuki", "Fatima", "Liam", "Sofia", "Anders", "Priya", "Noah", "Leila", "Oskar", "Amara",
    "Daniel", "Hana", "Pierre", "Zara", "Mikael", "Nadia", "Felix", "Rosa", "Omar", "Greta",
    "Ivan", "Lucia", "Theo", "Mei", "Hugo", "Ines", "Samuel", "Alma", "Kofi", "Vera",
)  # fmt: skip
LAST_NAMES = (
    "Lopez", "Becker", "Okafor", "Nowak", "Rossi", "Mensah", "Larsen", "Sharma", "Dubois",
    "Garcia", "Tanaka", "Haddad", "Murphy", "Costa", "Nilsson", "Iyer", "Fischer", "Rahimi",
    "Berg", "Adeyemi", "Klein", "Sato", "Moreau", "Ali", "Virtanen", "Petrov", "Wagner",
    "Silva", "Yilmaz", "Novak", "Kowalski", "Romano", "Jensen", "Chen", "Schmidt", "Martin",
)  # fmt: skip


@dataclass(frozen=True)
class Book:
    """A title in the catalogue: price, copies in stock, and when a sold-out one is back."""

    title: str
    author: str
    price_eur: float
    in_stock: int
    restock_on: str | None


@dataclass(frozen=True)
class Parcel:
    """A shipment: carrier, status and the date that goes with the status."""

    tracking_id: str
    carrier: str
    status: str  # one of STATUSES
    date: str  # expected (in transit), delivered on, or lost since

    def to_result(self) -> dict[str, Any]:
        key = {"in transit": "expected", "delivered": "delivered_on", "lost": "lost_since"}
        return {
            "tracking_id": self.tracking_id,
            "carrier": self.carrier,
            "status": self.status,
            key[self.status]: self.date,
        }


@dataclass(frozen=True)
class Order:
    """A customer's order and its parcel."""

    order_id: str
    customer: str
    books: tuple[str, ...]
    total_eur: float
    placed_on: str
    parcel: Parcel

    def to_result(self) -> dict[str, Any]:
        return {
            "order_id": self.order_id,
            "customer": self.customer,
            "books": list(self.books),
            "total_eur": self.total_eur,
            "placed_on": self.placed_on,
            "carrier": self.parcel.carrier,
            "tracking_id": self.parcel.tracking_id,
        }


def eur(amount: float) -> str:
    """An amount as the shop writes it in answers: ``19.90 EUR``."""
    return f"{amount:.2f} EUR"


class Shop:
    """The shop's data, made from a seed, and its tools (:meth:`call`)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        rng = random.Random(f"pageturner/{seed}")
        self.books = {title.casefold(): _book(rng, title, author) for title, author in CATALOGUE}
        numbers = rng.sample(range(10000, 100000), WORLD_ORDERS)
        tracking = rng.sample(range(10000, 100000), WORLD_ORDERS)
        self.orders: dict[str, Order] = {}
        self.parcels: dict[str, Parcel] = {}
        for number, track in zip(numbers, tracking, strict=True):
            order = _order(rng, f"PT-{number}", f"TR-{track}", self.books)
            self.orders[order.order_id] = order
            self.parcels[order.parcel.tracking_id] = order.parcel
        self.order_ids = tuple(self.orders)  # in the seed's order

    def refund_id(self, order_id: str) -> str:
        """The refund of an order has one id (a repeated refund is the same refund)."""
        digest = hashlib.sha256(f"pageturner/{self.seed}/refund/{order_id}".encode()).digest()
        return f"RF-{10000 + int.from_bytes(digest[:4], 'big') % 90000}"

    def book(self, title: str) -> Book | None:
        return self.books.get(" ".join(title.split()).casefold())

    def call(self, api: str, name: str, arguments: Mapping[str, Any] | str) -> str:
        """What tool ``name`` of API ``api`` answers to ``arguments`` (JSON text)."""
        if api not in TOOLS:
            raise ValueError(f"unknown API version {api!r}; one of {', '.join(API_VERSIONS)}")
        spec = next((t for t in TOOLS[api] if t["name"] == name), None)
        if spec is None:
            return f"error: unknown tool {name}"
        args = _arguments(name, arguments)
        if isinstance(args, str):
            return args
        required = spec["parameters"]["required"]
        missing = sorted(str(r) for r in required if r not in args)
        if missing:
            return f"error: {name} is missing required argument(s) {', '.join(missing)}"
        return json.dumps(self._answer(name, args))

    def _answer(self, name: str, args: Mapping[str, Any]) -> dict[str, Any]:
        if name == "find_order":
            found = self._order(args["order_id"])
            return found if isinstance(found, dict) else found.to_result()
        if name == "track_parcel":
            return self._track(args["tracking_id"], args.get("carrier"))
        if name == "refund_order":
            return self._refund(args["order_id"], args["reason"])
        return self._stock(args["title"])

    def _order(self, order_id: Any) -> Order | dict[str, Any]:
        if not isinstance(order_id, str) or not _ORDER_ID.match(order_id.strip()):
            return {"error": "order_id must look like PT-10482"}
        order = self.orders.get(order_id.strip())
        return order if order is not None else {"error": f"no order {order_id.strip()}"}

    def _track(self, tracking_id: Any, carrier: Any) -> dict[str, Any]:
        if not isinstance(tracking_id, str) or not _TRACKING_ID.match(tracking_id.strip()):
            return {"error": "tracking_id must look like TR-55012"}
        parcel = self.parcels.get(tracking_id.strip())
        if parcel is None:
            return {"error": f"no parcel {tracking_id.strip()}"}
        if carrier is not None and str(carrier).strip().upper() != parcel.carrier:
            return {"error": f"parcel {parcel.tracking_id} is not with {carrier}"}
        return parcel.to_result()

    def _refund(self, order_id: Any, reason: Any) -> dict[str, Any]:
        if reason not in ("damaged", "lost"):
            return {"error": "reason must be damaged or lost"}
        order = self._order(order_id)
        if isinstance(order, dict):
            return order
        status = order.parcel.status
        if reason == "lost" and status != "lost":
            return {"error": f"the parcel of {order.order_id} is not lost: it is {status}"}
        if reason == "damaged" and status != "delivered":
            return {"error": f"{order.order_id} has not been delivered: it is {status}"}
        return {
            "order_id": order.order_id,
            "refund_id": self.refund_id(order.order_id),
            "amount_eur": order.total_eur,
            "reason": reason,
        }

    def _stock(self, title: Any) -> dict[str, Any]:
        book = self.book(title) if isinstance(title, str) else None
        if book is None:
            return {"error": f"no book titled {title!r}"}
        result: dict[str, Any] = {
            "title": book.title,
            "author": book.author,
            "price_eur": book.price_eur,
            "in_stock": book.in_stock,
        }
        if book.restock_on is not None:
            result["restock_on"] = book.restock_on
        return result


def _arguments(name: str, arguments: Mapping[str, Any] | str) -> dict[str, Any] | str:
    """The call's arguments as an object, or the error a tool gives arguments it cannot read."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return f"error: arguments of {name} are not valid JSON"
    if not isinstance(arguments, Mapping):
        return f"error: arguments of {name} must be a JSON object"
    return dict(arguments)


def _day(start: date, rng: random.Random, low: int, high: int) -> str:
    return (start + timedelta(days=rng.randint(low, high))).isoformat()


def _book(rng: random.Random, title: str, author: str) -> Book:
    price = rng.choice((7.5, 8.9, 9.9, 11.5, 12.0, 13.9, 14.5, 16.0, 18.9, 21.5, 24.0))
    sold_out = rng.random() < 0.3
    restock = _day(date(2026, 12, 1), rng, 0, 27) if sold_out else None
    return Book(title, author, price, 0 if sold_out else rng.randint(1, 12), restock)


def _order(rng: random.Random, order_id: str, tracking_id: str, books: Mapping[str, Book]) -> Order:
    chosen = rng.sample(sorted(books), rng.choice((1, 1, 1, 2, 2, 3)))
    titles = tuple(books[key].title for key in chosen)
    total = round(sum(books[key].price_eur for key in chosen) + 3.5, 2)  # 3.50 shipping
    placed = date(2026, 10, 20) + timedelta(days=rng.randint(0, 38))
    status = rng.choices(STATUSES, weights=(45, 45, 10))[0]
    if status == "in transit":
        when = _day(placed, rng, 6, 14)
    elif status == "delivered":
        when = _day(placed, rng, 2, 5)
    else:
        when = _day(placed, rng, 1, 4)
    customer = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    parcel = Parcel(tracking_id, rng.choice(CARRIERS), status, when)
    return Order(order_id, customer, titles, total, placed.isoformat(), parcel)
